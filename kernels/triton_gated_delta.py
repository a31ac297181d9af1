"""Triton gated delta rule: the recurrent form over a step's sequences, their states in slots
(semantics: `kernels.gated_delta.gated_delta_rule_reference`; design after the FLA library's
fused_recurrent_gated_delta_rule).

A program owns one sequence, one value head and BLOCK_V of its value dims: it holds that slice of
the state, S [k_head_dim, BLOCK_V] in float32, in registers, loads it from the sequence's slot (or
starts from zeros), walks the sequence's tokens one at a time (decay, delta-rule write, read) and
stores it back. Grid (num_seqs, num_v_heads, cdiv(v_head_dim, BLOCK_V)): no host sync, sizes known
on the host, so a decode step's launch can be captured in a CUDA graph. A prompt runs token by
token too: correct, not yet the chunked form's speed (a chunked prefill kernel is the next step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, *,
                     use_qk_l2norm: bool = True, block_v: int | None = None) -> torch.Tensor:
    """See `kernels.gated_delta.gated_delta_rule_reference` (the token-by-token form)."""
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    num_seqs = slots.shape[0]
    assert q.shape == k.shape and g.shape == beta.shape == (num_tokens, num_v_heads)
    assert num_v_heads % num_k_heads == 0 and state.shape[1:] == (num_v_heads, dk, dv)
    assert state.dtype == torch.float32 and state.is_contiguous()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    if num_tokens == 0 or num_seqs == 0:
        return out
    dk_p2 = max(16, triton.next_power_of_2(dk))
    block_v = block_v or min(32, max(16, triton.next_power_of_2(dv)))
    grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, out, state, cu_seqlens, slots, fresh.to(torch.int8), num_k_heads * dk, dk ** -0.5,
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv, DK_P2=dk_p2,
        BLOCK_V=block_v, L2NORM=use_qk_l2norm, num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["scale"])
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, cu_seqlens_ptr, slots_ptr, fresh_ptr,
    stride_qk_tok, scale,
    NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr,
    BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):
    """q, k [T, Hk, DK] and v, out [T, Hv, DV] contiguous; g, beta [T, Hv]; state [slots, Hv, DK, DV]."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    lo = tl.load(cu_seqlens_ptr + seq).to(tl.int64)  # token offsets in int64 (the loop's too)
    hi = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    k_head = head // GROUP
    dk = tl.arange(0, DK_P2)
    dv = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    dk_live, dv_live = dk < DK, dv < DV
    state_mask = dk_live[:, None] & dv_live[None, :]
    state_tile = state_ptr + ((slot * NUM_V_HEADS + head) * DK + dk[:, None]) * DV + dv[None, :]
    from_slot = tl.load(fresh_ptr + seq) == 0
    s = tl.load(state_tile, mask=state_mask, other=0.0)  # [DK_P2, BLOCK_V]
    s = tl.where(from_slot, s, 0.0)  # a fresh sequence's slot may hold anything, NaN included
    for t64 in range(lo, hi):
        q = tl.load(q_ptr + t64 * stride_qk_tok + k_head * DK + dk, mask=dk_live, other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + t64 * stride_qk_tok + k_head * DK + dk, mask=dk_live, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            kk = kk * tl.rsqrt(tl.sum(kk * kk, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t64 * NUM_V_HEADS * DV + head * DV + dv, mask=dv_live, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t64 * NUM_V_HEADS + head).to(tl.float32))
        beta = tl.load(beta_ptr + t64 * NUM_V_HEADS + head).to(tl.float32)
        s = s * decay
        delta = (v - tl.sum(s * kk[:, None], 0)) * beta  # [BLOCK_V]
        s = s + kk[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + t64 * NUM_V_HEADS * DV + head * DV + dv, o.to(out_ptr.dtype.element_ty), mask=dv_live)
    if hi > lo:
        tl.store(state_tile, s, mask=state_mask)
