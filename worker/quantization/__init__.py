"""Quantization schemes of the linear layers: which one a model runs, from `--quantization` and
the checkpoint's `quantization_config`.

    none        full precision (the parity guard: token for token with transformers)
    fp8         FP8 W8A8, quantized as the checkpoint loads (worker/quantization/fp8.py)
    int4, int8  weight-only, quantized as the checkpoint loads (worker/quantization/weight_only.py)
    auto        the checkpoint's own format when it has one (fp8, compressed-tensors
                float-quantized; the int4 AWQ, GPTQ and compressed-tensors pack-quantized of
                worker/quantization/int4_checkpoints.py; gpt-oss's MXFP4 experts, dequantized
                as they load: worker/quantization/mxfp4.py); the default model's GGUF on the CPU:
                int4, its own width (the GGUF is Q4_1); anything else: none

A checkpoint's format is read from its config (`quantization_config.quant_method`) through
`CHECKPOINT_FORMATS`; `--quantization` may name it, or `auto`; any other value is refused by name.
"""
from __future__ import annotations

from collections.abc import Callable

from worker.quantization.base import (
    LinearMethod, QuantizationConfig, UnquantizedLinearMethod, UnsupportedQuantization, building, cast_model,
    current_config, frozen, keep_dtype, linear_method_for, process_weights_after_loading, to_empty,
)
from worker.quantization.fp8 import Fp8Config
from worker.quantization.int4_checkpoints import awq_checkpoint, gptq_checkpoint, pack_quantized_checkpoint
from worker.quantization.mxfp4 import Mxfp4Config, mxfp4_checkpoint
from worker.quantization.weight_only import WeightOnlyConfig

__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "building", "cast_model",
           "current_config", "frozen", "keep_dtype", "linear_method_for", "process_weights_after_loading", "to_empty",
           "resolve_quantization", "checkpoint_quantization", "CHECKPOINT_FORMATS", "ON_THE_FLY",
           "PACKED_FORMATS", "UnsupportedQuantization"]


def _fp8_checkpoint(qc: dict) -> QuantizationConfig:
    if qc.get("weight_block_size"):
        raise UnsupportedQuantization(f"block-wise fp8 checkpoints (weight_block_size {qc['weight_block_size']}) "
                                      "are not supported: per-tensor and per-channel scales are")
    _check_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    return Fp8Config(serialized=True, static=qc.get("activation_scheme", "dynamic") == "static",
                     source="the checkpoint's fp8 quantization_config")


def _compressed_tensors_checkpoint(qc: dict) -> QuantizationConfig:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                                      "supported (one group targeting Linear is)")
    _check_ignored(qc.get("ignore") or [])
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if fmt == "float-quantized" and weights.get("type") == "float" and weights.get("num_bits") == 8:
        if weights.get("strategy") not in ("tensor", "channel"):
            raise UnsupportedQuantization(f"compressed-tensors fp8 weight strategy {weights.get('strategy')!r} is "
                                          "not supported (tensor and channel are)")
        static = bool(inputs) and not inputs.get("dynamic", True)
        return Fp8Config(serialized=True, static=static, source="a compressed-tensors float-quantized checkpoint")
    if fmt in PACKED_FORMATS:
        return PACKED_FORMATS[fmt](qc, groups[0])
    raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} is not supported "
                                  f"(float-quantized{''.join(', ' + f for f in PACKED_FORMATS)} are)")


def _check_ignored(ignored: list[str]) -> None:
    """Layers a checkpoint leaves unquantized: the logits head (always full precision here)."""
    others = [name for name in ignored if name.split(".")[-1] != "lm_head"]
    if others:
        raise UnsupportedQuantization(f"quantized checkpoints leaving layers other than lm_head unquantized "
                                      f"({others[:3]}) are not supported")


