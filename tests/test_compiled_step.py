"""The compiled CPU decode step (`--compile`, worker/compiled_step.py).

A tiny Llama under int4 in bfloat16 (the default model's path: the packed GEMMs inside the graph)
serves requests that join and leave a running batch over hundreds of decode steps: its greedy
tokens equal the eager step's, warm-up compiles two graphs (batch 1, and one dynamic in the batch
for every other bucket), and nothing compiles after it; a recompile forced after it is counted
for /metrics.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.protocol import SamplingParams
from pagoda.offline import LLM

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _workload(seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """64 prompts of 3-40 tokens, each generating 24-90 (EOS ignored): at most 6 run at once, so the
    decode batch grows and shrinks as requests finish and the next are admitted."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randrange(3, 41))]} for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(24, 91), ignore_eos=True) for _ in prompts]
    return prompts, params


def test_the_compiled_step_gives_the_eager_tokens_and_never_recompiles(tiny):
    directory, _ = tiny
    prompts, params = _workload()
    outputs = {}
    for compile in (False, True):
        llm = LLM(str(directory), skip_tokenizer_init=True, device="cpu", dtype="bfloat16", quantization="int4",
                  max_num_seqs=6, compile=compile)
        try:
            runner = llm.executor.runner.decode_runner
            calls = []
            forward = runner._forward
            runner._forward = lambda size: calls.append(size) or forward(size)
            results = llm.generate(prompts, params, use_tqdm=False)
            outputs[compile] = [r.outputs[0].token_ids for r in results]
            compiled = runner.compiled
            if compile:
                counted = [llm.engine.scheduler.make_stats()["compiled_step_recompiles_total"]]
                counted += _count_a_forced_recompile(llm)
        finally:
            llm.close()
    assert len(calls) >= 500 and set(calls) == {1, 2, 4, 6}  # decode steps, by bucket
    assert compiled is not None and (compiled.compiles, compiled.recompiles) == (3, 1)  # one forced after
    assert counted == [0, 1]  # /metrics' pagoda:compiled_step_recompiles_total, before and after it
    assert [len(o) for o in outputs[True]] == [p.max_tokens for p in params]
    assert outputs[True] == outputs[False]


def _count_a_forced_recompile(llm: LLM) -> list[int]:
    """Dynamo's caches dropped (as a failed guard would): the next decode step compiles again, and the
    scheduler counts it from that step's result."""
    import torch

    torch._dynamo.reset()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    return [llm.engine.scheduler.make_stats()["compiled_step_recompiles_total"]]


def test_a_model_that_does_not_compile_runs_eagerly_after_a_warning(tmp_path, caplog):
    """The CPU MoE loop reads its routing on the host, which torch.compile cannot take in one graph."""
    import json
    import logging

    config = json.loads((ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                  num_experts_per_tok=2)
    (tmp_path / "mixtral.json").write_text(json.dumps(config))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = []
    for compile in (False, True):
        with caplog.at_level(logging.WARNING, logger="worker.cuda_graph"):
            llm = LLM(f"dummy:{tmp_path / 'mixtral.json'}", skip_tokenizer_init=True, device="cpu", max_num_seqs=4,
                      compile=compile, seed=0)
        try:
            tokens.append(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
            assert llm.executor.runner.decode_runner.compiled is None
        finally:
            llm.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5
    assert [r.message.split(":")[0] for r in caplog.records] == ["--compile"]
    assert "this model did not compile" in caplog.records[0].message
