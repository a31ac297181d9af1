"""Fused MoE (kernels/triton_moe.py) against its references (kernels/moe.py): moe_align_block_size
exactly (a hand-worked case, its invariants under hypothesis, the Triton kernels' output equal to
the reference's); the fused kernel against `fused_moe_reference` in Triton's interpreter
(TRITON_INTERPRET=1, float32 and float16) or compiled on CUDA (`gpu` tests, bfloat16 too); every
variant the wrapper launches compiled for sm_90 without a GPU; the dispatch; and the CPU part of
`pagoda bench kernels --moe`.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.moe import fused_moe_reference, moe_align_block_size
from tests.triton_env import (
    DEVICE, INTERPRET, count_compiled_for_sm90, run_in_a_clean_interpreter, tolerance,
    triton_test,
)
from tests.triton_env import DTYPES as TRITON_DTYPES

H100_MAX_SHARED = 232448  # bytes of shared memory one program may use on sm_90 (227 KiB)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Small tensors: intra-op threads only add overhead."""


def moe_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype,
               device: str = "cpu", seed: int = 0, starve_last: bool = True):
    """x, w13, w2 scaled so every GEMM's output is O(1); routing as Mixtral's (softmax, top-k,
    renormalized, float32 weights). `starve_last`: the last expert receives no token (when top_k
    leaves room), so a launch always meets an empty expert."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if starve_last and top_k < num_experts:
        logits[:, -1] = float("-inf")
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    return (*(t.to(device, dtype) for t in (x, w13, w2)), weights.to(device), ids.to(device))


# ------------------------------------------------------------------------ moe_align_block_size

# flat pairs 0..5 route to experts [2, 0, 2, 3, 0, 2]; experts 1 and 4 receive none; padding is 6
HAND_IDS = [[2, 0], [2, 3], [0, 2]]
HAND_ALIGNED = {
    4: ([1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6], [0, 2, 3], 12),
    2: ([1, 4, 0, 2, 5, 6, 3, 6], [0, 2, 2, 3], 8),  # expert 2's three pairs take two blocks
}


@pytest.mark.parametrize("block_size", [4, 2])
def test_align_groups_a_hand_worked_case_by_expert_exactly(block_size):
    sorted_ids, expert_ids, num_padded = moe_align_block_size(torch.tensor(HAND_IDS), block_size, 5)
    want_sorted, want_experts, want_padded = HAND_ALIGNED[block_size]
    assert sorted_ids.tolist() == want_sorted
    assert expert_ids.tolist() == want_experts
    assert num_padded.tolist() == [want_padded]
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32


@triton_test
@pytest.mark.parametrize("block_size", [4, 2])
def test_triton_align_equals_the_hand_worked_case_and_bounds_its_buffers(block_size):
    from kernels import triton_moe

    sorted_ids, expert_ids, num_padded = triton_moe.moe_align_block_size(
        torch.tensor(HAND_IDS, device=DEVICE), block_size, 5)
    want_sorted, want_experts, want_padded = HAND_ALIGNED[block_size]
    assert num_padded.tolist() == [want_padded]
    assert sorted_ids[:want_padded].tolist() == want_sorted
    assert expert_ids[: want_padded // block_size].tolist() == want_experts
    # the buffers are sized by the bound: 6 pairs, at most 5 experts each padding block_size - 1 rows
    assert sorted_ids.numel() == triton_moe.max_num_padded(6, 5, block_size) == -(-(6 + 5 * (block_size - 1))
                                                                                  // block_size) * block_size
    assert expert_ids.numel() == sorted_ids.numel() // block_size


@st.composite
def routings(draw, max_tokens: int = 40):
    num_experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, min(num_experts, 4)))
    num_tokens = draw(st.integers(1, max_tokens))
    ids = draw(st.lists(st.permutations(range(num_experts)).map(lambda p: p[:top_k]),
                        min_size=num_tokens, max_size=num_tokens))
    return torch.tensor(ids), num_experts, draw(st.sampled_from([1, 2, 4, 16]))


@settings(max_examples=200, deadline=None)
@given(routings())
def test_align_invariants(routing):
    """Every pair appears once; every block holds one expert's pairs, in their flat order; each
    expert pads its run by less than a block; padding rows hold num_pairs; experts ascend."""
    topk_ids, num_experts, block_size = routing
    flat = topk_ids.flatten().tolist()
    num_pairs = len(flat)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, block_size, num_experts)
    rows, blocks = sorted_ids.tolist(), expert_ids.tolist()
    assert num_padded.tolist() == [len(rows)] and len(rows) == block_size * len(blocks)
    assert sorted(r for r in rows if r != num_pairs) == list(range(num_pairs))
    assert all(r <= num_pairs for r in rows)
    for b, expert in enumerate(blocks):
        assert all(flat[r] == expert for r in rows[b * block_size:(b + 1) * block_size] if r != num_pairs)
    assert blocks == sorted(blocks)
    for expert in range(num_experts):
        mine = [r for b, e in enumerate(blocks) if e == expert for r in rows[b * block_size:(b + 1) * block_size]]
        pairs = [r for r in mine if r != num_pairs]
        assert pairs == [i for i, e in enumerate(flat) if e == expert]  # flat order kept
        assert 0 <= len(mine) - len(pairs) < block_size  # padding rows: fewer than a block
    assert rows.count(num_pairs) == len(rows) - num_pairs


@triton_test
@settings(max_examples=20, deadline=None)
@given(routings(max_tokens=24))
def test_triton_align_equals_the_reference(routing):
    from kernels import triton_moe

    topk_ids, num_experts, block_size = routing
    block_size = max(block_size, 16)  # the GEMMs' BLOCK_M, as fused_moe calls it
    want_sorted, want_experts, want_padded = moe_align_block_size(topk_ids, block_size, num_experts)
    sorted_ids, expert_ids, num_padded = triton_moe.moe_align_block_size(topk_ids.to(DEVICE), block_size,
                                                                         num_experts)
    n = int(want_padded)
    assert num_padded.tolist() == [n]
    assert torch.equal(sorted_ids[:n].cpu(), want_sorted)
    assert torch.equal(expert_ids[: n // block_size].cpu(), want_experts)


# ------------------------------------------------------------------------- tile configs


def test_tile_configs_pick_block_m_by_pairs_per_expert_and_clamp_to_the_shape():
    from kernels.triton_moe import GemmTile, MoeTiles, max_num_padded, tile_configs

    bf16 = torch.bfloat16
    # Mixtral decode: 2 pairs over 8 experts
    assert tile_configs(1, 8, 2, 4096, 14336, bf16) == MoeTiles(16, 1, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))
    # Qwen3-30B-A3B at 64 tokens: 4 pairs per expert; at 256 x 8 / 128 = 16 still decode tiles
    assert tile_configs(64, 128, 8, 2048, 768, bf16).block_m == 16
    assert tile_configs(256, 128, 8, 2048, 768, bf16).block_m == 16
    assert tile_configs(256, 8, 2, 4096, 14336, bf16).block_m == 32  # 64 pairs per expert
    assert tile_configs(512, 8, 2, 4096, 14336, bf16) == MoeTiles(
        64, 8, GemmTile(64, 64, 4, 3), GemmTile(128, 64, 4, 3))
    assert tile_configs(4096, 8, 2, 4096, 14336, bf16).block_m == 128
    # tiny sizes: tiles shrink to the next power of two, never under tl.dot's 16
    assert tile_configs(7, 4, 2, 8, 40, torch.float32) == MoeTiles(
        16, 1, GemmTile(64, 16, 4, 2), GemmTile(16, 64, 4, 2))
    assert max_num_padded(6, 5, 4) == 24 and max_num_padded(1, 128, 16) == 16 and max_num_padded(0, 8, 16) == 0


# ------------------------------------------------------------------- the fused kernel vs the reference

CASES = [(t, e, k) for k in (1, 2, 8) for e in (4, 8) for t in (1, 7, 64) if k <= e]


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
def test_triton_fused_moe_matches_the_reference(num_tokens, num_experts, top_k, dtype):
    """hidden 72 and intermediate 40: neither is a multiple of any tile."""
    x, w13, w2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, 72, 40, dtype, DEVICE,
                                          seed=num_tokens * 100 + num_experts * 10 + top_k)
    if top_k < num_experts:
        assert (ids != num_experts - 1).all()  # an expert with no token
    got = kernels.fused_moe(x, w13, w2, weights, ids, impl="triton")
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, weights, ids), **tolerance(dtype))


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("block_m,group_m", [(16, 1), (16, 3), (32, 2)])
def test_triton_fused_moe_walks_partial_n_and_k_tiles(block_m, group_m, dtype):
    """Forced small tiles: 3 N tiles and 3 K steps per GEMM, the last of each partial (40 = 16 +
    16 + 8, 72 = 32 + 32 + 8), and M tiles walked in groups over an odd block count."""
    from kernels.triton_moe import GemmTile, MoeTiles, fused_moe

    tiles = MoeTiles(block_m, group_m, GemmTile(16, 32, 4, 2), GemmTile(32, 16, 4, 2))
    x, w13, w2, weights, ids = moe_inputs(37, 8, 2, 72, 40, dtype, DEVICE, seed=block_m + group_m)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, tiles=tiles),
                               fused_moe_reference(x, w13, w2, weights, ids), **tolerance(dtype))


@triton_test
def test_triton_fused_moe_at_prefill_tiles_gelu_int32_ids_and_weights_in_the_activation_dtype():
    """300 tokens x 4 / 4 experts = 300 pairs per expert: the 128-row tiles; GeGLU; topk_ids as
    int32 (vLLM's) and routing weights in float16 (the reference takes either)."""
    from kernels.triton_moe import tile_configs

    x, w13, w2, weights, ids = moe_inputs(300, 4, 4, 72, 40, torch.float16, DEVICE)
    assert tile_configs(300, 4, 4, 72, 40, torch.float16).block_m == 128
    weights, ids = weights.half(), ids.int()
    for activation in ("silu", "gelu_tanh"):
        torch.testing.assert_close(kernels.fused_moe(x, w13, w2, weights, ids, activation=activation, impl="triton"),
                                   fused_moe_reference(x, w13, w2, weights, ids.long(), activation),
                                   **tolerance(torch.float16))


@triton_test
def test_triton_fused_moe_takes_no_tokens_and_refuses_an_unknown_activation():
    from kernels.triton_moe import fused_moe

    x, w13, w2, weights, ids = moe_inputs(0, 4, 2, 72, 40, torch.float32, DEVICE)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 72)
    with pytest.raises(ValueError, match="activation must be one of silu, gelu_tanh, swigluoai, not 'relu'"):
        fused_moe(x, w13, w2, weights, ids, activation="relu")


