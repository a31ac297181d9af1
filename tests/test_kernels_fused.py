"""The fused ops (kernels/fused.py): their CPU kernels against the unfused expressions the model ran
before, bit for bit; their Triton kernels against those references (in Triton's interpreter with
TRITON_INTERPRET=1, float32 and float16, else compiled on CUDA as `gpu` tests, bfloat16 included);
the custom-op registrations (opcheck, torch.compile); the model before and after fusion on a tiny
random Llama, bit for bit; and the ops one decode forward dispatches, per layer, exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import fused
from tests.triton_env import (
    DEVICE, INTERPRET, ROOT, count_compiled_for_sm90, run_in_a_clean_interpreter, tolerance,
    triton_test,
)
from tests.triton_env import DTYPES as TRITON_DTYPES


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Small tensors: intra-op threads only add overhead."""


# ----------------------------------------------------- the unfused model (worker/model.py at 46ef56a)


def unfused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def unfused_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def unfused_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def unfused_forward(model, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's forward before fusion, over the same modules."""
    from worker.context import get_context

    cos, sin = model.cos_cache[positions], model.sin_cache[positions]
    x = model.model.embed_tokens(input_ids)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        paged = attn.attn
        h = unfused_rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = unfused_rope(q.view(-1, paged.num_heads, attn.head_dim), k.view(-1, paged.num_kv_heads, attn.head_dim),
                            cos, sin)
        ctx = get_context()
        kernels.write_kv(k, v.view(-1, paged.num_kv_heads, attn.head_dim), paged.kv_cache, ctx.slot_mapping)
        o = kernels.paged_attention(q, paged.kv_cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q, paged.scale,
                                    step_cache=ctx.kernel_cache)
        x = x + attn.o_proj(o.reshape(-1, attn.q_size))
        h = unfused_rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        x = x + mlp.down_proj(unfused_silu_and_mul(mlp.gate_up_proj(h)))
    return unfused_rms_norm(x, model.model.norm.weight, model.model.norm.eps)


# ------------------------------------------------------------------------------------------ inputs


def _norm_inputs(num_tokens: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3
    residual = torch.randn(num_tokens, hidden, generator=gen) * 5
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
    return [t.to(device, dtype) for t in (x, residual, weight)]


def _rope_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str = "cpu", max_positions: int = 4096):
    """q and k as views of one fused qkv output (strided rows), positions in [0, max_positions),
    and cos/sin caches built as transformers' default rotary embedding builds them."""
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return qkv, q, k, positions, emb.cos().to(device, dtype), emb.sin().to(device, dtype)


# ------------------------------------------------------------- CPU kernels == the unfused expressions

CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_cpu_norms_equal_the_unfused_expressions_bit_for_bit(hidden, dtype):
    x, residual, weight = _norm_inputs(37, hidden, dtype)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5), unfused_rms_norm(x, weight, 1e-5))
    out, new_residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, unfused_rms_norm(residual + x, weight, 1e-6))
    assert out.dtype == new_residual.dtype == dtype


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_rotary_equals_the_unfused_expression_bit_for_bit_in_place(head_dim, dtype):
    qkv, q, k, positions, cos_cache, sin_cache = _rope_inputs(45, 9, 3, head_dim, dtype)
    want_q, want_k = unfused_rope(q, k, cos_cache[positions], sin_cache[positions])
    v_before = qkv[:, (9 + 3) * head_dim:].clone()
    assert kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache) is None
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (9 + 3) * head_dim:], v_before)  # v, beside them in the row, untouched


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_cpu_silu_and_mul_equals_the_unfused_expression_bit_for_bit(dtype):
    x = torch.randn(29, 2 * 1536, generator=torch.Generator().manual_seed(3)).to(dtype) * 4
    out = kernels.silu_and_mul(x)
    assert out.shape == (29, 1536)
    assert torch.equal(out, unfused_silu_and_mul(x))


def test_impl_torch_runs_the_reference_and_impl_is_checked():
    x, residual, weight = _norm_inputs(3, 64, torch.float32)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, impl="torch"), kernels.rms_norm(x, weight, 1e-5))
    with pytest.raises(ValueError, match="impl must be 'triton', 'torch'"):
        kernels.silu_and_mul(x, impl="cuda")


