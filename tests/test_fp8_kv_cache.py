"""The FP8 KV cache (`--kv-cache-dtype fp8`): quantized writes, dequantizing reads, byte-exact
block moves, twice the blocks of bfloat16 in the same memory, and a tiny model's greedy output
equal to the full-precision engine whose K and V are rounded through float8 before attention.

The Triton cases run in the interpreter under TRITON_INTERPRET=1 (float32 and float16 queries; the
interpreter converts to and from float8 as CUDA does) and on CUDA as `gpu` tests; the sm_90
compile of the KV_FP8 variants is in tests/test_kernels_triton.py.
"""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels
from common.config import ConfigError, EngineConfig
from common.protocol import SamplingParams
from kernels import reference
from kernels.kv_quant import dequantize, quantize
from tests import families
from tests.test_kernels_reference import _build, _mixed_specs
from tests.triton_env import DEVICE, DTYPES, INTERPRET, tolerance, triton_test

FP8 = torch.float8_e4m3fn
SCALES = (0.05, 0.02)  # k_scale, v_scale: not 1.0, so a path that drops a scale fails


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny tensors and a tiny model: intra-op threads only add overhead."""


def torch_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The quantization the cache must hold, in torch's own words: x / scale saturated to e4m3's
    +-448, then torch's round-to-nearest-even conversion."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_case(*, dtype=torch.float32, group: int = 2, block_size: int = 16, device="cpu"):
    """The reference tests' mixed batch (prefills, a chunk after a cached prefix, decodes; shuffled
    tables, a NaN-poisoned cache), its cache quantized to fp8, and that cache dequantized."""
    case = _build(_mixed_specs(block_size), group=group, head_dim=32, block_size=block_size, dtype=torch.float32)
    k_scale, v_scale = SCALES
    cache = torch.stack([torch_fp8(case.kv_cache[:, 0], k_scale), torch_fp8(case.kv_cache[:, 1], v_scale)], dim=1)
    dequantized = torch.stack([cache[:, 0].float() * k_scale, cache[:, 1].float() * v_scale], dim=1)
    meta = [t.to(device) for t in (case.block_tables, case.seq_lens, case.cu_seqlens_q)]
    return case.query.to(device, dtype), cache.to(device), dequantized.to(device), meta


# ----------------------------------------------------------------------------- write_kv


def _kv(num_tokens: int = 11, kvh: int = 2, hd: int = 16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn((num_tokens, kvh, hd), generator=gen) * 3 for _ in range(2))
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, 0.0])  # saturates both ways, underflows, zero
    slots = torch.tensor([5, -1, 17, 0, 33, 2, -1, 40, 9, 21, 30])[:num_tokens]
    return key.to(dtype), value.to(dtype), slots


def _check_written(cache: torch.Tensor, key, value, slots, block_size: int, scales=SCALES) -> None:
    k_scale, v_scale = scales
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert same_bits(cache[block, 0, offset], torch_fp8(key[token], k_scale))
        assert same_bits(cache[block, 1, offset], torch_fp8(value[token], v_scale))
    untouched = torch.ones(cache.shape[0] * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (cache.view(torch.uint8).transpose(1, 2).flatten(0, 1)[untouched] == 0).all(), "padding was written"


def test_write_kv_into_an_fp8_cache_stores_the_reference_quantization_and_reads_back_dequantized():
    key, value, slots = _kv()
    cache = torch.zeros((6, 2, 8, 2, 16), dtype=FP8)
    kernels.write_kv(key, value, cache, slots, k_scale=SCALES[0], v_scale=SCALES[1], impl="torch")
    _check_written(cache, key, value, slots, 8)
    assert same_bits(quantize(key, SCALES[0]), torch_fp8(key, SCALES[0]))  # kv_quant says the same
    k = cache[5 // 8, 0, 5 % 8]
    assert torch.equal(dequantize(k, SCALES[0]), torch_fp8(key[0], SCALES[0]).float() * SCALES[0])
    assert k[0, :4].float().tolist() == [448.0, -448.0, 0.0, 0.0]  # saturated (not NaN), underflowed, zero


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_kv_into_an_fp8_cache_is_bit_exact_with_the_reference(dtype):
    """On CUDA any values. Triton's interpreter (3.9) rounds a float to float8 wrongly where the
    rounding carries into the next power of two (7.9 -> 4.0, not 8.0; CUDA's cvt does not), so
    there the values are e4m3 values times power-of-two scales (no rounding) and the saturation."""
    key, value, slots = _kv(dtype=dtype)
    scales = SCALES
    if INTERPRET:
        scales = (0.25, 0.5)
        key, value = (torch_fp8(x, 1.0).float().to(dtype) * s for x, s in ((key, scales[0]), (value, scales[1])))
        key[0, 0, :2] = torch.tensor([1e4, -1e4])
    cache = torch.zeros((6, 2, 8, 2, 16), dtype=FP8, device=DEVICE)
    kernels.write_kv(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE), k_scale=scales[0],
                     v_scale=scales[1], impl="triton")
    _check_written(cache.cpu(), key, value, slots, 8, scales)


# ----------------------------------------------------------------------------- attention


def test_paged_attention_over_an_fp8_cache_is_attention_over_the_dequantized_cache():
    """Bit for bit on the torch path: prefills, a chunk after a cached prefix and decodes."""
    query, cache, dequantized, (tables, seq_lens, cu) = fp8_case()
    scale = 32 ** -0.5
    expected = reference.paged_attention(query, dequantized, tables, seq_lens, cu, scale)
    out = kernels.paged_attention(query, cache, tables, seq_lens, cu, scale, k_scale=SCALES[0], v_scale=SCALES[1],
                                  impl="torch")
    assert torch.equal(out, expected)
    for window, softcap in ((24, None), (None, 20.0)):  # the masked path dequantizes too
        expected = reference.paged_attention(query, dequantized, tables, seq_lens, cu, scale, sliding_window=window,
                                             logit_softcap=softcap)
        out = kernels.paged_attention(query, cache, tables, seq_lens, cu, scale, k_scale=SCALES[0],
                                      v_scale=SCALES[1], sliding_window=window, logit_softcap=softcap, impl="torch")
        assert torch.equal(out, expected)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_splits", [None, 3])
def test_triton_paged_attention_over_an_fp8_cache_matches_the_reference(dtype, kv_splits):
    query, cache, dequantized, (tables, seq_lens, cu) = fp8_case(dtype=dtype, device=DEVICE)
    scale = 32 ** -0.5
    out = torch.full_like(query, float("nan"))
    kernels.paged_attention(query, cache, tables, seq_lens, cu, scale, out=out, k_scale=SCALES[0], v_scale=SCALES[1],
                            kv_splits=kv_splits, impl="triton")
    expected = reference.paged_attention(query.float().cpu(), dequantized.cpu(), tables.cpu(), seq_lens.cpu(),
                                         cu.cpu(), scale)
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance(dtype))


# ----------------------------------------------------------------------------- block moves


def _random_fp8_pool(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, 2, 8, 2, 16), generator=gen, dtype=torch.uint8).view(FP8)


def test_swap_out_and_in_and_copy_on_write_of_fp8_blocks_are_bit_exact():
    device = [_random_fp8_pool(9, seed) for seed in range(3)]  # three layers
    host = [_random_fp8_pool(5, 10 + seed) for seed in range(3)]
    before = [c.clone() for c in device]
    swapper = kernels.BlockSwapper(device, host)
    swapper.swap_out([(3, 0), (7, 4), (1, 2)])
    swapper.synchronize()
    for d, h in zip(before, host):
        assert same_bits(h[[0, 4, 2]], d[[3, 7, 1]])
    for d in device:  # the device blocks are overwritten before they come back
        d.view(torch.uint8)[[3, 7, 1]] = 0
    swapper.swap_in([(0, 8), (4, 6), (2, 5)])
    for d, b in zip(device, before):
        assert same_bits(d[[8, 6, 5]], b[[3, 7, 1]])
    kernels.swap_blocks(device, host, [(8, 1)])  # the synchronous path
    assert all(same_bits(h[1], b[3]) for h, b in zip(host, before))
    for impl in ("torch", "triton") if INTERPRET else ("torch",):
        pools = [_random_fp8_pool(9, 20 + seed) for seed in range(3)]
        originals = [p.clone() for p in pools]
        kernels.copy_blocks(pools, [(2, 4), (6, 7)], impl=impl)
        for p, o in zip(pools, originals):
            assert same_bits(p[[4, 7]], o[[2, 6]]) and same_bits(p[[0, 1, 2, 3, 5, 6, 8]], o[[0, 1, 2, 3, 5, 6, 8]])


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama (4 layers, 2 KV heads of 16) whose checkpoint carries fp8 KV scales
    under both of vLLM's names."""
    import transformers

    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**families.BASE)).save_pretrained(directory)
    for file in families.TOKENIZER.iterdir():
        if file.name != "README.md":
            (directory / file.name).write_bytes(file.read_bytes())
    weights = load_file(directory / "model.safetensors")
    for layer in range(4):
        prefix = f"model.layers.{layer}.self_attn"
        k_name, v_name = ((f"{prefix}.k_proj.k_scale", f"{prefix}.v_proj.v_scale") if layer % 2
                          else (f"{prefix}.attn.k_scale", f"{prefix}.attn.v_scale"))
        weights[k_name] = torch.tensor(SCALES[0] * (layer + 1))
        weights[v_name] = torch.tensor(SCALES[1] * (layer + 1))
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_the_pool_holds_twice_the_blocks_of_bfloat16_in_the_same_memory(llama_dir):
    from worker.model_runner import ModelRunner

    counts = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto"), ("float32", "fp8_e4m3")):
        runner = ModelRunner(EngineConfig(model=str(llama_dir), device="cpu", dtype=dtype, kv_cache_dtype=kv,
                                          block_size=8, cpu_kv_cache_gb=1 / 1024, swap_space_gb=1 / 2048))
        assert runner.kv_caches[0].dtype == (torch.float8_e4m3fn if kv != "auto" else getattr(torch, dtype))
        assert runner.swap_caches[0].dtype == runner.kv_caches[0].dtype
        counts[dtype, kv] = runner.kv_bytes_per_block, runner.num_gpu_blocks, runner.num_cpu_blocks
    # 4 layers x K and V x 8 slots x 2 heads x 16 dims: 2,048 elements a block; 1 MiB and 0.5 MiB
    assert counts == {("bfloat16", "auto"): (4096, 256, 128), ("bfloat16", "fp8"): (2048, 512, 256),
                      ("float32", "auto"): (8192, 128, 64), ("float32", "fp8_e4m3"): (2048, 512, 256)}


