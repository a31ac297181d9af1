"""Triton kernels that move KV into and within the paged cache: write_kv and copy_blocks.

kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; a slot is
block * block_size + offset. Every offset into the cache is int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import fp8_max, is_fp8
from kernels.triton_common import interpreting


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One program per token copies its K and V head rows into its slot; slot -1 is skipped.

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64. An fp8
    cache gets K / k_scale and V / v_scale in float32, saturated to +-448 (kernels/kv_quant.py).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    fp8 = is_fp8(kv_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, float(k_scale) if fp8 else 1.0, float(v_scale) if fp8 else 1.0,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2], KV_FP8=fp8,
        FP8_MAX=fp8_max(kv_cache.dtype) if fp8 else 0.0, num_warps=4,
    )


# Token strides and offsets come from the caller's layout (views of a fused QKV projection): left
# unspecialized, so `warmup` compiles the serving variant from stand-in tensors.
@triton.jit(
    do_not_specialize=["stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head"],
    do_not_specialize_on_alignment=["key_ptr", "value_ptr", "slot_mapping_ptr"],
)
def _write_kv_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_block, stride_kv, stride_slot, stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)  # [HEADS_P2, HEAD_DIM_P2]
    dst = (kv_cache_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
           + heads * stride_head + dims)
    k = tl.load(key_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    if KV_FP8:  # as kv_quant.quantize: x / scale in float32, saturated, rounded to nearest even
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, k.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def warmup(num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device,
           kv_cache_dtype: torch.dtype | None = None) -> int:
    """Compile write_kv and copy_blocks for one cache layout (launches on a 2-block scratch
    cache: one padding token, one block copy). Returns the number of launches."""
    cache = torch.zeros((2, 2, block_size, num_kv_heads, head_dim), dtype=kv_cache_dtype or dtype, device=device)
    key = torch.zeros((1, num_kv_heads, head_dim), dtype=dtype, device=device)
    write_kv(key, key, cache, torch.full((1,), -1, dtype=torch.int64, device=device))
    copy_blocks([cache], torch.tensor([[0, 1]], dtype=torch.int64, device=device))
    return 2


COPY_CHUNK = 4096  # elements of a block each program copies


def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copy whole blocks (K and V) src -> dst in every layer's cache, in one launch (copy-on-write).

    kv_caches: per-layer contiguous caches of one shape and dtype; src_to_dst: [num_pairs, 2] int64
    on the caches' device. Layers are reached through a table of their base addresses.
    """
    num_pairs = src_to_dst.shape[0]
    if num_pairs == 0 or not kv_caches:
        return
    first = kv_caches[0]
    if first.is_cuda and interpreting():
        raise RuntimeError("copy_blocks' Triton kernel follows per-layer device addresses, which the interpreter "
                           "cannot: unset TRITON_INTERPRET or use impl='torch'")
    assert all(c.shape == first.shape and c.dtype == first.dtype and c.is_contiguous() for c in kv_caches)
    block_numel = first[0].numel()
    grid = (len(kv_caches), num_pairs, triton.cdiv(block_numel, COPY_CHUNK))
    _copy_blocks_kernel[grid](
        _layer_pointers(kv_caches), src_to_dst, block_numel, DTYPE=_TL_DTYPES[first.dtype], CHUNK=COPY_CHUNK,
        num_warps=4,
    )


# an fp8 cache's blocks are copied as bytes
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float8_e4m3fn: tl.uint8}
_pointer_tables: dict[tuple[int, ...], torch.Tensor] = {}


def _layer_pointers(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """[num_layers] int64 base addresses, built once per set of caches."""
    key = tuple(c.data_ptr() for c in kv_caches)
    if key not in _pointer_tables:
        _pointer_tables.clear()  # the caches were reallocated: the old table is stale
        _pointer_tables[key] = torch.tensor(key, dtype=torch.int64, device=kv_caches[0].device)
    return _pointer_tables[key]


@triton.jit
def _copy_blocks_kernel(layer_ptrs, src_to_dst_ptr, block_numel, DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    layer = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    cache = tl.load(layer_ptrs + layer).to(tl.pointer_type(DTYPE))
    src = tl.load(src_to_dst_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(src_to_dst_ptr + 2 * pair + 1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    data = tl.load(cache + src * block_numel + offs, mask=mask)
    tl.store(cache + dst * block_numel + offs, data, mask=mask)
