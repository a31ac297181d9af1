"""Triton fused MoE: the routed experts of a layer in five launches (four at top-1), whatever the
expert count (semantics: `kernels.moe.fused_moe_reference`; design after vLLM's fused_moe).

    topk_ids [T, k] --count, align--> sorted_ids, expert_ids, num_padded   (moe_align_block_size)
    x [T, H] --w13, act(gate) * up--> cache13 [T * k, I]      one grouped GEMM, the activation fused
    cache13  --w2, x routing weight--> cache2 [T, k, H]       one grouped GEMM
    cache2   --sum over k-->           out [T, H]             torch.sum: deterministic, no atomics

A (token, k) pair is row `pair = token * k + k_index`. `moe_align_block_size` lays the pairs out
by expert, each expert's run padded to a multiple of BLOCK_M, so a GEMM program owns BLOCK_M
sorted rows of ONE expert and multiplies them by that expert's weight tile:

    sorted rows  | e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | e5 pad pad pad | ... (unused tail)
    expert_ids   |      0       |      2      |       2        |       5        |

The first GEMM gathers its input rows `pair // k` from x; both GEMMs write row `pair` of their
output, so padding rows (pair == T * k) are masked out and never written or summed.

Host synchronisation: none. The aligned size (num_padded) stays on the device: the buffers and
grids are sized by its host-known bound, T * k + min(E, T * k) * (BLOCK_M - 1), and a program
whose tile starts past num_padded exits at once (as vLLM pads to its bound). So a call can be
captured in a CUDA graph for a fixed T and replayed with new routing (a gpu test checks it); its
tile config depends only on T, E, k and the shapes.

Tiles: `tile_configs` picks BLOCK_M by the pairs per expert (T * k / E), and the GEMMs' N and K
tiles from a small table (vLLM's default config in spirit), clamped to the problem (>= 16 for
tl.dot). Not tuned on a GPU yet: `pagoda bench kernels --moe` records the config of each row.

MXFP4 experts (gpt-oss's released weights, `fused_moe_mxfp4`): the weights stay packed, blocks
[E, out, in / 2] uint8 and scales [E, out, in / 32] uint8 (kernels/mxfp4.py), and each B tile is
decoded in registers as it loads (the e2m1 code's sign, exponent and mantissa bits; the block's
power of two), cast to the activation dtype (exact), then multiplied as a full-precision tile is:
the GEMMs read a quarter of bfloat16's weight bytes and round as the reference over the
dequantized weights does.

Biases (gpt-oss: HAS_BIAS) are added to each GEMM's float32 accumulator before its rounding, the
down projection's before the routing weight multiplies it. gpt-oss's clamped SwiGLU (SWIGLU_OAI,
`alpha` and `limit` runtime arguments) is computed in float32 from the rounded gate and up.

Rounding follows the reference (transformers' expert loop), one rounding to the activation dtype
per op: the gate and up GEMM outputs, the activation, its product with up, the down GEMM output,
its product with the routing weight. The sum over k accumulates in float32 (torch.sum), where
the reference adds the experts one by one into a sum kept in the activation dtype: the two differ
by about an ulp of the output per expert added.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe import ACTIVATIONS
from kernels.triton_common import dot_precision

SCAN_BLOCK = 1024  # pairs per step of the align kernels' scans


@dataclass(frozen=True, slots=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """One launch's tiles: BLOCK_M (the alignment) is shared by both GEMMs."""
    block_m: int
    group_m: int  # M tiles walked per N column before the next, for L2 reuse of weight tiles
    gated: GemmTile  # x @ w13: block_n columns of the intermediate (a gate and an up tile each)
    down: GemmTile  # cache13 @ w2


# (pairs per expert at most, BLOCK_M, GROUP_M, gated (N, K, warps, stages), down (N, K, warps, stages))
TILE_TABLE = (
    (16, 16, 1, (64, 128, 4, 4), (64, 128, 4, 4)),  # decode: weight-bandwidth bound, many N tiles
    (64, 32, 4, (64, 128, 4, 4), (64, 128, 4, 4)),
    (256, 64, 8, (64, 64, 4, 3), (128, 64, 4, 3)),
    (None, 128, 8, (64, 64, 8, 3), (128, 64, 8, 3)),  # prefill: compute bound
)


