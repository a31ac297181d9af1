"""Every family of the registry on a CUDA device equals transformers: the Triton kernels compiled
(paged attention with its windows and soft-caps, the fused MoE, the fused norms and rotary), decode
steps replayed from the CUDA graphs, blocks swapped through pinned memory and recomputed, in
float32 (tl.dot in full precision): greedy tokens exactly, each token's logprob within 1e-4.

The CPU suite (tests/test_models.py) runs the same models through the reference kernels; this
module imports no test-only package, so a GPU host runs it from a source tree."""
from __future__ import annotations

import pytest

from common.protocol import SamplingParams
from tests import families
from tests.families import FAMILIES, MAX_TOKENS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_torch_thread")]
TOLERANCE = 1e-4
SMALL_POOL = 24  # blocks of 8 tokens: the 8 prompts need 55, so the batch preempts (as in test_models.py)
NEVER_PREEMPTED = ("mistral", "mixtral")  # windowed on every layer: blocks go back as they decode


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_on_cuda_matches_transformers(family, tmp_path):
    from pagoda.offline import LLM

    prompt_ids = families.prompts()
    reference = families.reference(families.build(family, tmp_path), prompt_ids)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=8, num_gpu_blocks=SMALL_POOL,
              num_cpu_blocks=64)
    runner = llm.executor.runner.decode_runner
    assert runner is not None and runner.graphs, "no CUDA graphs captured"
    replays = []
    run = runner.run
    runner.run = lambda step: replays.append(1) or run(step)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    for mode, budget in (("swap", 2048), ("recompute", 40)):
        llm.reset(preemption_mode=mode, max_num_batched_tokens=budget)
        outputs = llm.generate(prompt_ids, params, use_tqdm=False)
        s = llm.scheduler
        if family not in NEVER_PREEMPTED:
            assert (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions) > 0
        assert [o.token_ids for o in outputs] == reference.token_ids
        for output, theirs in zip(outputs, reference.logprobs, strict=True):
            assert [t[0] for t in output.logprobs] == pytest.approx(theirs, abs=TOLERANCE)
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks
    assert replays, "no decode step ran from a CUDA graph"
