"""INT4 checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) against their formats' reference.

Each format's checkpoint of the tiny Llama is written here as its own tools write it (quantize,
then pack: AutoAWQ's and auto-gptq's packing loops restated; compressed-tensors' own compressor),
loaded by the engine, and its greedy tokens equal, exactly in float32, those of transformers'
LlamaForCausalLM whose linear weights are the format's reference dequantization (for
compressed-tensors the library's own `decompress`). GPTQ with and without act-order (a shuffled
g_idx shared by the fused parts, as GPTQ's shared Hessian makes it); a group of two equal to one
rank; torch's CPU packed int4 kernel in bfloat16 on one layer; the Triton kernel in its
interpreter (TRITON_INTERPRET=1) or on CUDA; the refusals.
"""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from common.protocol import SamplingParams
from pagoda.offline import LLM
from tests import families
from tests.triton_env import DEVICE, DTYPES, INTERPRET, tolerance, triton_test
from worker.quantization import UnsupportedQuantization, resolve_quantization

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
         "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}  # parts that share their input (one act-order)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---------------------------------------------------------------------------------- quantize and pack


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool):
    """w [N, K] float32 -> (q [N, K] 0..15, z [G, N] 0..15, s [G, N] fp16), group of input k g_idx[k]."""
    n = w.shape[0]
    s, z = torch.empty(groups, n), torch.empty(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            s[g], z[g] = cols.abs().amax(1) / 7, 8
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[g] = (hi - lo) / 15
            z[g] = torch.round(-lo / s[g].half().float()).clamp(0, 15)
    s = s.half()
    q = torch.round(w / s.float()[g_idx].t()) + z[g_idx].t()
    return q.clamp(0, 15).to(torch.int64), z.to(torch.int64), s


def reference(q, z, s, g_idx) -> torch.Tensor:
    """w[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], in the scales' dtype (as the formats' kernels)."""
    return ((q - z[g_idx].t()).to(s.dtype) * s[g_idx].t()).float()


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing of [rows, N] (input-major): int32 [rows, N / 8]."""
    packed = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int64)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return to_int32(packed)


def gptq_pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """auto-gptq's qweight packing: [K, N] -> int32 [K / 8, N], 8 consecutive inputs a word."""
    packed = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(8):
            packed[row] |= intweight[row * 8 + j] << (4 * j)
    return to_int32(packed)


def gptq_pack_cols(zeros: torch.Tensor) -> torch.Tensor:
    """auto-gptq's qzeros packing: [G, N] -> int32 [G, N / 8]."""
    return gptq_pack_rows(zeros.t().contiguous()).t().contiguous()


# ---------------------------------------------------------------------------------- checkpoints


def write_checkpoint(tiny, directory, quantization_config: dict, convert) -> torch.nn.Module:
    """The tiny Llama's checkpoint with each linear weight replaced by `convert(name, w)`'s
    tensors; returns transformers' model whose linear weights are their reference."""
    source, model = tiny
    ref = copy.deepcopy(model)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    for layer in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            prefix = f"model.layers.{layer}.{linear}"
            tensors, weight = convert(linear, state.pop(f"{prefix}.weight"), layer)
            state.update({f"{prefix}.{name}": t.contiguous() for name, t in tensors.items()})
            ref.get_submodule(prefix).weight.data.copy_(weight)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    shutil.copy(source / "generation_config.json", directory)
    return ref


def awq(tiny, directory):
    def convert(linear, w, layer):
        g_idx = torch.arange(w.shape[1]) // GROUP
        q, z, s = quantize(w, g_idx, w.shape[1] // GROUP, symmetric=False)
        tensors = {"qweight": awq_pack(q.t()), "qzeros": awq_pack(z), "scales": s}
        return tensors, reference(q, z, s, g_idx)

    config = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return write_checkpoint(tiny, directory, config, convert)


def gptq(tiny, directory, act_order: bool):
    orders = {}

    def convert(linear, w, layer):
        k = w.shape[1]
        if act_order:  # auto-gptq's desc_act: inputs quantized in an order, grouped in it
            perm = orders.setdefault((layer, FUSED.get(linear, linear)), torch.randperm(k))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // GROUP
        else:
            g_idx = torch.arange(k) // GROUP
        q, z, s = quantize(w, g_idx, k // GROUP, symmetric=True)
        tensors = {"qweight": gptq_pack_rows(q.t().contiguous()), "qzeros": gptq_pack_cols(z - 1),  # v1: z - 1
                   "scales": s, "g_idx": g_idx.to(torch.int32)}
        return tensors, reference(q, z, s, g_idx)

    torch.manual_seed(1)
    config = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": True,
              "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq"}
    return write_checkpoint(tiny, directory, config, convert)


def pack_quantized(tiny, directory, strategy: str = "group", symmetric: bool = True):
    """A compressed-tensors W4A16 checkpoint, compressed and dequantized by compressed-tensors."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy, "dynamic": False,
            "group_size": GROUP if strategy == "group" else None}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))

    def convert(linear, w, layer):
        k = w.shape[1]
        groups = k // GROUP if strategy == "group" else 1
        q, z, s = quantize(w, torch.arange(k) // (k // groups), groups, symmetric)
        state = {"weight": w, "weight_scale": s.t().to(torch.bfloat16)}
        if not symmetric:
            state["weight_zero_point"] = (z - 8).t().to(torch.int8)
        tensors = dict(PackedQuantizationCompressor.compress(state, scheme))
        weight = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]
        return tensors, weight.float()

    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None}},
              "ignore": ["lm_head"], "version": ct.__version__}
    return write_checkpoint(tiny, directory, config, convert)


# ---------------------------------------------------------------------------------- the engine against the reference

PROMPTS = families.prompts()[:3]
PARAMS = SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, ignore_eos=True)


def generate(directory, **kwargs) -> list[list[int]]:
    llm = LLM(str(directory), device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=8,
              num_gpu_blocks=64, quantization="auto", **kwargs)  # the suite's default is none
    try:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.close()


def expected(ref) -> list[list[int]]:
    with torch.inference_mode():
        return [ref.generate(torch.tensor([ids]), max_new_tokens=families.MAX_TOKENS, do_sample=False,
                             min_new_tokens=families.MAX_TOKENS)[0, len(ids):].tolist() for ids in PROMPTS]


CHECKPOINTS = {
    "awq": awq,
    "gptq": lambda tiny, d: gptq(tiny, d, act_order=False),
    "gptq-act-order": lambda tiny, d: gptq(tiny, d, act_order=True),
    "pack-quantized": pack_quantized,
    "pack-quantized-channel-asymmetric": lambda tiny, d: pack_quantized(tiny, d, "channel", symmetric=False),
}


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory):
    """name -> (directory, the reference's greedy tokens), written once as asked for."""
    made = {}

    def get(name):
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            made[name] = directory, expected(CHECKPOINTS[name](tiny, directory))
        return made[name]
    return get


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_an_int4_checkpoint_generates_what_its_reference_dequantization_does(name, checkpoints):
    directory, tokens = checkpoints(name)
    assert generate(directory) == tokens


def test_a_group_of_two_generates_what_one_rank_does(checkpoints, monkeypatch):
    """act-order GPTQ: column-parallel layers split qweight's N and qzeros' words; row-parallel ones
    split qweight's K and g_idx, every rank keeping every group's scales and zeros."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    directory, tokens = checkpoints("gptq-act-order")
    assert generate(directory, tensor_parallel_size=2) == tokens


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["awq", "gptq-act-order", "pack-quantized"])
def test_an_int4_checkpoint_on_cuda_runs_the_triton_kernel_and_generates_its_references_tokens(name, checkpoints):
    """float32 on CUDA: the Triton kernel dequantizes exactly the reference's weights (its dot in
    IEEE float32); the greedy tokens are the reference's."""
    directory, tokens = checkpoints(name)
    llm = LLM(str(directory), device="cuda", dtype="float32", skip_tokenizer_init=True, block_size=8,
              num_gpu_blocks=64, quantization="auto")
    try:
        layer = llm.executor.runner.model.model.layers[0].mlp.down_proj
        assert layer.triton is not None and not hasattr(layer, "weight")
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == tokens
    finally:
        llm.close()


# ---------------------------------------------------------------------------------- one layer


def _gptq_layer(dtype: torch.dtype, act_order: bool, k: int = 128, n: int = 64):
    """A GPTQ ColumnParallelLinear loaded from its tensors and prepared for `dtype` (on the CPU),
    and its reference weight."""
    from worker.models.layers import ColumnParallelLinear
    from worker.models.weights import InMemoryTensor
    from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group
    from worker.quantization import building
    from worker.quantization.base import process_weights_after_loading

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.1
    g_idx = (torch.randperm(k, generator=gen).argsort() if act_order else torch.arange(k)) // GROUP
    q, z, s = quantize(w, g_idx, k // GROUP, symmetric=True)
    tensors = {"qweight": gptq_pack_rows(q.t().contiguous()), "qzeros": gptq_pack_cols(z - 1), "scales": s,
               "g_idx": g_idx.to(torch.int32)}
    scheme = resolve_quantization("auto", _config({"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                   "desc_act": act_order, "sym": True}), "hf", "cpu")
    saved = get_tp_group()
    set_tp_group(TensorParallelGroup())  # a group of one (an LLM's group may have left its rank 0's here)
    try:
        with building(scheme):
            layer = ColumnParallelLinear(k, n)
    finally:
        set_tp_group(saved)
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, InMemoryTensor(t))
    process_weights_after_loading(layer, dtype)
    return layer, reference(q, z, s, g_idx)


def test_the_cpu_packed_int4_kernel_in_bfloat16_is_the_dequantized_weight():
    for act_order in (False, True):
        layer, weight = _gptq_layer(torch.bfloat16, act_order)
        assert layer.packed is not None and (layer.perm is not None) == act_order
        assert torch.equal(layer.weight, weight.to(torch.bfloat16))
        x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        y = layer(x)  # 5 rows: the packed kernel
        expected_y = x.float() @ weight.to(torch.bfloat16).float().t()
        torch.testing.assert_close(y.float(), expected_y, atol=3e-2, rtol=3e-2)
        assert torch.equal(layer(x.repeat(4, 1))[:5], y)  # 20 rows: the same kernel, the same rows


def test_float32_serves_the_dequantized_weight_and_no_packed_one():
    layer, weight = _gptq_layer(torch.float32, act_order=True)
    assert layer.packed is None and torch.equal(layer.weight, weight)
    assert not hasattr(layer, "qweight")  # the checkpoint's tensors are freed


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, split_k", [(3, 1), (3, 2), (17, None)])
@pytest.mark.parametrize("act_order", [True, False], ids=["act-order", "contiguous-groups"])
def test_the_triton_int4_gemm_is_the_dequantized_weights(dtype, rows, split_k, act_order):
    """Act-order gathers each input's group; contiguous groups (a K block within one) read one row
    of scales and zeros per block."""
    from kernels.triton_int4 import Int4Packed, int4_matmul
    from worker.quantization.int4_checkpoints import Int4Weight

    gen = torch.Generator().manual_seed(0)
    n, k, groups = 48, 128, 4
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.01).half()
    g_idx = (torch.randperm(k, generator=gen) if act_order else torch.arange(k)) // (k // groups)
    weight = Int4Weight(q, zeros, scales, g_idx)
    x = torch.randn(rows, k, generator=gen)
    expected_y = x.to(dtype).float() @ weight.dequantize(dtype).float().t()
    packed = Int4Packed.of(Int4Weight(q.to(DEVICE), zeros.to(DEVICE), scales.to(DEVICE), g_idx.to(DEVICE)))
    assert packed.group_size == (0 if act_order else k // groups)
    block = (16, 32, 64) if DEVICE == "cpu" else None  # contiguous: K blocks of 32, a group's
    y = int4_matmul(x.to(DEVICE, dtype), packed, split_k=split_k, block=block)
    assert y.dtype == dtype and y.shape == (rows, n)
    torch.testing.assert_close(y.float().cpu(), expected_y, **tolerance(dtype))


# ---------------------------------------------------------------------------------- refusals


def _config(qc: dict, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(quantization_config=qc, **extra)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "AWQ checkpoints of 8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "AWQ version 'exllama'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}, "GPTQ checkpoints of 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "asymmetric GPTQ"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "pack-quantized weights of 8 bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     "weight strategy 'tensor'"),
])
def test_unsupported_int4_checkpoints_are_refused_by_name(qc, message):
    with pytest.raises(UnsupportedQuantization, match=message):
        resolve_quantization("auto", _config(qc), "hf", "cpu")


def test_a_quantized_moe_checkpoint_and_another_formats_flag_are_refused():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
    with pytest.raises(UnsupportedQuantization, match="mixture-of-experts models \\(8 experts\\)"):
        resolve_quantization("auto", _config(qc, num_local_experts=8), "hf", "cpu")
    with pytest.raises(UnsupportedQuantization, match="quantized \\(gptq\\): --quantization awq cannot run it"):
        resolve_quantization("awq", _config(qc), "hf", "cpu")
    assert resolve_quantization("gptq", _config(qc), "hf", "cpu").name == "gptq"


def _compile_int4_for_sm90() -> list[str]:
    """The int4 GEMM compiled for sm_90 (Triton's own ptxas) at each tile size `tiles` picks, bf16
    and fp16 activations, contiguous groups of 128 and act-order. Run with TRITON_INTERPRET unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_int4

    fn = triton_int4._int4_gemm
    done = []
    for dtype, group_size in (("bf16", 128), ("fp16", 0)):
        for m in (1, 32, 256):
            block_m, block_n, block_k, warps = triton_int4.tiles(m)
            consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE=group_size, PRECISION="tf32")
            types = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": f"*{dtype}",
                     "g_ptr": "*i32", "out_ptr": "*fp32"}
            sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
            kernel = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": 2})
            assert kernel.metadata.shared <= 227 * 1024
            done.append(f"{dtype} m={m}")
    return done


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernel is compiled for the device itself")
def test_the_int4_gemm_compiles_for_hopper_without_a_gpu():
    from tests.triton_env import count_compiled_for_sm90

    assert count_compiled_for_sm90("tests.test_quant_formats", "_compile_int4_for_sm90") == 6
