"""Attention and cache kernels over the paged KV cache, dispatched by device.

`kv_cache` is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (K and V of a block side by
side). CUDA tensors run the Triton kernels (`triton_attention.py`, `triton_cache.py`), CPU tensors
the pure-PyTorch references (`reference.py`), which are also the Triton kernels' test oracle.
`impl="triton"` or `impl="torch"` overrides the choice. `warmup` compiles at start-up every
Triton variant a model can launch; `BlockSwapper` (kernels/swap.py) is the worker's batched swap. triton is imported only when a Triton
kernel runs, so this package imports on a machine without it. Triton on CPU tensors runs in its
interpreter, which needs TRITON_INTERPRET=1 in the environment before triton is first imported;
with it set, the default is the references on every device (the interpreter is for tests).

The fused elementwise ops of a layer (`fused.py`: rms_norm, fused_add_rms_norm, rotary_embedding,
silu_and_mul) are torch custom ops (`torch.ops.pagoda.*`) that dispatch by device themselves;
their wrappers here take the same `impl=` override. While torch.compile traces (the compiled CPU
decode step) they are the plain torch expressions instead, which Inductor fuses.

On CPU tensors `write_kv` and `paged_attention` run the C++ operators of `cpu_ops.py` where they
are built (one call per layer instead of a dozen aten ops, each query row computed alone: the same
output whatever the batch); elsewhere the references.

`fused_moe` runs a MoE layer's routed experts: on CUDA the Triton kernel of `triton_moe.py` (tokens
grouped by expert, one grouped-GEMM launch per projection, no host sync: CUDA-graph safe),
elsewhere the loop over experts of `moe.py`, its reference.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from kernels import cpu_ops, fused, lora, reference
from kernels.swap import BlockSwapper
from kernels.triton_common import freeze_workspace, interpreting  # no triton import
from kernels.tuning import AttentionShape  # pure Python

Impl = Literal["triton", "torch"] | None

__all__ = [
    "BlockSwapper", "copy_blocks", "freeze_workspace", "fused_add_rms_norm", "fused_moe", "fused_moe_mxfp4",
    "gated_delta_rule", "gelu_tanh_and_mul",
    "lora_expand", "lora_shrink", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "swap_blocks",
    "warmup", "warmup_moe",
    "write_kv",
]


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
    k_scale: float = 1.0, v_scale: float = 1.0, impl: Impl = None,
) -> None:
    """Write each token's K and V head rows into its slot; slot -1 is padding and is skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64. An fp8
    cache (torch.float8_e4m3fn) stores K / k_scale and V / v_scale, saturated (kernels/kv_quant.py).
    """
    if _use_triton(kv_cache, impl):
        from kernels import triton_cache

        return triton_cache.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    if impl is None and cpu_ops.takes(key, kv_cache) and value.dtype == key.dtype and value.stride(-1) == 1:
        return cpu_ops.write_kv(key, value, kv_cache, slot_mapping)
    return reference.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, scale: float, *, out: torch.Tensor | None = None, impl: Impl = None,
    max_seqlen_k: int | None = None, kv_splits: int | None = None, step_cache: dict | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV: prefill, queries after a
    cached prefix, and decode, mixed in one batch (semantics: `reference.paged_attention`).

    query: [num_tokens, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    seq_lens: [num_seqs] int32; cu_seqlens_q: [num_seqs + 1] int32. Returns [num_tokens, num_heads,
    head_dim] (`out` when given). Triton only: `max_seqlen_k` (an upper bound on seq_lens, for the
    split-KV choice; default the block table's width) and `kv_splits` (force a split count).
    `step_cache`: a dict that lives for one step, where the torch path keeps its bucketing of the
    step's sequences for every layer (one per window size). `sliding_window` W: a query at
    position p sees keys (p - W, p] only; `logit_softcap` c: scores become c * tanh(score / c)
    before the mask (None or 0: neither). On CUDA each (window?, soft-cap?) pair is its own
    compiled kernel variant: `warmup` must be told which ones the model runs. An fp8 cache is read
    as `stored * k_scale` and `stored * v_scale` (its own compiled variant); others ignore the scales.
    `sinks` [num_heads] float32 (gpt-oss): a learned logit per query head in every row's softmax
    denominator (a key with a zero value; its own compiled variant).
    """
    sliding_window, logit_softcap = _check_masking(sliding_window, logit_softcap)
    if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be float32 [num_heads={query.shape[1]}], not {sinks.dtype} {tuple(sinks.shape)}")
    if _use_triton(query, impl):
        from kernels import triton_attention

        return triton_attention.paged_attention(
            query, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, out=out,
            max_seqlen_k=max_seqlen_k, kv_splits=kv_splits, sliding_window=sliding_window, logit_softcap=logit_softcap,
            k_scale=k_scale, v_scale=v_scale, sinks=sinks,
        )
    if impl is None and cpu_ops.takes(query, kv_cache) and (out is None or out.is_contiguous() and out.dtype == query.dtype):
        out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
        cpu_ops.attention(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
                          logit_softcap, sinks)
        return out
    plan = None
    if step_cache is not None:
        key = "reference_plan" if sliding_window is None else ("reference_plan", sliding_window)
        plan = step_cache.get(key)
        if plan is None:
            plan = step_cache[key] = reference.plan_attention(
                block_tables, seq_lens, cu_seqlens_q, kv_cache.shape[2], sliding_window)
    return reference.paged_attention(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, out=out, plan=plan,
                                     sliding_window=sliding_window, logit_softcap=logit_softcap, k_scale=k_scale,
                                     v_scale=v_scale, sinks=sinks)


