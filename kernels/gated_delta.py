"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next and Qwen3.5)
over a step's sequences, each carrying its recurrent state in a slot: the references of the
Triton kernel (`triton_gated_delta.py`).

Per value head h, a state S [k_head_dim, v_head_dim] and, for each token t of a sequence,

    S = S * exp(g_t)                                    decay (g_t <= 0)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T            the delta rule's write
    o_t = S^T (q_t / sqrt(k_head_dim))                  the read

with q and k L2-normalized per head (`use_qk_l2norm`), and each query-key head serving
num_v_heads / num_k_heads consecutive value heads. A sequence starts from its slot's state, or
from zeros (`fresh`: its first chunk); its final state is written back to the slot.

`gated_delta_rule_reference` computes this token by token (transformers'
`torch_recurrent_gated_delta_rule`, operation for operation); `chunked` does a sequence of several
tokens as transformers' `torch_chunk_gated_delta_rule` does (chunks of 64 through the UT transform),
so that a prompt's outputs equal transformers' prefill and a decode its recurrent step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA library's, as transformers computes it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, *,
    use_qk_l2norm: bool = True, chunked: bool = True,
) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv] (float32 or the activation dtype);
    cu_seqlens [B + 1]; state [num_slots, Hv, Dk, Dv] float32, updated in place; slots [B] each
    sequence's slot; fresh [B] bool, start from zeros. Returns o [T, Hv, Dv] in v's dtype.
    `chunked`: a sequence of more than one token runs the chunked form (a decode always steps).
    Every sequence has a token at least; a decode step (one token each) runs batched, with no host sync."""
    if q.shape[0] == slots.shape[0]:
        return _decode(q, k, v, g, beta, state, slots, fresh, use_qk_l2norm)
    out = torch.empty_like(v)
    starts, slot_ids, fresh_flags = cu_seqlens.tolist(), slots.tolist(), fresh.tolist()
    for i, slot in enumerate(slot_ids):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        initial = None if fresh_flags[i] else state[slot]
        run = _chunked if chunked and hi - lo > 1 else _recurrent
        o, final = run(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], initial, use_qk_l2norm)
        out[lo:hi] = o.to(out.dtype)
        state[slot] = final
    return out


def _decode(q, k, v, g, beta, state, slots, fresh, use_qk_l2norm) -> torch.Tensor:
    """One token of every sequence: `_recurrent`'s step, batched over the sequences."""
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_k_heads != num_v_heads:
        q, k = (x.repeat_interleave(num_v_heads // num_k_heads, dim=1) for x in (q, k))
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    s = state[slots].masked_fill(fresh[:, None, None, None], 0)  # [B, Hv, Dk, Dv]
    s = s * g.exp()[:, :, None, None]
    kv_mem = (s * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., None] * delta[:, :, None, :]
    state[slots] = s
    return (s * q[..., None]).sum(dim=-2).to(v.dtype)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """[heads, tokens, dim] float32 views, q and k repeated to the value heads, normalized, q scaled."""
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_k_heads != num_v_heads:
        q, k = (x.repeat_interleave(num_v_heads // num_k_heads, dim=1) for x in (q, k))
    q, k, v, beta, g = (x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _recurrent(q, k, v, g, beta, initial, use_qk_l2norm):
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    heads, length, dk = k.shape
    s = torch.zeros(heads, dk, v.shape[-1], device=v.device) if initial is None else initial.to(torch.float32)
    out = torch.empty_like(v)
    for t in range(length):
        s = s * g[:, t].exp()[:, None, None]
        kv_mem = (s * k[:, t, :, None]).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1), s


def _chunked(q, k, v, g, beta, initial, use_qk_l2norm, chunk: int = CHUNK):
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    heads, length, dk = k.shape
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (length + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, num_chunks, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, num_chunks, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the UT transform's lower-triangular system
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    s = torch.zeros(heads, dk, v.shape[-1], device=v.device) if initial is None else initial.to(torch.float32)
    out = torch.zeros_like(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1), s


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                            slots: torch.Tensor, fresh: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """The short depthwise causal convolution before the delta rule, over each sequence's tokens
    after its slot's last K - 1 inputs (zeros when `fresh`), which it then holds.

    x [T, C]; weight [C, K]; conv_state [num_slots, C, K - 1] (updated in place). Returns [T, C]
    (silu'd with activation "silu"), as transformers' causal_conv1d_fn / causal_conv1d_update. A
    decode step (one token a sequence) runs batched, with no host sync."""
    width = weight.shape[1]
    if x.shape[0] == slots.shape[0]:
        before = conv_state[slots].masked_fill(fresh[:, None, None], 0).to(weight.dtype)  # [B, C, K - 1]
        window = torch.cat([before, x[:, :, None].to(weight.dtype)], dim=-1)  # [B, C, K]
        y = F.conv1d(window, weight[:, None, :], groups=window.shape[1])[:, :, 0]
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
        return (F.silu(y) if activation == "silu" else y).to(x.dtype)
    out = torch.empty_like(x)
    starts, slot_ids, fresh_flags = cu_seqlens.tolist(), slots.tolist(), fresh.tolist()
    for i, slot in enumerate(slot_ids):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        before = torch.zeros_like(conv_state[slot]) if fresh_flags[i] else conv_state[slot]
        seq = torch.cat([before.to(weight.dtype), x[lo:hi].t().to(weight.dtype)], dim=-1)  # [C, K - 1 + n]
        y = F.conv1d(seq[None], weight[:, None, :], groups=seq.shape[0])[0]  # [C, n]
        if activation == "silu":
            y = F.silu(y)
        out[lo:hi] = y.t().to(x.dtype)
        conv_state[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_state.dtype)
    return out
