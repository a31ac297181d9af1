"""LoRA on a CUDA device: the SGMV kernels against the per-op reference at decode and prefill sizes, and a mixed batch of 8
adapters and the base model (3 slots) through the Triton kernels and the decode CUDA graphs, equal
to transformers+PEFT in float32: greedy tokens exactly, logprobs within 1e-4. Imports no test-only
package but peft, so a GPU host runs it from a source tree."""
from __future__ import annotations

import pytest
import torch

from tests.lora_adapters import build_tiny, check_outputs, mixed_batch
from tests.triton_env import tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("rows", [64, 2048])
def test_the_sgmv_kernels_match_the_reference_on_cuda(rows):
    import kernels

    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8, 48, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(8, 4096, 16, device="cuda", dtype=torch.bfloat16) * 0.02
    idx = torch.randint(-1, 8, (rows,), device="cuda")
    want = kernels.lora_shrink(x, a, idx, impl="torch")
    torch.testing.assert_close(kernels.lora_shrink(x, a, idx), want, atol=1e-2, rtol=1e-2)
    want = want[:, 16:32]
    y = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    want_y, got_y = y.clone(), y.clone()
    kernels.lora_expand(want, b, idx, want_y, impl="torch")
    kernels.lora_expand(want, b, idx, got_y)
    torch.testing.assert_close(got_y, want_y, **tolerance(torch.bfloat16))


def test_a_mixed_batch_of_8_adapters_on_cuda_matches_transformers_and_peft(tmp_path_factory):
    from pagoda.offline import LLM

    tiny = build_tiny(tmp_path_factory)
    llm = LLM(str(tiny[0]), device="cuda", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    runner = llm.executor.runner.decode_runner
    assert runner is not None and runner.graphs, "no CUDA graphs captured"
    replays = []
    run = runner.run
    runner.run = lambda step: replays.append(1) or run(step)
    compiled = _compiled_lora_variants()
    check_outputs(mixed_batch(llm, tiny), tiny)
    assert (llm.scheduler.lora_slots.num_loads, llm.scheduler.lora_slots.num_evictions) == (8, 5)
    assert replays, "no decode step ran from a CUDA graph"
    assert _compiled_lora_variants() == compiled, "a LoRA kernel compiled while serving (LoRAManager.warmup)"
    llm.close()


def _compiled_lora_variants() -> int:
    """The variants of the SGMV kernels Triton has compiled in this process."""
    from kernels import triton_lora

    return sum(len(cache[0]) for fn in (triton_lora._lora_shrink_kernel, triton_lora._lora_expand_kernel)
               for cache in fn.device_caches.values())