def copy_blocks(
    kv_caches: Sequence[torch.Tensor], src_to_dst: torch.Tensor | Sequence[Sequence[int]], *, impl: Impl = None,
) -> None:
    """Copy whole blocks src -> dst in every layer's cache (copy-on-write); each dst is a fresh block.

    src_to_dst: [(src, dst), ...] or a [num_pairs, 2] tensor.
    """
    if not kv_caches or len(src_to_dst) == 0:
        return
    device = kv_caches[0].device
    pairs = torch.as_tensor(src_to_dst, dtype=torch.int64).reshape(-1, 2).to(device, non_blocking=True)
    if _use_triton(kv_caches[0], impl):
        from kernels import triton_cache

        return triton_cache.copy_blocks(list(kv_caches), pairs)
    return reference.copy_blocks(list(kv_caches), pairs)


def swap_blocks(
    src_cache: torch.Tensor | Sequence[torch.Tensor], dst_cache: torch.Tensor | Sequence[torch.Tensor],
    src_to_dst: torch.Tensor | Sequence[Sequence[int]], *, impl: Impl = None,
) -> None:
    """Copy blocks src -> dst between pools on two devices (GPU pool <-> CPU pool), for one layer's
    cache or for per-layer lists, batched per layer (see `reference.swap_blocks`); synchronous.
    A swap is a gather, a DMA and a scatter: there is no kernel to choose.
    """
    _check_impl(impl)
    pairs = src_to_dst.tolist() if isinstance(src_to_dst, torch.Tensor) else src_to_dst
    if isinstance(src_cache, torch.Tensor):
        src_cache, dst_cache = [src_cache], [dst_cache]
    reference.swap_blocks(list(src_cache), list(dst_cache), pairs)