def tile_configs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 dtype: torch.dtype) -> MoeTiles:
    """The table's row for T * k / E pairs per expert, each GEMM's N and K tiles clamped to its
    sizes (at least 16, as tl.dot needs). float32 (tests, parity) halves K and keeps 2 stages, so
    its tiles fit in shared memory as the 16-bit ones do."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    row = next(row for row in TILE_TABLE if row[0] is None or per_expert <= row[0])
    return _fit(row, hidden, intermediate, dtype)


def all_tile_configs(hidden: int, intermediate: int, dtype: torch.dtype) -> list[MoeTiles]:
    """Every config `tile_configs` can pick for this shape (one per table row)."""
    return [_fit(row, hidden, intermediate, dtype) for row in TILE_TABLE]


def _fit(row: tuple, hidden: int, intermediate: int, dtype: torch.dtype) -> MoeTiles:
    _, block_m, group_m, gated, down = row

    def fit(tile: tuple[int, int, int, int], n: int, k: int) -> GemmTile:
        block_n, block_k, num_warps, num_stages = tile
        if dtype == torch.float32:
            block_k, num_stages = block_k // 2, 2
        return GemmTile(min(block_n, max(16, triton.next_power_of_2(n))),
                        min(block_k, max(16, triton.next_power_of_2(k))), num_warps, num_stages)

    return MoeTiles(block_m, group_m, fit(gated, intermediate, hidden), fit(down, hidden, intermediate))


def max_num_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host-known bound of the aligned size: every expert that receives a pair pads < BLOCK_M rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.moe.moe_align_block_size` on the device in two launches, without a host sync
    (block_size a power of two).

    Returns (sorted_ids [max_num_padded] int32, expert_ids [max_num_padded // block_size] int32,
    num_padded [1] int32): their first num_padded rows (num_padded // block_size blocks) are the
    reference's outputs exactly; the tail past them is left unwritten (the GEMMs never read it).
    """
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    bound = max_num_padded(num_pairs, num_experts, block_size)
    sorted_ids = torch.empty(max(bound, block_size), dtype=torch.int32, device=device)
    expert_ids = torch.empty(max(bound, block_size) // block_size, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)  # written by the align kernel's program 0
    if num_pairs == 0 or num_experts == 0:
        return sorted_ids, expert_ids, num_padded.zero_()
    flat = flat.contiguous()
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_kernel[(num_experts,)](flat, counts, num_pairs, SCAN_BLOCK=SCAN_BLOCK, num_warps=4)
    _align_kernel[(num_experts,)](
        flat, counts, sorted_ids, expert_ids, num_padded, num_pairs, num_experts,
        **_align_constexprs(block_size, num_experts), num_warps=4,
    )
    return sorted_ids, expert_ids, num_padded


def _align_constexprs(block_m: int, num_experts: int) -> dict:
    return dict(BLOCK_M=block_m, EXPERTS_P2=triton.next_power_of_2(num_experts), SCAN_BLOCK=SCAN_BLOCK)


# Sizes that change from call to call (num_pairs, num_m_blocks, top_k) are left unspecialized, and
# so is the alignment of the routing tensors (a caller's views), so that one compiled variant per
# tile config serves every batch (`launch_variants` lists them all) and a CUDA graph captured at
# one batch size compiles nothing at another. Weights, activations and strides keep their hints.
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["topk_ids_ptr"])
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, SCAN_BLOCK: tl.constexpr):
    """counts[e] = pairs routed to expert e: one program per expert."""
    expert = tl.program_id(0)
    count = 0
    for start in range(0, num_pairs, SCAN_BLOCK):
        offs = start + tl.arange(0, SCAN_BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, count)