# quant_method -> its QuantizationConfig, from the checkpoint's quantization_config dict
CHECKPOINT_FORMATS: dict[str, Callable[[dict], QuantizationConfig]] = {
    "fp8": _fp8_checkpoint,
    "compressed-tensors": _compressed_tensors_checkpoint,
    "awq": awq_checkpoint,  # int4 (worker/quantization/int4_checkpoints.py)
    "gptq": gptq_checkpoint,
    "mxfp4": mxfp4_checkpoint,  # gpt-oss's experts, dequantized as they load (worker/quantization/mxfp4.py)
}
MXFP4_MODEL_TYPES = ("gpt_oss",)  # the families whose MXFP4 checkpoints load (their experts' tensors)
# compressed-tensors formats beyond float-quantized: format -> builder(quantization_config, its group)
PACKED_FORMATS: dict[str, Callable[[dict, dict], QuantizationConfig]] = {
    "pack-quantized": pack_quantized_checkpoint,  # W4A16
}
ON_THE_FLY = {"fp8": Fp8Config, "int4": lambda: WeightOnlyConfig("int4"), "int8": lambda: WeightOnlyConfig("int8")}


def gguf_weight_bits(path) -> int | None:
    """4 or 8 when most of a GGUF file's 2-D weights are 4-bit (Q4_*, Q5_*, IQ4_*, Q4_K...) or 8-bit
    (Q8_*, Q6_K) quantized; None for a full-precision one (F32, F16, BF16)."""
    import collections

    import gguf

    widths = collections.Counter()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) == 2 and tensor.name.startswith("blk."):
            name = tensor.tensor_type.name
            widths[4 if name.startswith(("Q4", "Q5", "IQ4", "Q3", "Q2", "IQ3", "IQ2")) else
                   8 if name.startswith(("Q8", "Q6")) else None] += 1
    return widths.most_common(1)[0][0] if widths else None


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's quantization_config as a dict (None: full precision, or a GGUF's, which
    the conversion dequantizes)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return None if str(qc.get("quant_method")) == "gguf" else qc


def resolve_quantization(flag: str, hf_config, source_kind: str, device_type: str,
                         gguf_bits: int | None = 4) -> QuantizationConfig | None:
    """The scheme a model runs (None: full precision), or a clear error. `gguf_bits`: the width
    of a GGUF's linear weights (`gguf_weight_bits`), what `auto` keeps on the CPU."""
    qc = checkpoint_quantization(hf_config)
    if qc is not None:
        method = str(qc.get("quant_method"))
        if flag not in ("auto", method):
            raise UnsupportedQuantization(
                f"the checkpoint is quantized ({method}): --quantization {flag} cannot run it "
                f"(use auto or {method}; for full precision serve the unquantized checkpoint)")
        if method not in CHECKPOINT_FORMATS:
            raise UnsupportedQuantization(f"quantized checkpoints ({method}) are not supported (formats: "
                                          f"{', '.join(CHECKPOINT_FORMATS)})")
        if method == "mxfp4" and getattr(hf_config, "model_type", None) not in MXFP4_MODEL_TYPES:
            raise UnsupportedQuantization(f"mxfp4 checkpoints of {getattr(hf_config, 'model_type', None)} models are "
                                          f"not supported (of {', '.join(MXFP4_MODEL_TYPES)} they are)")
        scheme = CHECKPOINT_FORMATS[method](qc)
        if isinstance(scheme, Mxfp4Config):  # (random weights are drawn in full precision: never packed)
            scheme = scheme.for_device(device_type if source_kind != "dummy" else "cpu")
        experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
        if experts and not getattr(scheme, "supports_moe", True):
            raise UnsupportedQuantization(f"{method} checkpoints of mixture-of-experts models ({experts} experts) are "
                                          "not supported: their experts are not linear layers here")
        return scheme
    if flag == "auto":
        if source_kind == "gguf" and device_type == "cpu" and gguf_bits in (4, 8):
            return WeightOnlyConfig(f"int{gguf_bits}")
        return None
    if flag == "none":
        return None
    if flag in ON_THE_FLY:
        return ON_THE_FLY[flag]()
    raise UnsupportedQuantization(f"--quantization {flag} names a checkpoint format, and this checkpoint is not "
                                  f"quantized: quantize it as it loads with one of {', '.join(ON_THE_FLY)}")
