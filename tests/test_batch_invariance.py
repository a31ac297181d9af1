"""One answer whatever the batch: the default model on its default CPU path (int4 weights, bfloat16
activations) gives each of 16 prompts the same greedy tokens served at concurrency 1, 4 and 16,
offline with all of them in one batch, in chunks of 32 prompt tokens, and with n-gram speculation
(served: the texts of the offline batch's tokens).

Each row of a step is computed by the same kernels in the same order whatever else the step
holds: the packed int4/int8 GEMMs for every row count, a decode's attention by the C++ kernel one
row at a time, the logits head's best logits recomputed in float32.
"""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from common.protocol import SamplingParams
from pagoda.offline import LLM
from tests.stack import Stack

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
    "The three laws of thermodynamics are", "Name a primary color.", "What is 12 times 12?",
    "Why is the sky blue?", "Write a haiku about the sea.", "What does a bee make?", "Translate 'thank you' to French.",
    "List three fruits.", "What is the boiling point of water?", "Who painted the Mona Lisa?",
    "Give me a synonym for happy.", "What is the largest planet?", "How do plants make food?",
]


@pytest.fixture(scope="module")
def offline():
    llm = LLM("default", device="cpu", quantization="int4")
    yield llm
    llm.close()


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _offline_tokens(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"messages": _chat(q)} for q in QUESTIONS], greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _offline_texts(llm: LLM) -> list[str]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate([{"messages": _chat(q)} for q in QUESTIONS], greedy,
                                                     use_tqdm=False)]


def test_offline_alone_in_one_batch_in_chunks_and_with_ngram_speculation(offline):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline.reset(enable_prefix_caching=False)
    alone = [offline.generate({"messages": _chat(q)}, greedy, use_tqdm=False)[0].outputs[0].token_ids
             for q in QUESTIONS]
    assert _offline_tokens(offline) == alone
    offline.reset(max_num_batched_tokens=32)
    assert _offline_tokens(offline) == alone
    offline.reset(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert _offline_tokens(offline) == alone


def test_served_at_concurrency_1_4_and_16_equals_one_offline_batch(offline):
    offline.reset()
    expected = _offline_texts(offline)
    stack = Stack("--quantization", "int4").wait_ready()
    try:
        def ask(question: str) -> str:
            body = {"model": "SmolLM2-135M-Instruct", "messages": _chat(question), "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            reply = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
            return reply.json()["choices"][0]["message"]["content"]

        for concurrency in (1, 4, 16):
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                assert list(pool.map(ask, QUESTIONS)) == expected, f"concurrency {concurrency}"
    finally:
        stack.stop()
