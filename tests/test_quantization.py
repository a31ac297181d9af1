"""--quantization: each scheme's greedy tokens equal its own dequantized reference, transformers'
model with the scheme's weights (and, for fp8, its linear inputs rounded through fp8), exactly in
float32; fp8 checkpoints (vLLM's fp8 config, compressed-tensors float-quantized) load as they
are; tensor parallelism keeps the tokens; the CPU packed kernels agree with the dequantized
weights in bfloat16; and `auto` picks the checkpoint's format, int4 for the default GGUF on the CPU.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import families
from common.config import ConfigError, EngineConfig
from common.protocol import SamplingParams
from pagoda import cli
from pagoda.offline import LLM
from worker.quantization import UnsupportedQuantization, resolve_quantization
from worker.quantization import fp8
from worker.quantization.weight_only import (
    Int4LinearMethod, Int8LinearMethod, dequantize_int4, dequantize_int8, int4_group_size, quantize_int4,
    quantize_int8,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return families.prompts()[:4]


def _linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] in PROJECTIONS]


def reference_model(model: nn.Module, scheme: str) -> nn.Module:
    """transformers' model as the scheme computes it: its linear weights dequantized (the logits
    head int8 under int4/int8: the tied embedding with it), fp8's inputs rounded through fp8."""
    ref = copy.deepcopy(model)
    for _, linear in _linears(ref):
        w = linear.weight.data
        if scheme == "int4":
            linear.weight.data = dequantize_int4(*quantize_int4(w, int4_group_size(w.shape[1])), w.dtype)
        elif scheme == "int8":
            linear.weight.data = dequantize_int8(*quantize_int8(w), w.dtype)
        else:
            q, scale = fp8.quantize_weight(w)
            linear.weight.data = q.float() * scale[:, None]
            linear.register_forward_pre_hook(lambda m, args: (fp8.fake_quantize_activations(args[0]),))
    if scheme in ("int4", "int8"):
        head = ref.lm_head.weight
        head.data = dequantize_int8(*quantize_int8(head.data), head.dtype)
    return ref


def greedy(llm: LLM, prompt_ids) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 2's tiny model: tied embeddings (the int8 logits head is the embedding), GeGLU, head_dim 32."""
    directory = tmp_path_factory.mktemp("gemma2")
    return directory, families.build("gemma2", directory)


@pytest.mark.parametrize("scheme", ["int4", "int8", "fp8"])
def test_each_scheme_matches_its_dequantized_reference(scheme, tiny, prompt_ids):
    directory, model = tiny
    llm = LLM(str(directory), device="cpu", dtype="float32", quantization=scheme, skip_tokenizer_init=True,
              block_size=8, num_gpu_blocks=64)
    expected = families.reference(reference_model(model, scheme), prompt_ids, MAX_TOKENS).token_ids
    assert greedy(llm, prompt_ids) == expected
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked


def test_int4_with_tied_embeddings_matches_its_reference(gemma, prompt_ids):
    directory, model = gemma
    llm = LLM(str(directory), device="cpu", dtype="float32", quantization="int4", skip_tokenizer_init=True,
              block_size=8, num_gpu_blocks=64)
    assert greedy(llm, prompt_ids) == families.reference(reference_model(model, "int4"), prompt_ids, MAX_TOKENS).token_ids