@triton.jit(do_not_specialize=["num_pairs", "num_experts"], do_not_specialize_on_alignment=["topk_ids_ptr"])
def _align_kernel(
    topk_ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_experts,
    BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, SCAN_BLOCK: tl.constexpr,
):
    """Program e writes expert e's rows [start, end) of sorted_ids, its pairs in flat order then
    padding (num_pairs), and its blocks' expert_ids; start = the padded counts of experts < e."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    end = start + tl.sum(tl.where(experts == expert, padded, 0), axis=0)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    rank = 0  # this expert's pairs placed so far
    for chunk in range(0, num_pairs, SCAN_BLOCK):
        offs = chunk + tl.arange(0, SCAN_BLOCK)
        hit = (tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert).to(tl.int32)
        position = start + rank + tl.cumsum(hit, axis=0) - hit
        tl.store(sorted_ids_ptr + position, offs, mask=hit != 0)
        rank += tl.sum(hit, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, tl.full([BLOCK_M], 0, tl.int32) + num_pairs, mask=pad < end)
    num_blocks = (end - start) // BLOCK_M
    for b in range(0, num_blocks, SCAN_BLOCK):
        blocks = b + tl.arange(0, SCAN_BLOCK)
        tl.store(expert_ids_ptr + start // BLOCK_M + blocks, tl.full([SCAN_BLOCK], 0, tl.int32) + expert,
                 mask=blocks < num_blocks)


def fused_moe(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str = "silu", *, tiles: MoeTiles | None = None,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """hidden_states [T, H]; w13 [E, 2 * I, H] (gate rows over up rows); w2 [E, H, I];
    topk_weights [T, k] (float32 or the activation dtype); topk_ids [T, k]; the biases [E, 2 * I]
    and [E, H] or None. Returns [T, H]. `tiles` forces a tile config (tests, tuning); by default
    `tile_configs`'s."""
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    hidden = hidden_states.shape[1]
    assert w13.shape == (num_experts, 2 * intermediate, hidden) and w2.shape == (num_experts, hidden, intermediate)
    return _fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation, tiles, w13_bias, w2_bias, alpha,
                      limit, None, num_experts, hidden, intermediate)