def _fake_quantize_kv(llm) -> None:
    """The reference engine: each layer's K and V rounded through float8 (its scale, torch's own
    conversion) before its full-precision cache, so attention runs over the dequantized values."""
    for attn in llm.executor.runner.model.attention_layers():
        forward = attn.forward

        def rounded(q, k, v, attn=attn, forward=forward):
            return forward(q, torch_fp8(k, attn.k_scale).float() * attn.k_scale,
                           torch_fp8(v, attn.v_scale).float() * attn.v_scale)

        attn.forward = rounded


def test_greedy_generation_over_an_fp8_cache_equals_the_fake_quantized_reference(llama_dir):
    """Swapping and copy-on-write included (a pool too small for the batch, n=2 samples sharing
    their prompt's blocks); every block is back in the pool at the end."""
    from pagoda.offline import LLM

    prompts = families.prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, n=2)
    outputs = {}
    for kv in ("fp8", "auto"):
        llm = LLM(str(llama_dir), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=24, num_cpu_blocks=64,
                  kv_cache_dtype=kv, preemption_mode="swap")
        layers = llm.executor.runner.model.attention_layers()
        assert [(a.k_scale, a.v_scale) for a in layers] == [
            pytest.approx((SCALES[0] * i, SCALES[1] * i)) for i in range(1, 5)]  # from the checkpoint
        if kv == "auto":
            _fake_quantize_kv(llm)
        else:
            assert layers[0].kv_cache.dtype == torch.float8_e4m3fn
        result = llm.generate(prompts, params, use_tqdm=False)
        s = llm.scheduler
        assert s.num_swap_preemptions > 0, "the small pool should have swapped"
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks, "a block leaked"
        outputs[kv] = [[(o.token_ids, [t[0] for t in o.logprobs]) for o in r.outputs] for r in result]
    assert [[ids for ids, _ in r] for r in outputs["fp8"]] == [[ids for ids, _ in r] for r in outputs["auto"]]
    for mine, theirs in zip(outputs["fp8"], outputs["auto"]):
        for (_, a), (_, b) in zip(mine, theirs):
            assert a == pytest.approx(b, abs=1e-5)


