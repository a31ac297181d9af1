"""cos and sin of positions exactly as transformers' rotary modules compute them, without their
modeling files.

Every family's `<Family>RotaryEmbedding` in transformers (Llama, Mixtral, Gemma 2, Phi-3, and Gemma 3's,
one set of frequencies per kind of layer) is the same module: inverse frequencies from
`ROPE_INIT_FUNCTIONS[rope_type]` (the family's own formula for "default"), updated in the forward
by `dynamic_rope_update` (dynamic NTK, LongRoPE's short and long factors), then the cos and sin of
position x frequency times the attention scaling. Importing a family's modeling file costs a worker
3-4 s of its start (transformers.modeling_utils imports torch._dynamo and torch.distributed.tensor);
`modeling_rope_utils`, where every scaling formula lives, does not. tests/test_rope.py holds each
`TransformersRope` equal, bit for bit, to the family's own class.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


class TransformersRope(nn.Module):
    """One family's transformers rotary module. `partial_default`: the family's "default" RoPE
    rotates `partial_rotary_factor` of each head (Phi-3's does; Llama's, Mixtral's and Gemma's
    rotate it whole). `per_layer_type`: frequencies per kind of layer (`config.layer_types`,
    Gemma 3's), the forward taking the layer type."""

    def __init__(self, config, partial_default: bool = False, per_layer_type: bool = False) -> None:
        super().__init__()
        # the attribute names are those dynamic_rope_update reads and writes
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.partial_default = partial_default
        if not per_layer_type:
            self.rope_type = config.rope_parameters["rope_type"]
            inv_freq, self.attention_scaling = self._init_fn(self.rope_type)(config)
            self.inv_freq = nn.Buffer(inv_freq, persistent=False)
            self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
            return
        self.rope_type = {}
        for layer_type in sorted(set(config.layer_types)):
            params = config.rope_parameters[layer_type]
            if params is None:
                continue
            self.rope_type[layer_type] = params["rope_type"]
            inv_freq, scaling = self._init_fn(params["rope_type"])(config, None, layer_type=layer_type)
            setattr(self, f"{layer_type}_inv_freq", nn.Buffer(inv_freq, persistent=False))
            setattr(self, f"{layer_type}_original_inv_freq", nn.Buffer(inv_freq.clone(), persistent=False))
            setattr(self, f"{layer_type}_attention_scaling", scaling)

    def _init_fn(self, rope_type: str):
        return self._default_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]

    def _default_parameters(self, config, device=None, layer_type: str | None = None,
                            **kwargs) -> tuple[torch.Tensor, float]:
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0)) if self.partial_default else head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq, scaling = getattr(self, f"{prefix}inv_freq"), getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)
