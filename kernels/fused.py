"""The fused elementwise ops of a Llama layer, as torch custom ops in the `pagoda` namespace.

- `pagoda::rms_norm(x, weight, eps)`: RMSNorm, as transformers' LlamaRMSNorm computes it.
- `pagoda::fused_add_rms_norm(x, residual, weight, eps) -> (normed, residual)`: the residual sum
  `x + residual` (rounded to the activation dtype) and its RMSNorm in one pass, as vLLM's layers
  call it: `h, residual = fused_add_rms_norm(attn_out, residual, weight, eps)`.
- `pagoda::rotary_embedding(positions, query, key, cos_cache, sin_cache)`: rotates query and key
  in place by their tokens' positions (neox layout, `rotate_half`), reading the caches' rows.
- `pagoda::silu_and_mul(x) -> out`: `silu(gate) * up` of a fused `[gate | up]` projection.

Each op's CPU kernel (and its kernel on any other device but CUDA) is the plain torch expression
below, which is also the Triton kernels' test oracle: the same ops in the same order as the model
ran them unfused, so CPU results are bit for bit those of the unfused model. The CUDA kernel is one
Triton launch per op (`triton_fused.py`), computing in float32 and rounding once. Being custom ops
with fake kernels, they are single nodes to torch.compile, and capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_common import interpreting  # no triton import

# ---------------------------------------------------------------------------------- the references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, then `weight * normed.to(input dtype)`."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # rounded to the activation dtype before the norm, as the unfused model did
    return rms_norm_reference(residual, weight, eps), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> None:
    """query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim], in place;
    positions [num_tokens]; cos_cache, sin_cache [max_positions, head_dim]."""
    cos, sin = cos_cache[positions][:, None, :], sin_cache[positions][:, None, :]
    query.copy_(query * cos + rotate_half(query) * sin)
    key.copy_(key * cos + rotate_half(key) * sin)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------- the custom ops
# Registered on a torch.library.Library directly, as vLLM's direct_register_custom_op does: an op
# made by torch.library.custom_op costs about 2.5 us more per call on CPU, and its first call imports
# torch._dynamo (and with it triton).

_lib = torch.library.Library("pagoda", "FRAGMENT")
SCHEMAS = {
    "rms_norm": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "rotary_embedding": "(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, Tensor sin_cache) -> ()",
    "silu_and_mul": "(Tensor x) -> Tensor",
}
REFERENCES = {
    "rms_norm": rms_norm_reference, "fused_add_rms_norm": fused_add_rms_norm_reference,
    "rotary_embedding": rotary_embedding_reference, "silu_and_mul": silu_and_mul_reference,
}


def _triton_kernel(name: str):
    """The CUDA kernel of op `name`: its Triton function (the reference under TRITON_INTERPRET=1,
    as everywhere in kernels/)."""
    reference = REFERENCES[name]

    def cuda_kernel(*args):
        if interpreting():
            return reference(*args)
        from kernels import triton_fused

        return getattr(triton_fused, name)(*args)

    return cuda_kernel


# Fake kernels: output shapes and dtypes for torch.compile's tracing.


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    residual_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=torch.promote_types(residual_dtype, weight.dtype)),
            x.new_empty(x.shape, dtype=residual_dtype))


def _rotary_embedding_fake(positions, query, key, cos_cache, sin_cache):
    return None


def _silu_and_mul_fake(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


FAKES = {"rms_norm": _rms_norm_fake, "fused_add_rms_norm": _fused_add_rms_norm_fake,
         "rotary_embedding": _rotary_embedding_fake, "silu_and_mul": _silu_and_mul_fake}

for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
    _lib.impl(_name, REFERENCES[_name], "CompositeExplicitAutograd")  # CPU, and any device but CUDA
    _lib.impl(_name, _triton_kernel(_name), "CUDA")
    torch.library.register_fake(f"pagoda::{_name}", FAKES[_name], lib=_lib)

rms_norm = torch.ops.pagoda.rms_norm.default
fused_add_rms_norm = torch.ops.pagoda.fused_add_rms_norm.default
rotary_embedding = torch.ops.pagoda.rotary_embedding.default
silu_and_mul = torch.ops.pagoda.silu_and_mul.default
