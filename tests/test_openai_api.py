"""[openai-api] through the real stack: one `pagoda up` (the default model on CPU) for scoring (echo,
prompt logprobs), logit_bias, structured output and tool calls over HTTP, and the real clients
(lm-evaluation-harness, the openai SDK)."""
from __future__ import annotations

import pytest

from tests.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


# ----------------------------------------------------------------------------- scoring: echo, prompt_logprobs, max_tokens 0
# (helper "scoring")
import json  # noqa: E402 (each section imports what it uses: the sections merge apart)

import httpx  # noqa: E402

from gateway.tokenizer import load_tokenizer  # noqa: E402

SCORING_PROMPT = "The capital of France is Paris. The capital of Italy is"


def _post(stack, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(stack.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def scoring_prompt_ids():
    return load_tokenizer("default").encode(SCORING_PROMPT)


def test_echo_logprobs_max_tokens_0_scores_the_prompt(stack, scoring_prompt_ids):
    """lm-evaluation-harness's loglikelihood body, with max_tokens 0: the prompt's text, one entry per
    prompt token (the first null), nothing generated."""
    body = _post(stack, {"prompt": scoring_prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                         "temperature": 0})
    [choice] = body["choices"]
    assert choice["text"] == SCORING_PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    n = len(scoring_prompt_ids)
    assert [len(logprobs[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 and max(top.values()) >= lp
               for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:]))
    tokenizer = load_tokenizer("default")
    assert logprobs["text_offset"] == [len(tokenizer.decode(scoring_prompt_ids[:i])) for i in range(n)]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in scoring_prompt_ids]
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}
    # lm-eval's own body (max_tokens 1): the prompt's entries, then the generated token's
    lm_eval = _post(stack, {"prompt": [scoring_prompt_ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                            "temperature": 0, "seed": 1234})
    [choice_1] = lm_eval["choices"]
    assert len(choice_1["logprobs"]["token_logprobs"]) == n + 1
    assert choice_1["logprobs"]["token_logprobs"][:n] == logprobs["token_logprobs"]
    assert choice_1["logprobs"]["top_logprobs"][:n] == logprobs["top_logprobs"]
    assert choice_1["text"].startswith(SCORING_PROMPT) and len(choice_1["text"]) > len(SCORING_PROMPT)
    # what lm-eval reads of it: the continuation's summed logprobs, greedy when each token ranked first
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ranks = _post(stack, {"prompt": scoring_prompt_ids, "prompt_logprobs": 0, "max_tokens": 0,
                          "echo": True})["choices"][0]["prompt_logprobs"]
    ranks = [None] + [entry[str(t)]["rank"] for t, entry in zip(scoring_prompt_ids[1:], ranks[1:])]
    for ctxlen in (1, n - 3, n - 1):
        [(total, greedy)] = LocalCompletionsAPI.parse_logprobs(lm_eval, ctxlens=[ctxlen])
        assert total == sum(logprobs["token_logprobs"][ctxlen:])
        assert greedy == all(rank == 1 for rank in ranks[ctxlen:])


def test_echo_with_generation_streams_the_prompt_first(stack, scoring_prompt_ids):
    """n = 2: each choice echoes the prompt (its logprobs from the one request's prompt logprobs),
    streamed in each choice's first chunk; the chunks add up to the whole body."""
    request = {"prompt": SCORING_PROMPT, "echo": True, "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 1}
    whole = _post(stack, request)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    n = len(scoring_prompt_ids)
    for choice in whole["choices"]:
        assert choice["text"].startswith(SCORING_PROMPT) and len(choice["text"]) > len(SCORING_PROMPT)
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == n + 4 and token_logprobs[0] is None and None not in token_logprobs[1:]
        assert choice["logprobs"]["text_offset"][n] == len(SCORING_PROMPT)  # the first generated token's
    firsts: dict[int, dict] = {}
    texts, logprobs = {0: "", 1: ""}, {0: [], 1: []}
    with httpx.stream("POST", stack.url + "/v1/completions", json={**request, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                [choice] = json.loads(line[6:])["choices"]
                firsts.setdefault(choice["index"], choice)
                texts[choice["index"]] += choice["text"]
                logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
    assert set(firsts) == {0, 1}
    assert all(first["text"].startswith(SCORING_PROMPT) and len(first["logprobs"]["tokens"]) >= n
               for first in firsts.values())
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert logprobs == {c["index"]: c["logprobs"]["token_logprobs"] for c in whole["choices"]}


def test_prompt_logprobs_shape(stack, scoring_prompt_ids):
    """vLLM's prompt_logprobs in each choice: [null, {"<id>": {logprob, rank, decoded_token}}, ...]:
    the prompt token's own entry first, then the top 2; on chat too."""
    body = _post(stack, {"prompt": scoring_prompt_ids, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    [choice] = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(scoring_prompt_ids) and entries[0] is None
    for token_id, entry in zip(scoring_prompt_ids[1:], entries[1:]):
        keys = list(entry)
        assert keys[0] == str(token_id) and len(keys) in (2, 3)
        own = entry[str(token_id)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["rank"] >= 1 and own["logprob"] <= 0
        tops = [entry[key] for key in keys[1:]]
        assert [t["rank"] for t in tops] == sorted(t["rank"] for t in tops)
        if own["rank"] <= 2:  # then it is one of the top 2 itself
            assert len(keys) == 2
    assert "prompt_logprobs" not in _post(stack, {"prompt": "Hi", "max_tokens": 1})["choices"][0]
    chat = _post(stack, {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 1},
                 "/v1/chat/completions")
    [chat_choice] = chat["choices"]
    assert chat_choice["prompt_logprobs"][0] is None
    assert len(chat_choice["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat_choice["prompt_logprobs"][1:])


# ----------------------------------------------------------------------------- structured output, logit_bias, tools over HTTP
# (helper "api")


# ----------------------------------------------------------------------------- real clients: lm-evaluation-harness, the openai SDK
# (helper "clients")