def _fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation, tiles, w13_bias, w2_bias, alpha, limit,
               scales: tuple[torch.Tensor, torch.Tensor] | None, num_experts: int, hidden: int,
               intermediate: int) -> torch.Tensor:
    """Both GEMMs of `fused_moe` (`scales`: MXFP4 weights' exponents, (w13's, w2's))."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
    num_tokens = hidden_states.shape[0]
    top_k = topk_ids.shape[1]
    assert hidden_states.shape[1] == hidden and topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    out = torch.empty_like(hidden_states)
    if num_tokens == 0:
        return out
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    tiles = tiles or tile_configs(num_tokens, num_experts, top_k, hidden, intermediate, x.dtype)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, tiles.block_m, num_experts)
    num_pairs, num_m_blocks = num_tokens * top_k, expert_ids.numel()
    weights = topk_weights.reshape(-1).contiguous()
    device, dtype = x.device, x.dtype
    s13, s2 = (None, None) if scales is None else scales
    cache13 = torch.empty((num_pairs, intermediate), dtype=dtype, device=device)  # [T * k, I], row = pair
    _launch_gemm(x, w13, cache13, weights, sorted_ids, expert_ids, num_padded, num_pairs, num_m_blocks,
                 intermediate, hidden, top_k, tiles.block_m, tiles.group_m, tiles.gated, gated=True,
                 activation=activation, bias=w13_bias, alpha=alpha, limit=limit, scales=s13)
    cache2 = out if top_k == 1 else torch.empty((num_tokens, top_k, hidden), dtype=dtype, device=device)
    _launch_gemm(cache13, w2, cache2, weights, sorted_ids, expert_ids, num_padded, num_pairs, num_m_blocks,
                 hidden, intermediate, 1, tiles.block_m, tiles.group_m, tiles.down, gated=False,
                 activation=activation, bias=w2_bias, scales=s2)
    if top_k > 1:
        torch.sum(cache2, dim=1, out=out)  # [T, k, H] -> [T, H]
    return out


def fused_moe_mxfp4(
    hidden_states: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "swigluoai", *,
    tiles: MoeTiles | None = None, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
    alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """`fused_moe` over MXFP4 experts: w13 = (blocks [E, 2 * I, H / 2], scales [E, 2 * I, H / 32])
    (gate rows over up rows), w2 = (blocks [E, H, I / 2], scales [E, H, I / 32]); H and I
    multiples of 32 (semantics: `kernels.mxfp4.fused_moe_mxfp4_reference`)."""
    (b13, s13), (b2, s2) = w13, w2
    num_experts, two_i, hidden = b13.shape[0], b13.shape[1], b13.shape[2] * 2
    intermediate = two_i // 2
    assert b13.dtype == s13.dtype == b2.dtype == s2.dtype == torch.uint8, "MXFP4 blocks and scales are uint8"
    assert s13.shape == (num_experts, two_i, hidden // 32) and b2.shape == (num_experts, hidden, intermediate // 2) \
        and s2.shape == (num_experts, hidden, intermediate // 32), "MXFP4 experts' shapes"
    assert b13.stride(-1) == s13.stride(-1) == b2.stride(-1) == s2.stride(-1) == 1
    return _fused_moe(hidden_states, b13, b2, topk_weights, topk_ids, activation, tiles, w13_bias, w2_bias, alpha,
                      limit, (s13, s2), num_experts, hidden, intermediate)


def launch_variants(hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype,
                    activation: str = "silu", bias: bool = False,
                    mxfp4: bool = False) -> list[tuple[triton.JITFunction, dict, int, int]]:
    """Every (kernel, constexprs, num_warps, num_stages) that `fused_moe` can launch for this
    shape and activation: the count kernel, the align kernel of each BLOCK_M, and both GEMMs of
    each tile config (for compiling ahead: tests, a start-up warmup)."""
    variants = [(_count_kernel, {"SCAN_BLOCK": SCAN_BLOCK}, 4, 3)]
    for tiles in all_tile_configs(hidden, intermediate, dtype):
        variants.append((_align_kernel, _align_constexprs(tiles.block_m, num_experts), 4, 3))
        for gated, tile in ((True, tiles.gated), (False, tiles.down)):
            consts = _constexprs(gated, activation, tiles.block_m, tiles.group_m, tile, dtype, bias, mxfp4)
            variants.append((_moe_gemm_kernel, consts, tile.num_warps, tile.num_stages))
    return variants


def _launch_gemm(a, b, c, weights, sorted_ids, expert_ids, num_padded, num_pairs, num_m_blocks, n, k, top_k,
                 block_m, group_m, tile: GemmTile, *, gated: bool, activation: str, bias: torch.Tensor | None = None,
                 alpha: float = 1.702, limit: float = 7.0, scales: torch.Tensor | None = None) -> None:
    grid = (num_m_blocks * triton.cdiv(n, tile.block_n),)
    if bias is not None:
        assert bias.shape == (b.shape[0], b.shape[1]) and bias.stride(-1) == 1, "a bias per expert and output row"
    s = b if scales is None else scales
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_padded, b if bias is None else bias, s, n, k, num_pairs,
        num_m_blocks, top_k, alpha, limit,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(-2), 0 if bias is None else bias.stride(0),
        s.stride(0), s.stride(1),
        **_constexprs(gated, activation, block_m, group_m, tile, a.dtype, bias is not None, scales is not None),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )


def _constexprs(gated: bool, activation: str, block_m: int, group_m: int, tile: GemmTile,
                dtype: torch.dtype, bias: bool = False, mxfp4: bool = False) -> dict:
    return dict(GATED=gated, GELU_TANH=gated and activation == "gelu_tanh", MUL_ROUTED_WEIGHT=not gated,
                SWIGLU_OAI=gated and activation == "swigluoai", HAS_BIAS=bias, MXFP4=mxfp4,
                BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=group_m,
                DOT_PRECISION=dot_precision(dtype))


@triton.jit
def _act(x, GELU_TANH: tl.constexpr):
    """silu(x), or gelu with the tanh approximation (tanh(u) = 2 * sigmoid(2u) - 1); float32."""
    if GELU_TANH:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi)
        return 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    else:
        return x / (1.0 + tl.exp(-x))


@triton.jit
def _fp4_e2m1(code):
    """An FP4 (e2m1) code [4 bits, int32] as float32, exactly: sign bit 3, exponent e bits 2-1
    (bias 1), mantissa m bit 0; |value| = m / 2 for e = 0, else (2 + m) * 2^e / 4."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    magnitude = quarters.to(tl.float32) * 0.25
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _mxfp4_tile(rows_ptr, scale_rows_ptr, ks, k_live, dtype: tl.constexpr):
    """[BLOCK_K, BLOCK_N] weights of the columns `rows_ptr` ([1, BLOCK_N] pointers to each output
    row's packed bytes) at input positions `ks` [BLOCK_K], decoded to `dtype`."""
    packed = tl.load(rows_ptr + (ks // 2)[:, None], mask=k_live[:, None], other=0).to(tl.int32)
    code = (packed >> ((ks % 2) * 4)[:, None]) & 15
    exponent = tl.load(scale_rows_ptr + (ks // 32)[:, None], mask=k_live[:, None], other=127).to(tl.int32)
    # 2^(e - 127) exactly: e as a float32's exponent bits (e = 0, 2^-127, would be subnormal: 0 here)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    return (_fp4_e2m1(code) * scale).to(dtype)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks", "top_k"],
            do_not_specialize_on_alignment=["topk_weights_ptr"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, bias_ptr, b_scale_ptr,
    N, K, num_pairs, num_m_blocks, top_k, alpha, limit,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bias_e, stride_se, stride_sn,
    GATED: tl.constexpr, GELU_TANH: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SWIGLU_OAI: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    MXFP4: tl.constexpr = False,
):
    """c[pair, n] = a[pair // top_k] . b[expert, n] over BLOCK_M sorted rows (one expert) x BLOCK_N
    columns (+ bias[expert, n] with HAS_BIAS). GATED: b's rows n (gate) and N + n (up) both,
    c = act(gate) * up (SWIGLU_OAI: gpt-oss's clamped form, `alpha` and `limit`).
    MUL_ROUTED_WEIGHT: c = (a . b) * topk_weights[pair]. a's and c's last dimension is contiguous.
    MXFP4: b holds packed bytes [E, N, K / 2] and b_scale its exponents [E, N, K / 32]."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = pid // per_group * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + pid % per_group % group_size
    pid_n = pid % per_group // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the aligned size: the grid is sized by its bound
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    live = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # columns past N wrap around (loads need no mask; their results are not stored)
    b_ptrs = b_ptr + expert * stride_be + (cols % N).to(tl.int64)[None, :] * stride_bn + ks[:, None] * stride_bk
    # MXFP4: each output column's packed row and its scales' row
    rows = b_ptr + expert * stride_be + (cols % N).to(tl.int64)[None, :] * stride_bn  # [1, BLOCK_N]
    scale_rows = b_scale_ptr + expert * stride_se + (cols % N).to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_live = ks < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=live[:, None] & k_live[None, :], other=0.0)
        if MXFP4:
            b = _mxfp4_tile(rows, scale_rows, k * BLOCK_K + ks, k_live, a.dtype)
        else:
            b = tl.load(b_ptrs, mask=k_live[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
        if GATED:
            if MXFP4:
                b_up = _mxfp4_tile(rows + N.to(tl.int64) * stride_bn, scale_rows + N.to(tl.int64) * stride_sn,
                                   k * BLOCK_K + ks, k_live, a.dtype)
            else:
                b_up = tl.load(b_ptrs + N.to(tl.int64) * stride_bn, mask=k_live[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc=acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    out_type = c_ptr.dtype.element_ty
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + cols % N).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + cols % N).to(tl.float32)[None, :]
    acc = acc.to(out_type).to(tl.float32)  # each op rounded to the activation dtype, as the reference
    if SWIGLU_OAI:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up.to(out_type).to(tl.float32), -limit), limit)
        scaled = (gate * alpha).to(out_type).to(tl.float32)  # rounded where the reference's ops round
        glu = (gate * (1.0 / (1.0 + tl.exp(-scaled))).to(out_type).to(tl.float32)).to(out_type).to(tl.float32)
        acc = (up + 1.0).to(out_type).to(tl.float32) * glu
    elif GATED:
        act = _act(acc, GELU_TANH).to(out_type).to(tl.float32)
        acc = act * acc_up.to(out_type).to(tl.float32)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(out_type), mask=live[:, None] & (cols[None, :] < N))
