"""Greedy output equals transformers' generate(do_sample=False) token for token on SmolLM2.

The reference model is transformers' own LlamaForCausalLM loaded from the Hugging Face directory
that transformers itself produced from the GGUF file (see worker/loader.py). Pagoda runs on
`--device` (default cpu; `make test-gpu` passes cuda) in float32, the reference on CPU.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.prompts import PARITY_PROMPTS

pytestmark = pytest.mark.slow
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm(device, request):
    """On CPU tests/conftest.py's session engine (the default model, float32), reset; else one on `device`."""
    from pagoda.offline import LLM

    if device != "cpu":
        return LLM("default", device=device, dtype="float32")
    llm = request.getfixturevalue("default_llm")
    llm.reset()
    return llm


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.encode(p) for p in PARITY_PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(llm, prompt_ids):
    from transformers import AutoModelForCausalLM

    from worker.loader import hf_directory

    model = AutoModelForCausalLM.from_pretrained(hf_directory(llm.executor.runner.source), dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def test_prompts_cover_chat_plain_short_and_long(prompt_ids):
    assert len(prompt_ids) >= 8
    assert max(len(ids) for ids in prompt_ids) > 300 and min(len(ids) for ids in prompt_ids) < 20


def test_cli_greedy_matches_transformers(tmp_path, hf_outputs, prompt_ids, device):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PARITY_PROMPTS))
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--json", "--temperature", "0", "--max-tokens",
         str(MAX_TOKENS), "--prompts-file", str(prompts_file), "--device", device, "--dtype", "float32"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in results] == list(range(len(PARITY_PROMPTS)))
    for result, expected in zip(results, hf_outputs):
        assert result["token_ids"] == expected
        assert result["finish_reason"] == ("stop" if expected[-1] == 2 else "length")


TP_MAX_TOKENS = 16  # the group's steps cost a few all-reduces per layer: fewer tokens keep it within budget


def test_cli_tensor_parallel_greedy_matches_transformers(tmp_path, hf_outputs, device):
    """`--tensor-parallel-size 3`: each rank 3 of the 9 query heads, 1 of the 3 KV heads, a third of
    the MLP and of the vocabulary (gloo on CPU): transformers' greedy tokens, as size 1 gives
    (test_cli_greedy_matches_transformers)."""
    if device != "cpu" and torch.cuda.device_count() < 3:
        pytest.skip("a GPU per rank: needs 3 GPUs")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in PARITY_PROMPTS))
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--json", "--temperature", "0", "--max-tokens",
         str(TP_MAX_TOKENS), "--prompts-file", str(prompts_file), "--device", device, "--dtype", "float32",
         "--tensor-parallel-size", "3", "--num-gpu-blocks", "512"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["token_ids"] for r in results] == [expected[:TP_MAX_TOKENS] for expected in hf_outputs]
    assert proc.stderr.count("joined generation 0 (gloo)" if device == "cpu" else "joined generation 0 (nccl)") == 3


@pytest.mark.parametrize(
    "num_gpu_blocks, max_num_batched_tokens, enforce_eager",
    # a pool too small for the batch, decode steps through the padded static buffers (CUDA graphs
    # on CUDA); and chunked prefill as well, every step eager (--enforce-eager)
    [(56, 2048, False), (56, 48, True)],
)
def test_greedy_matches_transformers_under_preemption(llm, hf_outputs, prompt_ids, num_gpu_blocks,
                                                      max_num_batched_tokens, enforce_eager, device):
    from common.protocol import SamplingParams
    from pagoda.offline import LLM

    if enforce_eager:  # a worker of its own: --enforce-eager is the worker's
        llm = LLM("default", device=device, dtype="float32", num_gpu_blocks=num_gpu_blocks,
                  max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager)
    else:  # the module's worker (a bigger pool) under a scheduler of num_gpu_blocks
        llm.reset(num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=max_num_batched_tokens)
    assert (llm.executor.runner.decode_runner is None) == enforce_eager
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    print("preemptions:", llm.scheduler.num_preemptions, "steps:", llm.engine.num_steps)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == hf_outputs
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks


SPEC_MAX_TOKENS = 16  # four more engines, three with a second model to run: fewer tokens keep them within budget


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_with_each_speculative_method_matches_transformers(method, llm, hf_outputs, prompt_ids, device, tmp_path):
    """The parity prompts with drafts: transformers' greedy tokens whatever the drafts
    (n-gram lookups; the default model as its own draft model; random EAGLE-1 and EAGLE-3 heads of
    its shape, as no trained one can be fetched here)."""
    from transformers import AutoConfig

    from common.protocol import SamplingParams
    from pagoda.offline import LLM
    from tests.conftest import ROOT
    from tests.test_speculative_draft import _write_eagle_head

    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = "default"
    elif method.startswith("eagle"):
        config = AutoConfig.from_pretrained(str(ROOT / "worker" / "configs" / "smollm2-135m.json"))
        spec["model"] = _write_eagle_head(tmp_path, config, method == "eagle3", 7)
    if method == "ngram":  # drafts from the scheduler: the module's worker, under a scheduler that drafts
        llm.reset(speculative_config=spec)
    else:  # a worker loaded with its draft model or head
        llm = LLM("default", device=device, dtype="float32", speculative_config=spec)
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=SPEC_MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [expected[:SPEC_MAX_TOKENS] for expected in hf_outputs]
    assert llm.scheduler.speculator.num_draft_tokens > 0


def test_chat_answer_names_paris(device):
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--chat", "--prompt", "What is the capital of France?",
         "--device", device, "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