def gpt_oss_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype,
                   device: str = "cpu", seed: int = 0):
    """`moe_inputs` with gpt-oss's biases, and gate and up outputs large enough that the clamps
    (limit 7) bite: (x, w13, w2, weights, ids, w13_bias, w2_bias)."""
    x, w13, w2, weights, ids = moe_inputs(num_tokens, num_experts, top_k, hidden, intermediate, torch.float32,
                                          seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    w13 = w13 * 6
    b13, b2 = torch.randn(num_experts, 2 * intermediate, generator=gen), torch.randn(num_experts, hidden, generator=gen)
    return (*(t.to(device, dtype) for t in (x, w13, w2)), weights.to(device), ids.to(device),
            b13.to(device, dtype), b2.to(device, dtype))


def test_swigluoai_with_biases_is_transformers_gpt_oss_experts():
    """The reference's clamped SwiGLU with biases, against transformers' GptOssExperts: its
    interleaved [gate, up] columns ([E, H, 2I]) are our stacked [gate rows | up rows] ([E, 2I, H])."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, hidden, inter = 4, 24, 16
    x, w13, w2, weights, ids, b13, b2 = gpt_oss_inputs(9, e, 2, hidden, inter, torch.float32, seed=5)
    theirs = GptOssExperts(GptOssConfig(num_local_experts=e, hidden_size=hidden, intermediate_size=inter))
    interleaved = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(e, 2 * inter, hidden)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(interleaved.transpose(1, 2))
        theirs.gate_up_proj_bias.copy_(torch.stack([b13[:, :inter], b13[:, inter:]], dim=2).reshape(e, 2 * inter))
        theirs.down_proj.copy_(w2.transpose(1, 2))
        theirs.down_proj_bias.copy_(b2)
        expected = theirs(x, ids, weights)
    gate_up = torch.einsum("th,eih->tei", x, w13) + b13  # the clamps bite: gate and up outside [-7, 7]
    assert (gate_up > 7).any() and (gate_up < -7).any()
    got = fused_moe_reference(x, w13, w2, weights, ids, "swigluoai", w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, fused_moe_reference(x, w13, w2, weights, ids, "swigluoai"), atol=1e-3)


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (7, 8, 4), (64, 8, 2)])
def test_triton_swigluoai_with_biases_matches_the_reference(num_tokens, num_experts, top_k, dtype):
    """gpt-oss's experts: biases on both GEMMs (the down one's before the routing weight) and the
    clamped SwiGLU, at the decode and prefill tiles; and the down bias alone (a rank past the
    first of a tensor-parallel group adds none)."""
    x, w13, w2, weights, ids, b13, b2 = gpt_oss_inputs(num_tokens, num_experts, top_k, 72, 40, dtype, DEVICE,
                                                       seed=num_tokens)
    weights = weights.to(dtype)  # gpt-oss routes in the activation dtype
    for biases in ({"w13_bias": b13, "w2_bias": b2}, {"w13_bias": b13, "w2_bias": None}):
        got = kernels.fused_moe(x, w13, w2, weights, ids, activation="swigluoai", impl="triton", alpha=1.702,
                                limit=7.0, **biases)
        torch.testing.assert_close(got, fused_moe_reference(x, w13, w2, weights, ids, "swigluoai", **biases),
                                   **tolerance(dtype))


def mxfp4_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[tuple, tuple]:
    """The experts' weights as MXFP4 (blocks [E, out, in / 2], scales [E, out, in / 32])."""
    from kernels.mxfp4 import quantize

    return tuple((blocks.flatten(-2).contiguous(), scales) for blocks, scales in (quantize(w.float()) for w in (w13, w2)))


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (7, 8, 4), (64, 8, 2)])
def test_triton_mxfp4_experts_match_the_reference_over_their_dequantized_weights(num_tokens, num_experts, top_k,
                                                                                dtype):
    """The packed weights decoded tile by tile in the GEMMs (hidden 96, intermediate 64: 3 and 2
    scale blocks a row, neither a multiple of every K tile), gpt-oss's SwiGLU and biases, and silu
    without biases; against `fused_moe_mxfp4_reference` (the dequantized weights' reference)."""
    from kernels.mxfp4 import dequantize, fused_moe_mxfp4_reference

    x, w13, w2, weights, ids, b13, b2 = gpt_oss_inputs(num_tokens, num_experts, top_k, 96, 64, dtype, DEVICE,
                                                       seed=num_tokens + 3)
    q13, q2 = mxfp4_experts(w13.cpu(), w2.cpu())
    assert torch.equal(dequantize(*q13), dequantize(*mxfp4_experts(dequantize(*q13), w2.cpu())[0]))  # on the grid
    q13, q2 = tuple(t.to(DEVICE) for t in q13), tuple(t.to(DEVICE) for t in q2)
    weights = weights.to(dtype)
    for activation, biases in (("swigluoai", {"w13_bias": b13, "w2_bias": b2}), ("silu", {})):
        got = kernels.fused_moe_mxfp4(x, q13, q2, weights, ids, activation=activation, impl="triton", **biases)
        expected = fused_moe_mxfp4_reference(x, q13, q2, weights, ids, activation, **biases)
        assert got.dtype == dtype and not torch.isnan(got).any()
        torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_mxfp4_dispatch_off_cuda_is_the_reference():
    from kernels.mxfp4 import fused_moe_mxfp4_reference

    x, w13, w2, weights, ids, b13, b2 = gpt_oss_inputs(5, 4, 2, 64, 32, torch.float32, seed=2)
    q13, q2 = mxfp4_experts(w13, w2)
    got = kernels.fused_moe_mxfp4(x, q13, q2, weights, ids, w13_bias=b13, w2_bias=b2)
    assert torch.equal(got, fused_moe_mxfp4_reference(x, q13, q2, weights, ids, w13_bias=b13, w2_bias=b2))


