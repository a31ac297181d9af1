"""gpt-oss beyond the family tests (tests/test_models.py runs its tiny model through `pagoda
generate`, preemption, tensor parallelism and the served API; tests/test_kv_groups.py its
capacity): MXFP4 checkpoints, whose experts dequantize as they load (worker/quantization/mxfp4.py),
against transformers' own dequantization and, end to end, against transformers running the
dequantized weights.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.protocol import SamplingParams
from tests import families
from kernels import mxfp4
from worker.quantization.mxfp4 import Mxfp4Tensor, pair_mxfp4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_dequantize_is_transformers_and_inverts_quantize_on_fp4_grids():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=gen, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # values already on a block's FP4 grid come back exactly
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours)), ours)
    # a weight's round trip is within half an FP4 step of its block's scale
    w = torch.randn(4, 64, generator=gen)
    error = (mxfp4.dequantize(*mxfp4.quantize(w)) - w).abs()
    assert error.max() <= w.abs().amax() / 6 * 2 / 2  # the largest step (4 -> 6) over two


def test_bad_blocks_and_unpaired_halves_are_refused():
    with pytest.raises(ValueError, match=r"MXFP4 blocks \[\.\.\., G, 16\] and scales"):
        mxfp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="MXFP4 tensors without their other half"):
        list(pair_mxfp4([("a.experts.down_proj_blocks", Mxfp4Tensor(torch.zeros(1, 1, 1, 16,
                                                                                           dtype=torch.uint8),
                                                                               torch.zeros(1, 1, 1,
                                                                                           dtype=torch.uint8)))]))


def _mxfp4_checkpoint(source, target) -> dict:
    """The tiny gpt-oss at `source` saved at `target` as the released checkpoints are: the experts'
    weights MXFP4 ([E, out, in / 32, 16] blocks and their scales), the rest as it was. Returns the
    dequantized experts' weights in transformers' layout, by name."""
    tensors = load_file(source / "model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name)  # [E, in, out]
        blocks, scales = mxfp4.quantize(weight.transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        dequantized[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2)
    target.mkdir()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return dequantized


def test_an_mxfp4_checkpoint_equals_transformers_on_its_dequantized_weights(tmp_path, capsys, monkeypatch):
    """The checkpoint's experts dequantize as they load (`--quantization auto`, or mxfp4 named):
    greedy tokens equal, logprobs within 1e-4, transformers' model whose experts hold the same
    dequantized values; in a group of 2 too (each rank dequantizes its experts' slices); and with
    the experts kept packed, as on CUDA (here `kernels.fused_moe_mxfp4` runs its reference)."""
    import worker.quantization.mxfp4
    from pagoda import cli
    from pagoda.offline import LLM

    model = families.build("gpt_oss", tmp_path / "full")
    dequantized = _mxfp4_checkpoint(tmp_path / "full", tmp_path / "mxfp4")
    with torch.no_grad():
        for name, value in dequantized.items():
            model.get_parameter(name).copy_(value)
    prompts = families.prompts()[:4]
    reference = families.reference(model, prompts)
    llm = LLM(str(tmp_path / "mxfp4"), device="cpu", dtype="float32", block_size=8, quantization="auto")
    assert llm.engine.executor.runner.scheme.name == "mxfp4"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0),
                           use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == reference.token_ids
    for output, theirs in zip(outputs, reference.logprobs, strict=True):
        assert [t[0] for t in output.logprobs] == pytest.approx(theirs, abs=1e-4)
    monkeypatch.setattr(worker.quantization.mxfp4, "PACKED_DEVICES", ("cuda", "cpu"))
    packed = LLM(str(tmp_path / "mxfp4"), device="cpu", dtype="float32", block_size=8, quantization="auto")
    runner = packed.engine.executor.runner
    assert runner.scheme.packed and runner.model.layers[0].mlp.experts.packed
    outputs = packed.generate(prompts, SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0),
                              use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == reference.token_ids
    monkeypatch.undo()
    # the full-precision checkpoint's tokens differ somewhere: the experts did change
    full = families.reference(families.build("gpt_oss", tmp_path / "again"), prompts)
    assert full.token_ids != reference.token_ids
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompts)
    argv = ["generate", "--model", str(tmp_path / "mxfp4"), "--prompts-file", str(prompts_file), "--json",
            "--temperature", "0", "--max-tokens", str(families.MAX_TOKENS), "--device", "cpu", "--dtype", "float32",
            "--block-size", "8", "--quantization", "mxfp4", "--tensor-parallel-size", "2"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()] == reference.token_ids


def test_mxfp4_is_refused_for_other_families_and_under_another_scheme(tmp_path, capsys):
    from pagoda import cli

    config = json.loads((families.ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w5", "--device", "cpu", "--quantization"]
    assert cli.main([*argv, "auto"]) == 2
    assert "mxfp4 checkpoints of llama models are not supported (of gpt_oss they are)" in capsys.readouterr().err
    assert cli.main([*argv, "fp8"]) == 2
    assert "the checkpoint is quantized (mxfp4): --quantization fp8 cannot run it (use auto or mxfp4" in (
        capsys.readouterr().err)


def _experts(config, rank: int, world_size: int, packed: bool, tensors: dict):
    """GptOssExperts as rank `rank` of `world_size` builds and loads them: packed (an MXFP4
    checkpoint on CUDA) from the blocks and scales, else dequantized from the paired tensors."""
    from types import SimpleNamespace

    from worker.models.gpt_oss import CHECKPOINT, GptOssExperts
    from worker.models.weights import in_memory
    from worker.parallel import get_tp_group, set_tp_group
    from worker.quantization import building
    from worker.quantization.mxfp4 import Mxfp4Config

    saved = get_tp_group()
    set_tp_group(SimpleNamespace(rank=rank, world_size=world_size, is_first=rank == 0))
    try:
        with building(Mxfp4Config(packed=packed)):
            experts = GptOssExperts(config)
        weights = in_memory(tensors.items())
        names = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight", "gate_up_proj_bias": "w13_bias",
                 "down_proj_bias": "w2_bias", "gate_up_proj_blocks": "w13_blocks", "gate_up_proj_scales": "w13_scales",
                 "down_proj_blocks": "w2_blocks", "down_proj_scales": "w2_scales"}
        for name, tensor in (weights if experts.packed else pair_mxfp4(weights)):
            param = getattr(experts, names[name])
            experts.weight_loader(param, tensor, CHECKPOINT)
    finally:
        set_tp_group(saved)
    return experts


def test_packed_mxfp4_experts_shard_over_ranks_as_the_dequantized_ones_do():
    """Where the experts stay MXFP4 (CUDA), each rank loads its de-interleaved gate and up rows and
    its 32-value groups of the down projection's inputs; summed over a group of 2 (the down bias
    from rank 0 alone) the partial outputs are the dequantized experts' of one rank, exactly (the
    same float32 values; off CUDA `kernels.fused_moe_mxfp4` runs the reference)."""
    from transformers import GptOssConfig

    e, hidden, inter = 4, 64, 64
    config = GptOssConfig(num_local_experts=e, hidden_size=hidden, intermediate_size=inter, swiglu_limit=0.5)
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(e, hidden, 2 * inter, generator=gen) * 0.2, torch.randn(e, inter, hidden, generator=gen)
    tensors = {"gate_up_proj_bias": torch.randn(e, 2 * inter, generator=gen) * 0.1,
               "down_proj_bias": torch.randn(e, hidden, generator=gen) * 0.1}
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4.quantize(weight.transpose(1, 2))
    x = torch.randn(6, hidden, generator=gen)
    weights, ids = torch.rand(6, 2, generator=gen), torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(6)])
    whole = _experts(config, 0, 1, False, tensors)
    assert whole.w13_weight.shape == (e, 2 * inter, hidden) and not whole.packed
    expected = whole(x, weights, ids)
    parts = [_experts(config, rank, 2, True, tensors) for rank in (0, 1)]
    assert all(p.packed and p.w13_blocks.shape == (e, inter, hidden // 2) and p.w2_scales.shape == (e, hidden, 1)
               for p in parts)
    for rank, part in enumerate(parts):  # each rank's dequantized blocks are its slice of the whole
        rows = torch.cat([torch.arange(rank * 32, rank * 32 + 32), inter + torch.arange(rank * 32, rank * 32 + 32)])
        assert torch.equal(mxfp4.dequantize(part.w13_blocks, part.w13_scales), whole.w13_weight[:, rows])
        assert torch.equal(mxfp4.dequantize(part.w2_blocks, part.w2_scales),
                           whole.w2_weight[:, :, rank * 32:rank * 32 + 32])
    torch.testing.assert_close(parts[0](x, weights, ids) + parts[1](x, weights, ids), expected, atol=1e-5, rtol=1e-5)
    # a rank's share of 16 inputs is no whole 32-value group (gpt-oss at 4 and 8 ranks): dequantized instead
    config = GptOssConfig(num_local_experts=e, hidden_size=hidden, intermediate_size=32, swiglu_limit=0.5)
    small = {name: t for name, t in tensors.items() if "bias" in name}
    small["gate_up_proj_bias"] = small["gate_up_proj_bias"][:, :64]
    for name, weight in (("gate_up_proj", gate_up[:, :, :64]), ("down_proj", down[:, :32])):
        small[f"{name}_blocks"], small[f"{name}_scales"] = mxfp4.quantize(weight.transpose(1, 2))
    whole = _experts(config, 0, 1, False, small)
    parts = [_experts(config, rank, 2, True, small) for rank in (0, 1)]
    assert not any(p.packed for p in parts) and parts[1].w2_weight.shape == (e, hidden, 16)
    torch.testing.assert_close(parts[0](x, weights, ids) + parts[1](x, weights, ids), whole(x, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_random_weights_in_a_group_of_two_are_the_group_of_ones(tmp_path):
    """`dummy:CONFIG.json` (the benchmarks' models): each rank takes its slices of the weights a
    group of one draws, the experts' from our stacked layout; greedy tokens are the same."""
    from transformers import GptOssConfig

    from pagoda.offline import LLM

    config = GptOssConfig(**{**families.BASE, **families.FAMILIES["gpt_oss"][2]})
    (tmp_path / "gpt-oss.json").write_text(config.to_json_string())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for size in (1, 2):
        llm = LLM(f"dummy:{tmp_path / 'gpt-oss.json'}", device="cpu", dtype="float32", tensor_parallel_size=size)
        outputs.append([list(o.token_ids) for o in llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 6