def test_cpu_path_never_imports_triton():
    code = (
        "import sys, torch, kernels\n"
        "x = torch.ones(2, 8)\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-5); kernels.fused_add_rms_norm(x, x, torch.ones(8), 1e-5)\n"
        "kernels.silu_and_mul(x); q = torch.ones(2, 2, 8); k = torch.ones(2, 1, 8)\n"
        "kernels.rotary_embedding(torch.tensor([0, 1]), q, k, torch.ones(4, 8), torch.zeros(4, 8))\n"
        "print('triton' in sys.modules)\n"
    )
    assert run_in_a_clean_interpreter(code) == ["False"]


# ---------------------------------------------------------------------------- the custom ops


def test_custom_ops_pass_opcheck():
    x, residual, weight = _norm_inputs(5, 64, torch.float32)
    _, q, k, positions, cos_cache, sin_cache = _rope_inputs(5, 4, 2, 16, torch.float32, max_positions=32)
    torch.library.opcheck(torch.ops.pagoda.rms_norm.default, (x, weight, 1e-5))
    torch.library.opcheck(torch.ops.pagoda.fused_add_rms_norm.default, (x, residual, weight, 1e-5))
    torch.library.opcheck(torch.ops.pagoda.rotary_embedding.default, (positions, q, k, cos_cache, sin_cache))
    torch.library.opcheck(torch.ops.pagoda.silu_and_mul.default, (x,))


def test_torch_compile_traces_the_ops_in_one_graph():
    """fullgraph: no graph break at any of the four ops; the compiled result equals eager."""
    x, residual, weight = _norm_inputs(6, 64, torch.float32)
    _, q, k, positions, cos_cache, sin_cache = _rope_inputs(6, 2, 2, 16, torch.float32, max_positions=32)

    def block(x, residual, q, k):
        h, residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
        kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache)
        return kernels.silu_and_mul(kernels.rms_norm(h, weight, 1e-5)), residual, q * 1, k * 1

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x, residual, q.clone(), k.clone())
    want = block(x, residual, q.clone(), k.clone())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


# ------------------------------------------------------------------ Triton kernels vs the references


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (67, 576), (300, 96), (5, 4096)])
def test_triton_norms_match_the_reference(num_tokens, hidden, dtype):
    x, residual, weight = _norm_inputs(num_tokens, hidden, dtype, DEVICE, seed=hidden)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5, impl="triton"),
                               fused.rms_norm_reference(x, weight, 1e-5), **tolerance(dtype))
    out, new_residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-6, impl="triton")
    want_out, want_residual = fused.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual)  # one rounding of the float32 sum, as torch's
    torch.testing.assert_close(out, want_out, **tolerance(dtype))


@triton_test
def test_triton_norm_reads_strided_rows_and_leading_dims():
    x, residual, weight = _norm_inputs(24, 2 * 576, torch.float32, DEVICE)
    x, residual = x[:, :576].view(2, 12, 576), residual[:, 576:].view(2, 12, 576)  # rows 1152 apart
    weight = weight[:576]
    out, new_residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton")
    assert out.shape == new_residual.shape == (2, 12, 576)
    want_out, want_residual = fused.fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out, want_out, **tolerance(torch.float32))


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim",
                         [(1, 9, 3, 64), (130, 9, 3, 64), (33, 32, 8, 128), (7, 4, 4, 80)])
