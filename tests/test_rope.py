"""worker/models/rope.py's TransformersRope equals each family's own transformers rotary module, bit for
bit, for every RoPE type the loader admits (worker/loader.py ROPE_TYPES) and a partial rotary."""
import pytest
import torch
import transformers
from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from worker.eagle import TransformersRope as eagle_rope
from worker.loader import ROPE_TYPES
from worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from worker.models.layers import RotaryEmbedding
from worker.models.llama import LlamaForCausalLM, Phi3ForCausalLM
from worker.models.moe import MixtralForCausalLM

SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 64}
THETA = {"rope_theta": 10000.0}
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + i / 10 for i in range(8)], "long_factor": [2.0 + i / 5 for i in range(8)]},
}
# (config class, transformers' module, ours)
FAMILIES = {
    "llama": (transformers.LlamaConfig, LlamaRotaryEmbedding, LlamaForCausalLM.rotary_class),
    "phi3": (transformers.Phi3Config, Phi3RotaryEmbedding, Phi3ForCausalLM.rotary_class),
    "mixtral": (transformers.MixtralConfig, MixtralRotaryEmbedding, MixtralForCausalLM.rotary_class),
    "gemma2": (transformers.Gemma2Config, Gemma2RotaryEmbedding, Gemma2ForCausalLM.rotary_class),
}


def caches(rotary_class, config, positions: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(16)
    rotary.init_cache(rotary_class, config, positions, layer_type)
    return rotary.cos_cache, rotary.sin_cache


def assert_same(theirs, ours, config, layer_type=None) -> None:
    # within the original context and past it (dynamic NTK and LongRoPE switch there)
    for positions in (24, 200):
        (cos, sin), (our_cos, our_sin) = caches(theirs, config, positions, layer_type), caches(ours, config, positions, layer_type)
        assert torch.equal(our_cos, cos) and torch.equal(our_sin, sin), (positions, layer_type)


def test_every_rope_type_the_loader_admits_is_covered():
    assert set(SCALINGS) == set(ROPE_TYPES)


PHI3_SCALINGS = ("default", "longrope")  # the only ones Phi3Config admits


@pytest.mark.parametrize("family, scaling", [(f, s) for f in FAMILIES for s in SCALINGS
                                             if f != "phi3" or s in PHI3_SCALINGS])
def test_each_familys_rope_is_transformers(family, scaling):
    config_class, theirs, ours = FAMILIES[family]
    config = config_class(**SHAPE, rope_parameters={**THETA, **SCALINGS[scaling]})
    assert_same(theirs, ours, config)


@pytest.mark.parametrize("scaling", PHI3_SCALINGS)
def test_a_partial_rotary_is_transformers(scaling):
    """Phi-3's default rotates partial_rotary_factor of each head (Phi-4-mini's 0.75); LongRoPE too."""
    params = {**THETA, **SCALINGS[scaling], "partial_rotary_factor": 0.75}
    if scaling == "longrope":
        params.update(short_factor=params["short_factor"][:6], long_factor=params["long_factor"][:6])
    config = transformers.Phi3Config(**SHAPE, rope_parameters=params)
    assert_same(Phi3RotaryEmbedding, Phi3ForCausalLM.rotary_class, config)
    assert caches(Phi3ForCausalLM.rotary_class, config, 8)[0].shape == (8, 12)


@pytest.mark.parametrize("scaling", ["default", "linear", "yarn"])
def test_gemma3s_rope_per_kind_of_layer_is_transformers(scaling):
    """Gemma 3: the local layers' base and the global layers' (scaled) one."""
    config = transformers.Gemma3TextConfig(**SHAPE, num_hidden_layers=2, sliding_window_pattern=2,
                                           rope_parameters={"sliding_attention": {**THETA, "rope_type": "default"},
                                                            "full_attention": {"rope_theta": 1e6, **SCALINGS[scaling]}})
    for layer_type in ("sliding_attention", "full_attention"):
        assert_same(Gemma3RotaryEmbedding, Gemma3ForCausalLM.rotary_class, config, layer_type)


def test_eagle_heads_use_llamas_rope():
    assert eagle_rope is LlamaForCausalLM.rotary_class