# ------------------------------------------------------------------------------ sm_90, dispatch


def _compile_moe_for_sm90() -> list[str]:
    """Compile the variants `fused_moe` launches for sm_90 (Triton's own ptxas): every tile config
    in bfloat16 (the serving dtype), and at the decode tiles float32 (its ieee dot and its own
    table), float16 and GeGLU (about a second a GEMM: the rest would double the module's time);
    pointers, strides, N and K 16-divisible and the unit stride a constant, as the JIT sees a
    serving launch.
    Raises if a variant's shared memory would not fit an H100. Run with TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_moe as tm

    def compile_(fn, consts: dict, num_warps: int, num_stages: int, dtype: str) -> str:
        types = {"topk_weights_ptr": "*fp32", "topk_ids_ptr": "*i64", "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}",
                 "c_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "alpha": "fp32", "limit": "fp32",
                 "b_scale_ptr": "*u8"}
        if consts.get("MXFP4"):
            types["b_ptr"] = "*u8"
        if fn is tm._moe_gemm_kernel:
            consts = {**consts, "stride_bk": 1}
        sig = {name: "constexpr" if name in consts else types.get(name, "*i32" if name.endswith("_ptr") else "i32")
               for name in fn.arg_names}
        unaligned = {"topk_weights_ptr", "topk_ids_ptr"}  # do_not_specialize_on_alignment
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name not in unaligned
                   and (name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K"))}
        kernel = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages})
        assert kernel.metadata.shared <= H100_MAX_SHARED, f"{fn.__name__} {consts}: {kernel.metadata.shared} bytes"
        return f"{fn.__name__} {dtype} {sorted(consts.items())}"

    done, seen = [], set()
    shapes = [("bf16", torch.bfloat16, "silu", None, False), ("fp32", torch.float32, "silu", 16, False),
              ("fp16", torch.float16, "silu", 16, False), ("bf16", torch.bfloat16, "gelu_tanh", 16, False),
              ("bf16", torch.bfloat16, "swigluoai", 16, True)]  # gpt-oss: its SwiGLU and biases
    shapes = [(*shape, False) for shape in shapes] + [
        ("bf16", torch.bfloat16, "swigluoai", None, True, True),  # gpt-oss's MXFP4 experts, every tile config
        ("bf16", torch.bfloat16, "swigluoai", 16, False, True)]  # a rank past the first: no biases
    for name, dtype, activation, only_block_m, bias, packed in shapes:  # Qwen3-30B-A3B's shape: no tile clamped
        for fn, consts, num_warps, num_stages in tm.launch_variants(2048, 768, 128, dtype, activation, bias, packed):
            # the align kernels take no activation tensor: one variant per BLOCK_M whatever the dtype
            key = (fn.__name__, tuple(sorted(consts.items())), name if fn is tm._moe_gemm_kernel else None)
            if key in seen or consts.get("BLOCK_M", only_block_m) != (only_block_m or consts.get("BLOCK_M")):
                continue
            seen.add(key)
            done.append(compile_(fn, consts, num_warps, num_stages, name))
    return done


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernels are compiled for the device itself")
def test_every_fused_moe_variant_compiles_for_hopper_without_a_gpu():
    """The interpreter runs Python, not the compiler: this catches what only compiling would, and
    that each variant's tiles fit in shared memory (which only a launch on a GPU would say).
    bf16: count, 4 align and 8 GEMMs; fp32 and fp16 at the decode tiles: 2 each; GeGLU there: 1
    (its down GEMM is silu's); gpt-oss's there: 2 (its biased down GEMM too); its MXFP4 GEMMs at
    every tile config: 8, and without biases at the decode tiles: 2."""
    assert count_compiled_for_sm90("tests.test_kernels_moe", "_compile_moe_for_sm90") == 13 + 2 + 2 + 1 + 2 + 8 + 2


def test_cpu_dispatch_runs_the_reference_without_importing_triton():
    x, w13, w2, weights, ids = moe_inputs(5, 4, 2, 24, 16, torch.float32)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids))
    code = (
        "import sys, torch, kernels\n"
        "x = torch.ones(3, 8); w13 = torch.ones(4, 12, 8); w2 = torch.ones(4, 8, 6)\n"
        "out = kernels.fused_moe(x, w13, w2, torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 2], [3, 0]]))\n"
        "print(out.shape[0], 'triton' in sys.modules)\n"
    )
    assert run_in_a_clean_interpreter(code) == ["3", "False"]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                    reason="CUDA graphs need a GPU and the compiled kernels (TRITON_INTERPRET unset)")
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """No host sync inside: the whole call captures, and a replay follows new inputs and routing."""
    x, w13, w2, weights, ids = moe_inputs(16, 8, 2, 512, 384, torch.bfloat16, "cuda")
    kernels.fused_moe(x, w13, w2, weights, ids)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.fused_moe(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = moe_inputs(16, 8, 2, 512, 384, torch.bfloat16, "cuda", seed=1, starve_last=False)
    for t, new in ((x, x2), (weights, weights2), (ids, ids2)):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.fused_moe(x, w13, w2, weights, ids))


# ------------------------------------------------------------------------- pagoda bench kernels --moe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU part on a machine without CUDA")
def test_bench_kernels_moe_on_cpu_times_the_reference_on_the_tiny_shape(tmp_path, capsys):
    from pagoda.cli import main

    output = tmp_path / "moe.json"
    assert main(["bench", "kernels", "--moe", "--batch-sizes", "1,4", "--output", str(output)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    result = json.loads(output.read_text())
    assert result["benchmark"] == "kernels: fused MoE vs a loop over experts"
    assert result["command"].startswith("pagoda bench kernels --batch-sizes 1,4") and "--moe" in result["command"]
    assert {"commit", "date", "device"} <= result.keys()
    assert [(r["model"], r["batch"], r["pagoda"]) for r in result["results"]] == [("tiny", 1, None), ("tiny", 4, None)]
    assert all(r["baseline"]["time_us"] > 0 for r in result["results"])
    assert main(["bench", "kernels", "--moe", "--models", "mixtral-8x7b"]) == 2
    assert "only the tiny shape runs on CPU" in capsys.readouterr().err


@triton_test
def test_bench_moe_row_times_both_calls_and_reports_their_figures(monkeypatch):
    """The GPU row of `bench kernels --moe` on the tiny shape, its clocks replaced: each call runs
    (the fused one in the interpreter), 2 us fused and 8 us loop per call, the figures follow."""
    from pagoda.bench import kernels as bench

    timed, eager_seconds = [], iter([2e-6, 8e-6])

    def clock(seconds):
        def time_calls(calls):
            timed.append([call() for call in calls])
            return next(seconds)
        return time_calls

    monkeypatch.setattr(bench, "time_eager", clock(eager_seconds))
    monkeypatch.setattr(bench, "time_per_call", clock(iter([1e-6])))
    gen = torch.Generator(DEVICE).manual_seed(0)
    weights = bench.moe_weights(bench.MOE_SHAPES["tiny"], torch.float32, torch.device(DEVICE), gen)
    row = bench.bench_moe_row("tiny", 3, weights, torch.float32, torch.device(DEVICE), 100.0, gen)
    assert [len(calls) for calls in timed] == [bench.MOE_ROUTINGS] * 3  # fused eager, loop eager, fused graph
    for fused, loop in zip(timed[0], timed[1], strict=True):
        torch.testing.assert_close(fused, loop, **tolerance(torch.float32))
    assert row["pagoda"]["time_us"] == pytest.approx(2.0) and row["pagoda"]["graph_time_us"] == pytest.approx(1.0)
    assert row["baseline"]["time_us"] == pytest.approx(8.0) and row["time_ratio_vs_loop"] == pytest.approx(0.25)
    expert_bytes = 3 * 64 * 96 * 4
    assert row["weight_bytes"] == row["experts_hit"] * expert_bytes and 2 <= row["experts_hit"] <= 6
    assert row["pagoda"]["weight_bandwidth_GBps"] == pytest.approx(row["weight_bytes"] / 2e-6 / 1e9)
    assert row["flops"] == 2 * 3 * 2 * 3 * 64 * 96 and row["max_abs_diff_vs_loop"] < 1e-5
    assert row["tiles"]["block_m"] == 16 and row["pagoda"]["graph_error"] is None