def test_triton_rotary_matches_the_reference_in_place(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    qkv, q, k, positions, cos_cache, sin_cache = _rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                                                              DEVICE)
    want_qkv = qkv.clone()
    want_q = want_qkv[:, : num_heads * head_dim].view_as(q)
    want_k = want_qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view_as(k)
    fused.rotary_embedding_reference(positions, want_q, want_k, cos_cache, sin_cache)
    kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache, impl="triton")
    torch.testing.assert_close(qkv, want_qkv, **tolerance(dtype))
    v = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v], want_qkv[:, v])


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_partial_rotary_rotates_only_the_leading_dims(dtype):
    """Partial rotary (Phi-4-mini: 0.75 of the head): the views q[..., :rotary_dim] are rotated in
    place by caches of rotary_dim columns, the other dims untouched."""
    num_heads, num_kv_heads, head_dim, rotary_dim = 4, 2, 32, 24
    qkv, q, k, positions, _, _ = _rope_inputs(9, num_heads, num_kv_heads, head_dim, dtype, DEVICE, max_positions=64)
    _, _, _, _, cos_cache, sin_cache = _rope_inputs(9, num_heads, num_kv_heads, rotary_dim, dtype, DEVICE,
                                                    max_positions=64)
    want_qkv = qkv.clone()
    want_q = want_qkv[:, : num_heads * head_dim].view_as(q)
    want_k = want_qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view_as(k)
    fused.rotary_embedding_reference(positions, want_q[..., :rotary_dim], want_k[..., :rotary_dim], cos_cache, sin_cache)
    kernels.rotary_embedding(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos_cache, sin_cache, impl="triton")
    torch.testing.assert_close(qkv, want_qkv, **tolerance(dtype))
    assert torch.equal(q[..., rotary_dim:], want_q[..., rotary_dim:])


@triton_test
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 128), (45, 1536), (3, 1500), (2, 2 * 1024 + 5)])
def test_triton_silu_and_mul_matches_the_reference(num_tokens, d, dtype):
    x = (torch.randn(num_tokens, 2 * d, generator=torch.Generator().manual_seed(d)) * 4).to(DEVICE, dtype)
    torch.testing.assert_close(kernels.silu_and_mul(x, impl="triton"), fused.silu_and_mul_reference(x),
                               **tolerance(dtype))


def _compile_fused_for_sm90() -> list[str]:
    """Compile every variant of the fused kernels for sm_90 (Triton's own ptxas), pointers and
    strides 16-divisible as the JIT sees them. Run with TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_fused as tf

    def compile_(fn, types: dict, consts: dict, num_warps: int = 4) -> str:
        sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if name.endswith("_ptr") or name.startswith("stride")}
        triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
        return f"{fn.__name__} {sorted(consts.items())}"

    done = []
    for dtype, hidden, head_dim in [("bf16", 4096, 128), ("fp16", 576, 64), ("fp32", 576, 80)]:
        ptr = f"*{dtype}"
        block = triton.next_power_of_2(hidden)
        for has_residual in (False, True):
            done.append(compile_(tf._rms_norm_kernel, {
                "x_ptr": ptr, "residual_ptr": ptr, "weight_ptr": ptr, "out_ptr": ptr, "residual_out_ptr": ptr,
                "eps": "fp32"}, {"HAS_RESIDUAL": has_residual, "BLOCK": block}, tf._norm_warps(block)))
        half = head_dim // 2
        done.append(compile_(tf._rotary_kernel, {
            "positions_ptr": "*i64", "query_ptr": ptr, "key_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr},
            {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": half, "HEADS_P2": 32, "KV_HEADS_P2": 8,
             "HALF_P2": triton.next_power_of_2(half)}))
        done.append(compile_(tf._silu_and_mul_kernel, {"x_ptr": ptr, "out_ptr": ptr}, {"BLOCK": tf.SILU_BLOCK}))
    return done


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernels are compiled for the device itself")
def test_every_fused_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter runs Python, not the compiler: this catches what only compiling would."""
    assert count_compiled_for_sm90("tests.test_kernels_fused", "_compile_fused_for_sm90") == 12  # 3 dtypes x 4