def warmup(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
           device: torch.device, max_model_len: int,
           attention_variants: Iterable[tuple] = ((None, None),),
           kv_cache_dtype: torch.dtype | None = None) -> int:
    """Compile every Triton kernel variant this model can launch (attention tiles of both phases,
    every split count the heuristic can pick and its reduce, write_kv, copy_blocks) and reserve the
    split-KV workspace, so that no kernel compiles while serving. Call once at start-up, before
    sizing the KV pool and before capturing CUDA graphs. CUDA only (elsewhere the references run,
    nothing compiles): returns the number of warm-up launches, 0 off CUDA.

    `attention_variants`: the (sliding_window, logit_softcap) pairs the model's layers pass to
    `paged_attention`, values or None, repeats allowed: e.g. {(4096, 50.0), (None, 50.0)} for
    Gemma 2, {(4096, None)} for Mistral v0.1; a third item True where the layers have sinks
    (gpt-oss: {(128, None, True), (None, None, True)}). The default is one plain variant (no window,
    no cap). A window's size matters (it bounds the split counts); a cap's value does not.
    `kv_cache_dtype`: the cache's when it is not `dtype` (fp8).
    """
    variants = sorted({_variant(*variant) for variant in attention_variants})
    if not variants:
        raise ValueError("attention_variants names no variant: pass ((None, None),) for plain attention")
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return 0
    from kernels import triton_attention, triton_cache

    dtype_name = str(dtype).removeprefix("torch.")
    kv_cache_dtype = kv_cache_dtype or dtype
    kv_dtype_name = "" if kv_cache_dtype == dtype else str(kv_cache_dtype).removeprefix("torch.")
    launches = 0
    for window, softcap, sinks in variants:
        shape = AttentionShape(num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, dtype_name,
                               window > 0, softcap, kv_dtype_name, sinks)
        launches += triton_attention.warmup(shape, max_model_len, device, sliding_window=window or None)
    return launches + triton_cache.warmup(num_kv_heads, head_dim, block_size, dtype, device, kv_cache_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: Impl = None) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [..., hidden] (semantics: `fused.rms_norm_reference`)."""
    if impl is None and torch.compiler.is_compiling():  # plain torch ops, for Inductor to fuse
        return fused.rms_norm_reference(x, weight, eps)
    if impl is None:
        return fused.rms_norm(x, weight, eps)
    if _use_triton(x, impl):
        from kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps)
    return fused.rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: Impl = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a layer's residual add and the next norm in one op."""
    if impl is None and torch.compiler.is_compiling():  # plain torch ops, for Inductor to fuse
        return fused.fused_add_rms_norm_reference(x, residual, weight, eps)
    if impl is None:
        return fused.fused_add_rms_norm(x, residual, weight, eps)
    if _use_triton(x, impl):
        from kernels import triton_fused

        return triton_fused.fused_add_rms_norm(x, residual, weight, eps)
    return fused.fused_add_rms_norm_reference(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
    sin_cache: torch.Tensor, *, impl: Impl = None,
) -> None:
    """Rotate query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim]
    in place by positions [num_tokens], from cos/sin caches [max_positions, head_dim] (neox layout)."""
    if impl is None and torch.compiler.is_compiling():  # plain torch ops, for Inductor to fuse
        return fused.rotary_embedding_reference(positions, query, key, cos_cache, sin_cache)
    if impl is None:
        return fused.rotary_embedding(positions, query, key, cos_cache, sin_cache)
    if _use_triton(query, impl):
        from kernels import triton_fused

        return triton_fused.rotary_embedding(positions, query, key, cos_cache, sin_cache)
    return fused.rotary_embedding_reference(positions, query, key, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor, *, impl: Impl = None) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
    if impl is None and torch.compiler.is_compiling():  # plain torch ops, for Inductor to fuse
        return fused.silu_and_mul_reference(x)
    if impl is None:
        return fused.silu_and_mul(x)
    if _use_triton(x, impl):
        from kernels import triton_fused

        return triton_fused.silu_and_mul(x)
    return fused.silu_and_mul_reference(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> gelu_tanh(gate) * up [..., d] (Gemma's GeGLU), as
    transformers' `gelu_pytorch_tanh` activation computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def fused_moe(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0, impl: Impl = None,
) -> torch.Tensor:
    """The routed experts of a MoE layer: sum over each token's top-k experts e of
    `weight * (w2[e] @ act_and_mul(gate_e, up_e) + b2[e])` with [gate_e; up_e] = w13[e] @ x + b13[e].

    hidden_states [num_tokens, hidden]; w13 [num_experts, 2 * intermediate, hidden]; w2
    [num_experts, hidden, intermediate]; topk_weights [num_tokens, top_k]; topk_ids [num_tokens,
    top_k]; the biases (gpt-oss) [num_experts, 2 * intermediate] and [num_experts, hidden], or
    None. `activation`: "silu", "gelu_tanh" or gpt-oss's clamped "swigluoai" (`alpha`, `limit`:
    kernels/moe.py). CUDA: the fused Triton kernel (tokens grouped by expert, one launch per
    projection); elsewhere the reference, `kernels.moe.fused_moe_reference`.
    """
    from kernels import moe

    if _use_triton(hidden_states, impl):
        from kernels import triton_moe

        return triton_moe.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, activation=activation,
                                    w13_bias=w13_bias, w2_bias=w2_bias, alpha=alpha, limit=limit)
    return moe.fused_moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias=w13_bias,
                                   w2_bias=w2_bias, alpha=alpha, limit=limit)


def fused_moe_mxfp4(
    hidden_states: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "swigluoai",
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, alpha: float = 1.702,
    limit: float = 7.0, impl: Impl = None,
) -> torch.Tensor:
    """`fused_moe` over MXFP4 experts (gpt-oss's checkpoints, kernels/mxfp4.py): w13 = (blocks
    [E, 2 * I, H / 2], scales [E, 2 * I, H / 32]) uint8, gate rows over up rows; w2 = (blocks
    [E, H, I / 2], scales [E, H, I / 32]). CUDA: the fused Triton kernel, decoding each weight tile
    as it loads; elsewhere the reference over the dequantized weights."""
    if _use_triton(hidden_states, impl):
        from kernels import triton_moe

        return triton_moe.fused_moe_mxfp4(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                                          w13_bias=w13_bias, w2_bias=w2_bias, alpha=alpha, limit=limit)
    from kernels.mxfp4 import fused_moe_mxfp4_reference

    return fused_moe_mxfp4_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias=w13_bias,
                                     w2_bias=w2_bias, alpha=alpha, limit=limit)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, *, use_qk_l2norm: bool = True, impl: Impl = None,
) -> torch.Tensor:
    """The gated delta rule (Gated DeltaNet's linear attention) over a step's sequences, each from
    its state slot (or zeros where `fresh`), the slots left holding their final states
    (semantics: `kernels.gated_delta`). q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv];
    cu_seqlens [B + 1]; state [num_slots, Hv, Dk, Dv] float32; slots [B]; fresh [B] bool.
    CUDA: the Triton recurrent kernel; elsewhere the reference (a prompt chunked as transformers'
    prefill, a decode stepped)."""
    if _use_triton(q, impl):
        from kernels import triton_gated_delta

        return triton_gated_delta.gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slots, fresh,
                                                   use_qk_l2norm=use_qk_l2norm)
    from kernels.gated_delta import gated_delta_rule_reference

    return gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, state, slots, fresh, use_qk_l2norm=use_qk_l2norm)