@pytest.mark.parametrize("scheme", ["int4", "int8", "fp8"])
def test_a_tensor_parallel_group_of_two_keeps_each_schemes_tokens(scheme, tiny, prompt_ids, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    directory, model = tiny
    group = LLM(str(directory), device="cpu", dtype="float32", quantization=scheme, skip_tokenizer_init=True,
                block_size=8, num_gpu_blocks=64, tensor_parallel_size=2)
    try:
        tokens = greedy(group, prompt_ids)
    finally:
        group.close()
    assert tokens == families.reference(reference_model(model, scheme), prompt_ids, MAX_TOKENS).token_ids


# ------------------------------------------------------------------------------- fp8 checkpoints


def _fp8_checkpoint(model: nn.Module, directory: Path, quantization_config: dict, per_channel: bool,
                    input_scale: float | None) -> None:
    """`model` saved as an fp8 checkpoint: each projection's weight fp8 with its scale (per tensor
    or per channel) and, static, an input scale."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name, linear in _linears(model):
        w = linear.weight.data.float()
        scale = (w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1)) / fp8.FP8_MAX
        state[f"{name}.weight"] = (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        state[f"{name}.weight_scale"] = scale if per_channel else scale.reshape(())
        if input_scale is not None:
            state[f"{name}.input_scale"] = torch.tensor(input_scale)
    save_file(state, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))


def _fp8_checkpoint_reference(model: nn.Module, directory: Path, input_scale: float | None) -> nn.Module:
    """transformers' model with the checkpoint's dequantized weights and inputs rounded as the layer rounds them."""
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    ref = copy.deepcopy(model)
    static = None if input_scale is None else torch.tensor([input_scale])
    for name, linear in _linears(ref):
        scale = state[f"{name}.weight_scale"].float().reshape(-1, 1)
        linear.weight.data = state[f"{name}.weight"].float() * scale
        linear.register_forward_pre_hook(lambda m, args: (fp8.fake_quantize_activations(args[0], static),))
    return ref


FP8_CHECKPOINTS = {
    "vllm fp8, per-tensor, static": ({"quant_method": "fp8", "activation_scheme": "static"}, False, 0.05),
    "vllm fp8, per-tensor, dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, False, None),
    "compressed-tensors float-quantized, per-channel, dynamic": ({
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                  "symmetric": True}}}}, True, None),
}


@pytest.mark.parametrize("kind", FP8_CHECKPOINTS)
def test_an_fp8_checkpoint_loads_as_it_is(kind, tiny, prompt_ids, tmp_path):
    directory, model = tiny
    quantization_config, per_channel, input_scale = FP8_CHECKPOINTS[kind]
    _fp8_checkpoint(model, tmp_path, quantization_config, per_channel, input_scale)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", quantization="auto", skip_tokenizer_init=True, block_size=8,
              num_gpu_blocks=64)
    assert llm.executor.runner.scheme.name == "fp8"  # auto read the checkpoint's format
    reference = _fp8_checkpoint_reference(model, tmp_path, input_scale)
    assert greedy(llm, prompt_ids) == families.reference(reference, prompt_ids, MAX_TOKENS).token_ids


# ------------------------------------------------------------------------------- the CPU kernels


class _Layer(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = None


@pytest.mark.parametrize("method", [Int4LinearMethod(), Int8LinearMethod()], ids=["int4", "int8"])
def test_the_cpu_packed_kernels_agree_with_the_dequantized_weight_in_bfloat16(method):
    torch.manual_seed(0)
    layer = _Layer(torch.randn(96, 128, dtype=torch.bfloat16) * 0.05)
    method.process_weights_after_loading(layer)
    assert layer.packed is not None
    few, many = torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(17, 128, dtype=torch.bfloat16)
    dense = nn.functional.linear(few.float(), layer.weight.float())
    assert torch.allclose(method.apply(layer, few, None).float(), dense, rtol=2e-2, atol=2e-2)
    # the same kernel whatever the rows: a row's output does not depend on what shares its step
    many[5:8] = few
    assert torch.equal(method.apply(layer, many, None)[5:8], method.apply(layer, few, None))
    # no rows (the logits of a step where no sequence samples: a prompt chunk before its last)
    assert method.apply(layer, few[:0], None).shape == (0, 96)


def test_a_prompt_in_chunks_under_int4_gives_the_tokens_of_one_chunk():
    """The default model as served on the CPU (int4): a prompt of 150 tokens in chunks of 64, the
    first two sampling nothing, gives the tokens the whole prompt in one step gives. The README's
    question gets the same right answer computed and read from the prefix cache (its last token
    then computed alone): with a bfloat16 cut-over to the dense weight past 16 rows, and bfloat16
    logits, where "The" and "L" tied, the cached answer was "L'Étoile, la Marseillaise". Three
    questions give the same tokens alone, in one batch, and in chunks of 32 tokens."""
    from common.protocol import SamplingParams
    from pagoda.offline import LLM

    llm = LLM("default", device="cpu", quantization="int4")
    prompt = [{"prompt_token_ids": list(range(100, 250))}]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    whole = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    llm.reset(max_num_batched_tokens=64)
    assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == whole
    llm.reset()
    question = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    answers = [llm.generate(question, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
               for _ in range(2)]
    assert [a.outputs[0].text for a in answers] == ["The capital of France is Paris."] * 2
    assert answers[0].num_cached_tokens == 0 and answers[1].num_cached_tokens > 0
    # the same tokens alone, in one batch, and in chunks of 32 (France's then crosses a chunk: with
    # its prompt's attention in bfloat16 and its chunk's in float32 it answered "L'Étoile")
    questions = [question] + [{"messages": [{"role": "user", "content": q}]} for q in
                              ("Who wrote Hamlet?", "How many legs does a spider have?")]
    llm.reset(enable_prefix_caching=False)
    alone = [llm.generate(q, greedy, use_tqdm=False)[0].outputs[0].token_ids for q in questions]
    assert [o.outputs[0].token_ids for o in llm.generate(questions, greedy, use_tqdm=False)] == alone
    llm.reset(enable_prefix_caching=False, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in llm.generate(questions, greedy, use_tqdm=False)] == alone


def _int8_head(vocab: int = 512, hidden: int = 64):
    from worker.quantization.weight_only import Int8LogitsMethod

    torch.manual_seed(0)
    method = Int8LogitsMethod()
    layer = _Layer(torch.randn(vocab, hidden, dtype=torch.bfloat16))
    method.process_weights_after_loading(layer)
    return method, layer


def test_the_int8_logits_head_computes_every_logit_in_float32_whatever_the_batch():
    """On the CPU the C++ kernel gives every logit as the float32 product of the int8 weights and
    scales (torch's int8 kernel rounds them to bfloat16), the same bits for a row alone or in any
    batch; a hidden size that is not a whole number of vectors (72) is padded."""
    from kernels import cpu_ops

    assert cpu_ops.available()
    for hidden in (64, 72):
        method, layer = _int8_head(509, hidden)
        q, scales = layer.packed
        x = torch.randn(40, hidden, dtype=torch.bfloat16)
        bias = torch.randn(509, dtype=torch.bfloat16)
        for b in (None, bias, torch.randn(509)):  # a float32 bias is added unrounded
            logits = method.apply(layer, x, b)
            exact = (x.double() @ q.double().t()) * scales.double() + (0 if b is None else b.double())
            assert logits.dtype == torch.float32 and logits.shape == (40, 509)
            assert torch.allclose(logits.double(), exact, rtol=1e-6, atol=1e-4)
            assert torch.equal(logits.argmax(-1), exact.argmax(-1))
            for rows in (slice(0, 1), slice(3, 4), slice(5, 12), slice(39, 40)):
                assert torch.equal(method.apply(layer, x[rows], b), logits[rows])
        if hidden == 64:  # (torch's int8 kernel takes no hidden size of 72)
            rounded = torch._weight_int8pack_mm(x, q, scales).float()
            assert not torch.equal(method.apply(layer, x, None), rounded)  # bfloat16's steps are gone


def test_the_cpu_int4_kernel_is_the_dequantized_weight_whatever_the_batch():
    """Where the CPU has AVX512_BF16 the int4 layers run the C++ kernel: its products are those of
    the dequantized weight to within a bfloat16 step (float32 sums of the unrounded (q - 8) * scale +
    zero, the output rounded to bfloat16 once), and a row gives the
    same bits alone or in any batch (tiles of 4 rows and the 1-3 left over). Groups of 32 and of a
    whole row of 40; one block of 16 outputs and several."""
    from kernels import cpu_ops

    if not (cpu_ops.available() and torch.ops.pagoda_cpu.int4_supported()):
        pytest.skip("the C++ int4 kernel needs AVX512_BF16 (torch's kernel serves here)")
    torch.manual_seed(0)
    for n, k in ((16, 64), (96, 128), (48, 40)):
        layer = _Layer(torch.randn(n, k, dtype=torch.bfloat16) * 0.05)
        method = Int4LinearMethod()
        method.process_weights_after_loading(layer)
        assert layer.packed.kernel == "pagoda" and layer.group_size == (32 if k % 32 == 0 else k)
        x = torch.randn(23, k, dtype=torch.bfloat16)
        y = method.apply(layer, x, None)
        exact = x.double() @ layer.weight.double().t()
        assert y.dtype == torch.bfloat16 and y.shape == (23, n)
        assert torch.allclose(y.double(), exact, rtol=2 ** -7, atol=4e-3)
        for rows in (slice(0, 1), slice(1, 3), slice(4, 7), slice(2, 10), slice(22, 23)):
            assert torch.equal(method.apply(layer, x[rows], None), y[rows])


def test_without_the_cpu_kernels_the_int8_logits_head_recomputes_each_rows_best_logits_in_float32():
    """torch's kernel's logits are bfloat16; the REFINED_LOGITS best of each row by them become
    the float32 products of the same int8 weights and scales, so tokens that tie in bfloat16 are
    told apart (greedy took the lower id); the others stay as the kernel gave them."""
    from worker.quantization.weight_only import REFINED_LOGITS

    method, layer = _int8_head()
    q, scales = layer.packed
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    bias = torch.randn(512, dtype=torch.bfloat16)
    for b in (None, bias):
        logits = method.refined(layer, x, b)
        exact = (x.float() @ q.float().t()) * scales.float() + (0 if b is None else b.float())
        rounded = torch._weight_int8pack_mm(x, q, scales)
        rounded = (rounded if b is None else rounded + b).float()
        assert logits.dtype == torch.float32
        refined = rounded.topk(REFINED_LOGITS, dim=-1).indices
        assert torch.allclose(logits.gather(1, refined), exact.gather(1, refined), rtol=1e-6, atol=1e-5)
        assert not torch.equal(logits.gather(1, refined), rounded.gather(1, refined))  # bfloat16's steps are gone
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))
        rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, refined, False)
        assert torch.equal(logits[rest], rounded[rest])


def test_a_shape_the_cpu_int4_kernel_does_not_take_serves_the_dequantized_weight():
    """Both packed kernels want N a multiple of 16; torch's a group of 32-256, the C++ one a group
    of a multiple of 8 columns: 24 outputs, or 44 inputs (one group of the whole row), keep no
    packed weight and run the dense one at every step."""
    torch.manual_seed(0)
    for shape in ((24, 64), (32, 44)):
        layer = _Layer(torch.randn(*shape, dtype=torch.bfloat16))
        Int4LinearMethod().process_weights_after_loading(layer)
        assert layer.packed is None
        x = torch.randn(2, shape[1], dtype=torch.bfloat16)
        assert torch.equal(Int4LinearMethod().apply(layer, x, None), nn.functional.linear(x, layer.weight))


def test_int4_requantizes_a_q4_1_block_to_itself():
    """A GGUF Q4_1 block (m + d * q, q spanning 0..15), dequantized by the conversion, is served
    with its own q, d and m: the re-quantized weight equals it exactly."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (8, 64), generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15  # each block spans the range, as llama.cpp's quantizer makes it
    d = torch.rand(8, 2, generator=gen).repeat_interleave(32, 1) / 16
    m = -torch.rand(8, 2, generator=gen).repeat_interleave(32, 1)
    w = (m + d * q).float()
    assert torch.allclose(dequantize_int4(*quantize_int4(w, 32), torch.float32), w, atol=1e-6)


# ------------------------------------------------------------------------------- choosing a scheme


def test_auto_is_the_checkpoints_format_and_int4_for_the_default_gguf_on_the_cpu():
    plain = type("Config", (), {})()
    assert resolve_quantization("auto", plain, "gguf", "cpu").name == "int4"
    assert resolve_quantization("auto", plain, "gguf", "cpu", gguf_bits=8).name == "int8"  # a Q8_0 GGUF
    assert resolve_quantization("auto", plain, "gguf", "cpu", gguf_bits=None) is None  # an F16 one
    assert resolve_quantization("auto", plain, "gguf", "cuda") is None
    assert resolve_quantization("auto", plain, "hf", "cpu") is None
    assert resolve_quantization("none", plain, "gguf", "cpu") is None
    assert resolve_quantization("int8", plain, "hf", "cpu").name == "int8"
    fp8_config = type("Config", (), {"quantization_config": {"quant_method": "fp8"}})()
    assert resolve_quantization("auto", fp8_config, "hf", "cuda").describe().startswith("fp8 W8A8 (fp8 checkpoint")
    with pytest.raises(UnsupportedQuantization, match=r"the checkpoint is quantized \(fp8\): --quantization none"):
        resolve_quantization("none", fp8_config, "hf", "cpu")
    with pytest.raises(UnsupportedQuantization, match="names a checkpoint format, and this checkpoint is not quantized"):
        resolve_quantization("gptq", plain, "hf", "cpu")


def test_a_bad_quantization_is_refused_by_name(tiny, capsys):
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(tiny[0]), "--prompt", "w5", "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_greedy_agreement_with_full_precision_is_what_was_measured(tiny):
    """Each scheme against the unquantized model on the tiny Llama (8 prompts, 16 tokens, EOS
    ignored): prompts whose outputs are identical and the mean share of tokens before the first
    difference, as measured when the schemes landed (deterministic in float32; docs/quantization.md
    gives the default model's, from `pagoda bench quality`)."""
    prompts = [{"prompt_token_ids": ids} for ids in families.prompts()]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for scheme in ("none", "int4", "int8", "fp8"):
        llm = LLM(str(tiny[0]), device="cpu", dtype="float32", quantization=scheme, skip_tokenizer_init=True,
                  block_size=8, num_gpu_blocks=64)
        outputs[scheme] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    def agreement(scheme: str) -> tuple[int, float]:
        pairs = list(zip(outputs[scheme], outputs["none"]))
        prefix = [next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), 16) / 16 for mine, theirs in pairs]
        return sum(mine == theirs for mine, theirs in pairs), sum(prefix) / len(prefix)

    assert {scheme: agreement(scheme) for scheme in ("int4", "int8", "fp8")} == {
        "int4": (3, 0.625), "int8": (5, 0.7265625), "fp8": (5, 0.8203125)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability >= 8.9 (torch._scaled_mm in fp8)")
def test_the_fp8_gemm_on_a_gpu_is_its_emulation():
    """torch._scaled_mm with row-wise scales against the emulated arithmetic (quantize,
    dequantize, matmul in float32), Llama-3.1-8B's q/k/v shape at batch 1, 16 and 256."""
    torch.manual_seed(0)
    layer = _Layer(torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02)
    layer.input_size, layer.output_size, layer.model_dtype = 4096, 6144, torch.bfloat16
    layer.input_scale = None  # dynamic activation scales, as create_weights sets for a full-precision checkpoint
    method = fp8.Fp8LinearMethod()
    method.process_weights_after_loading(layer)
    assert layer.use_scaled_mm
    for rows in (1, 16, 256):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        q, scale = fp8.quantize_activations(x)
        emulated = (q.float() * scale) @ (layer.qweight.float() * layer.weight_scale[:, None]).T
        torch.testing.assert_close(method.apply(layer, x, None).float(), emulated, atol=2e-2, rtol=2e-2)