@pytest.mark.gpu
def test_cuda_dispatch_runs_the_triton_kernels():
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: the CUDA kernels of the ops run the references")
    x, residual, weight = _norm_inputs(16, 576, torch.bfloat16, "cuda")
    assert torch.equal(kernels.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
                       kernels.fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton")[0])
    assert torch.equal(kernels.silu_and_mul(x), kernels.silu_and_mul(x, impl="triton"))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need the compiled kernels; TRITON_INTERPRET=1 is set")
def test_fused_ops_replay_in_a_cuda_graph_with_new_inputs():
    x, residual, weight = _norm_inputs(8, 576, torch.bfloat16, "cuda")
    qkv, q, k, positions, cos_cache, sin_cache = _rope_inputs(8, 9, 3, 64, torch.bfloat16, "cuda")
    gate_up = torch.randn(8, 2 * 1536, device="cuda", dtype=torch.bfloat16)

    def step():
        out, new_residual = kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
        kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache)
        return out, new_residual, kernels.silu_and_mul(gate_up)

    step()  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, residual, qkv, gate_up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, 4096, positions.shape, device="cuda"))
    want_qkv = qkv.clone()
    want_q, want_k = want_qkv[:, : 9 * 64].view_as(q), want_qkv[:, 9 * 64: 12 * 64].view_as(k)
    kernels.rotary_embedding(positions, want_q, want_k, cos_cache, sin_cache, impl="triton")
    want = (*kernels.fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton"),
            kernels.silu_and_mul(gate_up, impl="triton"))
    graph.replay()
    torch.cuda.synchronize()
    for got, expected in zip((*outs, qkv), (*want, want_qkv), strict=True):
        assert torch.equal(got, expected)


# ------------------------------------------------------------------------ the model, before and after


def _load(tiny, dtype: torch.dtype):
    from common.models import ModelSource
    from worker.loader import load_model

    directory, _ = tiny
    return load_model(ModelSource("hf", Path(directory), "tiny"), dtype, torch.device("cpu"), 256)[0]


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return _load(tiny, torch.float32)