def warmup_moe(w13, w2, top_k: int, *, activation: str = "silu", weights_dtype: torch.dtype = torch.float32,
               w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> int:
    """Compile every variant `fused_moe` (or, for MXFP4 experts given as (blocks, scales) pairs,
    `fused_moe_mxfp4`, whose activations are `dtype`) can launch for these expert weights (one tiny
    launch per tile config), so that no MoE kernel compiles while serving. CUDA only: returns the
    number of launches, 0 elsewhere."""
    packed = isinstance(w13, tuple)
    blocks = w13[0] if packed else w13
    if not blocks.is_cuda or interpreting():
        return 0
    from kernels import triton_moe

    num_experts = blocks.shape[0]
    hidden, intermediate = (blocks.shape[2] * 2, blocks.shape[1] // 2) if packed else (w13.shape[2], w13.shape[1] // 2)
    if dtype is None and packed:
        raise ValueError("warmup_moe of MXFP4 experts needs the activations' dtype")
    dtype = dtype or w13.dtype
    x = torch.zeros((1, hidden), dtype=dtype, device=blocks.device)
    ids = (torch.arange(top_k, device=blocks.device) % num_experts)[None]
    weights = torch.ones((1, top_k), dtype=weights_dtype, device=blocks.device)
    configs = triton_moe.all_tile_configs(hidden, intermediate, dtype)
    run = triton_moe.fused_moe_mxfp4 if packed else triton_moe.fused_moe
    for tiles in configs:
        run(x, w13, w2, weights, ids, activation, tiles=tiles, w13_bias=w13_bias, w2_bias=w2_bias)
    return len(configs)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, *, groups=None, meta=None,
                impl: Impl = None) -> torch.Tensor:
    """[M, R] float32: each row of x [M, K] times its adapter's A [S, R, K] (idx [M]: its slot, -1:
    none, zeros). The rows grouped by slot once a step, for every layer: `groups` the reference's
    (lora.slot_rows), `meta` the kernels' (triton_lora.LoRAMeta.of)."""
    if _use_triton(x, impl):
        from kernels import triton_lora

        return triton_lora.lora_shrink(x, a, idx, meta)
    return lora.lora_shrink(x, a, idx, groups)


def lora_expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, offset: int = 0, *,
                groups=None, meta=None, impl: Impl = None) -> None:
    """y[m, offset:offset + N] += t[m] @ B[idx[m]]^T for each row with an adapter (B [S, N, R])."""
    if _use_triton(y, impl):
        from kernels import triton_lora

        return triton_lora.lora_expand(t, b, idx, y, offset, meta)
    return lora.lora_expand(t, b, idx, y, offset, groups)


def _check_masking(sliding_window: int | None, logit_softcap: float | None) -> tuple[int | None, float | None]:
    """(window, cap) with 0 read as None (neither); a negative one is refused."""
    if (sliding_window or 0) < 0 or (logit_softcap or 0) < 0:
        raise ValueError(f"sliding_window ({sliding_window}) and logit_softcap ({logit_softcap}) must be positive, "
                         "or None for no window and no soft-cap")
    return sliding_window or None, logit_softcap or None


def _variant(sliding_window: int | None, logit_softcap: float | None, sinks: bool = False) -> tuple[int, bool, bool]:
    """(window or 0, soft-capped?, sinks?): what selects a compiled attention variant."""
    sliding_window, logit_softcap = _check_masking(sliding_window, logit_softcap)
    return sliding_window or 0, bool(logit_softcap), bool(sinks)


def _check_impl(impl: Impl) -> None:
    if impl not in (None, "triton", "torch"):
        raise ValueError(f"impl must be 'triton', 'torch' or None (by device), not {impl!r}")


def _use_triton(tensor: torch.Tensor, impl: Impl) -> bool:
    _check_impl(impl)
    if impl is None:  # under the interpreter, Triton runs only when asked for
        return tensor.is_cuda and not interpreting()
    if impl == "triton" and not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            "impl='triton' on CPU tensors runs in Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before triton is imported, or use impl='torch'"
        )
    return impl == "triton"