# ----------------------------------------------------------------------------- configuration


def test_a_bad_kv_cache_dtype_is_a_config_error(capsys):
    from pagoda import cli
    from pagoda.commands import EXIT_CONFIG_ERROR

    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, not 'int3'"):
        EngineConfig(kv_cache_dtype="int3")
    assert cli.main(["generate", "--kv-cache-dtype", "int3", "--prompt", "hi", "--device", "cpu"]) == EXIT_CONFIG_ERROR
    assert "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, not 'int3'" in capsys.readouterr().err
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
def test_triton_fp8_attention_on_cuda_matches_the_reference_in_bfloat16():
    """Llama-3-8B's heads (8 KV heads, group 4, head_dim 128) at 64 x 1,024 decodes and a
    mixed batch, every split count the heuristic picks, a bfloat16 query over an fp8 cache."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, ctx, bs = 64, 1024, 16
    blocks = num_seqs * ctx // bs
    cache = (torch.randn((blocks + 1, 2, bs, 8, 128), generator=gen) * 2).to(FP8).cuda()
    tables = (torch.randperm(blocks, generator=gen) + 1).view(num_seqs, -1).int().cuda()
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32).cuda()
    for q_len in (1, 7):
        cu = torch.arange(num_seqs + 1, dtype=torch.int32).cuda() * q_len
        query = torch.randn((num_seqs * q_len, 32, 128), generator=gen).to(torch.bfloat16).cuda()
        out = kernels.paged_attention(query, cache, tables, seq_lens, cu, 128 ** -0.5, k_scale=0.5, v_scale=0.25)
        dequantized = torch.stack([cache[:, 0].float() * 0.5, cache[:, 1].float() * 0.25], dim=1)
        expected = reference.paged_attention(query.float(), dequantized, tables, seq_lens, cu, 128 ** -0.5)
        torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))
    key = torch.randn((5, 8, 128), generator=gen).to(torch.bfloat16).cuda()
    written = torch.zeros((2, 2, bs, 8, 128), dtype=FP8, device="cuda")
    kernels.write_kv(key, key, written, torch.arange(5).cuda(), k_scale=0.5, v_scale=0.25)
    assert same_bits(written[0, 0, :5].cpu(), torch_fp8(key.cpu(), 0.5))
    assert same_bits(written[0, 1, :5].cpu(), torch_fp8(key.cpu(), 0.25))


def test_metrics_name_the_cache_dtype_in_cache_config_info():
    from gateway.metrics import GatewayMetrics
    from tests.test_metrics import MODEL, families, status

    statuses = [status("a", "0", kv_cache_dtype="float8_e4m3fn", kv_bytes_per_block=2048, num_cpu_blocks=256),
                status("b", "1", kv_cache_dtype="bfloat16", kv_bytes_per_block=4096)]
    family = families(GatewayMetrics(MODEL), statuses)["pagoda:cache_config_info"]
    assert {(s.labels["engine"], s.labels["cache_dtype"], s.labels["kv_bytes_per_block"], s.labels["num_cpu_blocks"],
             s.value) for s in family.samples} == {("0", "float8_e4m3fn", "2048", "256", 1.0),
                                                    ("1", "bfloat16", "4096", "0", 1.0)}


def test_a_tensor_parallel_group_of_two_over_an_fp8_cache_generates_what_one_rank_does(llama_dir, monkeypatch):
    """Each rank's pool holds its KV heads in fp8 (with the checkpoint's scales): the group's
    greedy tokens are one rank's."""
    from pagoda.offline import LLM

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts, params = families.prompts()[:4], SamplingParams(temperature=0, max_tokens=10)
    tokens = []
    for size in (1, 2):
        llm = LLM(str(llama_dir), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=64,
                  kv_cache_dtype="fp8", tensor_parallel_size=size)
        try:
            tokens.append([r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.close()
    assert tokens[0] == tokens[1]
