"""Qwen3-Next (worker/models/qwen3_next.py): a tiny random model of 3 Gated DeltaNet layers and one
gated full-attention layer, each with a MoE and its shared expert, equal to transformers in float32
(greedy tokens exactly, logprobs within 1e-4) through `pagoda generate`, with chunked prefill, and
preempted in a small pool (by recompute: a sequence's recurrent state lives in the worker's slot,
worker/recurrent_state.py); what the scheduler does for such a model (WorkerHello.recurrent_state);
and the served API (slow)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.protocol import SamplingParams
from pagoda import cli
from tests import families

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIG = dict(families.BASE, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(directory, prompts, transformers' greedy tokens and logprobs)."""
    import transformers

    directory = tmp_path_factory.mktemp("qwen3-next")
    config = transformers.Qwen3NextConfig(**CONFIG)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(directory)
    for file in families.TOKENIZER.iterdir():
        if file.name != "README.md":
            shutil.copy(file, directory)
    prompts = families.prompts()
    return directory, prompts, families.reference(model, prompts)


def matches(reference, token_ids, logprobs) -> None:
    assert token_ids == reference.token_ids
    for mine, theirs in zip(logprobs, reference.logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_generate_matches_transformers(qwen3_next, tmp_path, capsys):
    directory, prompts, reference = qwen3_next
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompts)
    argv = ["generate", "--model", str(directory), "--prompts-file", str(prompts_file), "--json", "--temperature", "0",
            "--max-tokens", str(families.MAX_TOKENS), "--logprobs", "0", "--device", "cpu", "--dtype", "float32",
            "--block-size", "8"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])


def test_chunked_prefill_and_preemption_recompute_from_the_first_token(qwen3_next):
    """16-token chunks carry each sequence's state from chunk to chunk; in 24 blocks of 8 the batch
    preempts, and asked to swap the engine recomputes (a swapped sequence would come back without
    its state); no block leaks. Prefix caching is off: the same prompts again hit nothing, and
    every token is still transformers'."""
    from pagoda.offline import LLM

    directory, prompts, reference = qwen3_next
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=24, num_cpu_blocks=32,
              preemption_mode="swap", max_num_batched_tokens=16)
    s = llm.scheduler
    assert s.recurrent_state and s.config.preemption_mode == "recompute" and not s.block_manager.enable_prefix_caching
    params = SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0)
    for _ in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        matches(reference, [list(o.token_ids) for o in outputs], [[t[0] for t in o.logprobs] for o in outputs])
        assert s.num_recompute_preemptions > 0 and s.num_swap_preemptions == 0 and s.prefix_cache_hits == 0
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks
    assert llm.executor.runner.recurrent.num_slots >= 8  # a slot per held sequence


def test_a_request_of_several_sequences_is_refused_by_name(qwen3_next):
    from pagoda.offline import LLM
    from scheduler.scheduler import RequestRejected

    directory, prompts, _ = qwen3_next
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8)
    for params in (SamplingParams(n=2, temperature=1.0), SamplingParams(n=2, beam_width=2, temperature=0)):
        with pytest.raises(RequestRejected, match="this model's layers keep a recurrent state per sequence: requests "
                                                  "of one sequence only"):
            llm.generate(prompts[:1], params, use_tqdm=False)


def test_tensor_parallelism_is_refused_by_name(qwen3_next, capsys):
    directory, _, _ = qwen3_next
    argv = ["generate", "--model", str(directory), "--prompt", "w5", "--device", "cpu", "--tensor-parallel-size", "2"]
    assert cli.main(argv) != 0
    assert "Qwen3-Next: tensor parallelism is not supported yet" in capsys.readouterr().err


@pytest.mark.slow
def test_served_api_matches_transformers(qwen3_next, redis_url):
    import openai

    from tests.stack import Stack

    directory, prompts, reference = qwen3_next
    stack = Stack("--model", str(directory), "--redis-url", redis_url, "--block-size", "8", "--num-gpu-blocks", "24",
                  "--dtype", "float32").wait_ready()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model=directory.name, prompt=[families.prompt_text(p) for p in prompts],
                                             max_tokens=families.MAX_TOKENS, temperature=0, logprobs=0)
        choices = sorted(response.choices, key=lambda c: c.index)
        assert [c.logprobs.tokens for c in choices] == [families.token_strings(ids) for ids in reference.token_ids]
        for choice, theirs in zip(choices, reference.logprobs, strict=True):
            assert choice.logprobs.token_logprobs == pytest.approx(theirs, abs=1e-4)
    finally:
        assert stack.stop() == 0
