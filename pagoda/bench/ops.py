"""`pagoda bench ops`: how many ops (CPU) or kernels (CUDA) one decode forward launches.

One decode step of `--batch-size` sequences, each `--context-len` tokens long (one new token each),
through the model's forward and its logits, on the real model with a KV pool of zeros.

- On CPU, a dispatch counter (`OpCounter`, a TorchDispatchMode) counts every op dispatched below
  Python: aten ops and the `pagoda` custom ops, a custom op once (its CPU body, plain torch, is not
  counted: on a GPU it is one Triton launch). `non_view_ops` leaves out views (slice, t, view),
  which launch nothing on a GPU.
- On CUDA, torch.profiler counts the kernels (and memcpy/memset) the device ran.

Per layer: the ops of a model cut to its first two layers minus those of its first layer alone (the
second layer; every layer after the first is the same), so that the embedding, the final norm and
the logits stay out of it. Also the median wall time of the forward (no counter running).

`--time-ops` times each fused op at the model's shapes (the batch, and 512 tokens) three ways: the
unfused torch expression eagerly, torch.compile of that expression, and the custom op (on CPU its
torch reference, on CUDA its Triton kernel): the measurement behind choosing Triton kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda.bench.common import command_words, emit, header
from pagoda.bench.timing import time_in_turn


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside it by name (`aten.mm.default`, `pagoda.rms_norm.default`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.views: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        if func.is_view:
            self.views[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return self.counts.total()

    @property
    def non_view(self) -> int:
        return self.counts.total() - self.views.total()


def count_ops(fn: Callable[[], object]) -> OpCounter:
    with OpCounter() as counter:
        fn()
    return counter


def count_cuda_kernels(fn: Callable[[], object]) -> Counter[str]:
    """The device-side events (kernels, memcpy, memset) of one call of `fn`, after a warm-up call
    (Triton compiles, cuBLAS picks its kernels), by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)