def _two_steps(model, forward, block_size: int = 16) -> list[torch.Tensor]:
    """Logits of a prefill of three prompts (5, 17 and 33 tokens) then one decode step of each,
    over a fresh KV pool of zeros."""
    from worker.context import AttentionContext, attention_context

    lens = [5, 17, 33]
    blocks = 4
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros((1 + len(lens) * blocks, 2, block_size, attn.num_kv_heads, attn.head_dim),
                                    dtype=model.model.embed_tokens.weight.dtype)
    tables = torch.tensor([[1 + i * blocks + b for b in range(blocks)] for i in range(len(lens))], dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    steps = [[list(range(n)) for n in lens], [[n] for n in lens]]  # positions per sequence
    logits = []
    for step in steps:
        positions = torch.tensor([p for seq in step for p in seq])
        slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                              for i, seq in enumerate(step) for p in seq])
        cu = torch.tensor([0] + [len(s) for s in step]).cumsum(0).to(torch.int32)
        context = AttentionContext(slot_mapping=slots, block_tables=tables,
                                   seq_lens=torch.tensor([s[-1] + 1 for s in step], dtype=torch.int32),
                                   cu_seqlens_q=cu)
        input_ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=gen)
        with torch.inference_mode(), attention_context(context):
            logits.append(model.compute_logits(forward(input_ids, positions)))
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_output_is_identical_before_and_after_fusion(tiny, dtype):
    model = _load(tiny, dtype)
    fused_logits = _two_steps(model, model)
    unfused_logits = _two_steps(model, lambda ids, pos: unfused_forward(model, ids, pos))
    assert [t.shape for t in fused_logits] == [(55, 512), (3, 512)]
    for got, want in zip(fused_logits, unfused_logits, strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------- counting ops

FUSED_OPS = {"pagoda.fused_add_rms_norm.default": 2, "pagoda.rotary_embedding.default": 1,
             "pagoda.silu_and_mul.default": 1}
ATTENTION_OPS = {  # kernels.write_kv and kernels.paged_attention's torch references, and the views around them
    "aten.empty_like.default": 1, "aten.flatten.using_ints": 1, "aten.floor_divide.default": 1, "aten.ge.Scalar": 1,
    "aten.index.Tensor": 4, "aten.index_put_.default": 3, "aten.index_select.default": 2, "aten.masked_fill_.Scalar": 2,
    "aten.permute.default": 2, "aten.remainder.Scalar": 1, "aten.reshape.default": 2,
    "aten.scaled_dot_product_attention.default": 1, "aten.select.int": 4, "aten.slice.Tensor": 2,
    "aten.to.dtype": 6, "aten.unsqueeze.default": 4, "aten.view.default": 6,
}


CPU_ATTENTION_OPS = {  # the C++ kernels of kernels/cpu_ops.py: the KV write and the attention, one op each
    "aten.empty.memory_format": 1, "aten.reshape.default": 1, "aten.view.default": 3,
    "pagoda_cpu.attention.default": 1, "pagoda_cpu.write_kv.default": 1,
}


def test_a_decode_layer_dispatches_four_fused_ops_and_no_elementwise_aten_op(tiny_model, monkeypatch):
    """Batch 8 decode: 16 ops per layer (11 that are not views), of which the layer's own are the four
    fused ops, the qkv split and the four projections; the rest is the CPU attention kernels. With
    the torch references for attention, 52 (24); unfused, the same layer dispatched 83 (46)."""
    from kernels import cpu_ops
    from pagoda.bench.ops import cpu_counts

    layer_ops = {**FUSED_OPS, "aten.linear.default": 4, "aten.split_with_sizes.default": 1}
    if cpu_ops.available():
        counts = cpu_counts(tiny_model, batch=8, context_len=128)
        assert counts["per_layer_by_op"] == {**layer_ops, **CPU_ATTENTION_OPS}
        assert (counts["per_layer_ops"], counts["per_layer_non_view_ops"], counts["total_ops"]) == (16, 11, 39)
    monkeypatch.setattr(cpu_ops, "_available", False)
    counts = cpu_counts(tiny_model, batch=8, context_len=128)
    assert counts["per_layer_by_op"] == {**layer_ops, **ATTENTION_OPS}
    assert (counts["per_layer_ops"], counts["per_layer_non_view_ops"]) == (52, 24)
    # the rest: the step's attention metadata, the embedding, the first layer (an rms_norm without a
    # residual), the final norm, the logits
    assert counts["total_ops"] == 130


def test_the_unfused_layer_dispatched_83_ops(tiny_model, monkeypatch):
    """The before figure: the same count over the unfused forward (and the attention references)."""
    from kernels import cpu_ops
    from pagoda.bench.ops import cpu_counts

    monkeypatch.setattr(cpu_ops, "_available", False)
    monkeypatch.setattr(type(tiny_model), "forward", unfused_forward)
    counts = cpu_counts(tiny_model, batch=8, context_len=128)
    assert (counts["per_layer_ops"], counts["per_layer_non_view_ops"]) == (83, 46)


def test_bench_ops_writes_the_counts_of_a_decode_forward(tmp_path, capsys):
    from pagoda import cli

    output = tmp_path / "ops.json"
    tiny_config = ROOT / "tests" / "data" / "tiny-llama.json"
    assert cli.main(["bench", "ops", "--model", f"dummy:{tiny_config}", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["command"] == (f"pagoda bench ops --model dummy:{tiny_config} --device cpu --dtype auto "
                                 f"--batch-size 8 --context-len 128 --output {output}")
    assert (result["batch"], result["context"], result["dtype"], result["num_layers"]) == (8, 128, "float32", 2)
    from kernels import cpu_ops

    expected = (39, 16, 11) if cpu_ops.available() else (130, 52, 24)
    assert (result["total_ops"], result["per_layer_ops"], result["per_layer_non_view_ops"]) == expected
    assert result["forward_ms"] > 0 and "op_times" not in result
    assert json.loads(capsys.readouterr().out) == result


@pytest.mark.gpu
def test_a_cuda_decode_layer_launches_each_fused_kernel_once(tiny_model):
    from pagoda.bench.ops import cuda_counts

    model = tiny_model.to("cuda")
    try:
        counts = cuda_counts(model, batch=8, context_len=128)
    finally:
        tiny_model.to("cpu")
    by_kernel = counts["per_layer_by_kernel"]
    assert {name: n for name, n in by_kernel.items() if "_rms_norm_kernel" in name} == {"_rms_norm_kernel": 2}
    assert by_kernel.get("_rotary_kernel") == 1 and by_kernel.get("_silu_and_mul_kernel") == 1