def decode_forward(model, batch: int, context_len: int, block_size: int = 16) -> Callable[[], torch.Tensor]:
    """A call that runs one decode forward of `model` (and its logits) over a fresh KV pool of zeros."""
    from worker.context import AttentionContext, attention_context

    device = model.cos_cache.device
    blocks_per_seq = -(-context_len // block_size)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros((1 + batch * blocks_per_seq, 2, block_size, attn.num_kv_heads, attn.head_dim),
                                    dtype=model.model.embed_tokens.weight.dtype, device=device)
    block_tables = 1 + torch.arange(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq)
    last = context_len - 1
    slot_mapping = block_tables[:, last // block_size] * block_size + last % block_size
    input_ids = torch.arange(batch, device=device) % model.config.vocab_size
    positions = torch.full((batch,), last, device=device)

    @torch.inference_mode()
    def forward() -> torch.Tensor:
        context = AttentionContext(
            slot_mapping=slot_mapping, block_tables=block_tables.to(torch.int32),
            seq_lens=torch.full((batch,), context_len, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
        )
        with attention_context(context):
            return model.compute_logits(model(input_ids, positions))

    return forward


@contextlib.contextmanager
def first_layers(model, n: int) -> Iterator[None]:
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(list(layers)[:n])
    try:
        yield
    finally:
        model.model.layers = layers


def count_decode(model, batch: int, context_len: int, counter: Callable) -> dict:
    """`counter`'s result for the whole forward and for one layer (the second)."""
    forward = decode_forward(model, batch, context_len)
    with first_layers(model, 1):
        one = counter(forward)
    with first_layers(model, 2):
        two = counter(forward)
    return {"total": counter(forward), "layer": (one, two)}


def cpu_counts(model, batch: int, context_len: int) -> dict:
    counts = count_decode(model, batch, context_len, count_ops)
    one, two = counts["layer"]
    total = counts["total"]
    return {
        "num_layers": len(model.layers), "total_ops": total.total, "total_non_view_ops": total.non_view,
        "per_layer_ops": two.total - one.total, "per_layer_non_view_ops": two.non_view - one.non_view,
        "per_layer_by_op": dict(sorted((two.counts - one.counts).items())),
    }


def cuda_counts(model, batch: int, context_len: int) -> dict:
    counts = count_decode(model, batch, context_len, count_cuda_kernels)
    one, two = counts["layer"]
    return {"num_layers": len(model.layers), "total_kernels": counts["total"].total(),
            "per_layer_kernels": two.total() - one.total(), "per_layer_by_kernel": dict(sorted((two - one).items()))}


def synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def forward_ms(model, batch: int, context_len: int, repeats: int = 20) -> float:
    forward = decode_forward(model, batch, context_len)
    sync = synchronizer(model.cos_cache.device)
    return time_in_turn({"forward": forward}, repeats, warmup=1, sync=sync)["forward"] * 1e3


def time_fused_ops(model, num_tokens: int) -> list[dict]:
    """Each fused op at the model's shapes over `num_tokens` tokens, three ways: the unfused torch
    expression eagerly, torch.compile of that expression, and the op (on CPU its torch reference, on
    CUDA its Triton kernel)."""
    import kernels
    from kernels import fused

    layer, device = model.layers[0], model.cos_cache.device
    attn, dtype, eps = layer.self_attn, model.model.embed_tokens.weight.dtype, layer.input_layernorm.eps
    hidden, weight = model.config.hidden_size, layer.input_layernorm.weight
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)
    qkv = randn(num_tokens, attn.q_size + 2 * attn.kv_size)
    q = qkv[:, : attn.q_size].view(-1, attn.attn.num_heads, attn.head_dim)
    k = qkv[:, attn.q_size: attn.q_size + attn.kv_size].view(-1, attn.attn.num_kv_heads, attn.head_dim)
    positions = torch.randint(0, model.cos_cache.shape[0], (num_tokens,), generator=gen, device=device)
    gate_up = randn(num_tokens, 2 * model.config.intermediate_size)
    cases = {  # name: (the unfused expression, its arguments, the fused op's call)
        "fused_add_rms_norm": (fused.fused_add_rms_norm_reference, (x, residual, weight, eps),
                               lambda: kernels.fused_add_rms_norm(x, residual, weight, eps)),
        "rotary_embedding": (_unfused_rope, (positions, q, k, model.cos_cache, model.sin_cache),
                             lambda: kernels.rotary_embedding(positions, q, k, model.cos_cache, model.sin_cache)),
        "silu_and_mul": (fused.silu_and_mul_reference, (gate_up,), lambda: kernels.silu_and_mul(gate_up)),
    }
    rows = []
    with torch.inference_mode():
        for name, (unfused, inputs, op) in cases.items():
            compiled = torch.compile(unfused, dynamic=False)
            times = time_in_turn({
                "unfused_eager_us": lambda: unfused(*inputs),  # noqa: B023
                "unfused_torch_compile_us": lambda: compiled(*inputs),  # noqa: B023
                "custom_op_us": op,
            }, rounds=7, warmup=3, repeats=100, sync=synchronizer(device))
            rows.append({"op": name, "num_tokens": num_tokens, **{k: t * 1e6 for k, t in times.items()}})
    return rows


def _unfused_rope(positions, query, key, cos_cache, sin_cache):
    """RoPE as the model ran it before fusion: new q and k, not in place."""
    from kernels.fused import rotate_half

    cos, sin = cos_cache[positions][:, None, :], sin_cache[positions][:, None, :]
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench ops`'s flags."""
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context-len", type=int, default=128)
    parser.add_argument("--time-ops", action="store_true",
                        help="also time each fused op: unfused eager, torch.compile of it, the custom op")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench ops` handler: the JSON result on stdout (and in --output)."""
    from common.models import resolve_model
    from worker.loader import load_model
    from worker.model_runner import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, _ = load_model(resolve_model(args.model), dtype, device, args.context_len + 1)
    counts = cuda_counts if device.type == "cuda" else cpu_counts
    result = {
        **header("ops: what one decode forward launches", command_words("ops", args), str(device)),
        "host_load_1min": os.getloadavg()[0], "torch": torch.__version__, "model": args.model, "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch_size, "context": args.context_len,
        "counter": ("torch.profiler: CUDA kernels, memcpy and memset" if device.type == "cuda"
                    else "TorchDispatchMode: aten and custom ops dispatched, a custom op once"),
        **counts(model, args.batch_size, args.context_len),
        "forward_ms": forward_ms(model, args.batch_size, args.context_len),
    }
    if args.time_ops:
        result["op_times"] = [row for n in (args.batch_size, 512) for row in time_fused_ops(model, n)]
        result["op_timer"] = ("mean of 100 back-to-back calls (synchronized after on CUDA), median of 7 rounds "
                              "that interleave the three")
    emit(result, args.output)
    print(f"{result.get('total_ops', result.get('total_kernels'))} in all, "
          f"{result.get('per_layer_ops', result.get('per_layer_kernels'))} per layer, "
          f"forward {result['forward_ms']:.1f} ms", file=sys.stderr)
    return 0
