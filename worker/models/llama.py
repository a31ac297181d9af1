"""The Llama decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Phi-3), which the other families extend.

A family is this decoder with a few parts swapped (worker/models/__init__.py lists them): the
attention (Qwen3 and Gemma 3 norm q and k per head), the MLP (the MoE families route to experts),
the norms and the layer's shape (Gemma), the rotary module, the names in the checkpoint. The
module tree mirrors transformers' (`model.layers.N.self_attn...`, `lm_head`), so checkpoint names
map to parameters one to one, except the projections fused here: q/k/v into `qkv_proj` and
gate/up into `gate_up_proj` (`STACKED_PARAMS`; Phi-3's checkpoint holds them fused already).

Layers pass the residual stream beside the hidden states, as vLLM's do:

    h, residual = norm(h, residual)   # residual += h; h = norm(residual)
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import torch
from torch import nn

from worker.models.layers import (
    Attention, LogitsHead, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding,
    RowParallelLinear, ScoreHead, VocabParallelEmbedding, act_and_mul, compute_logits, default_weight_loader,
)
from worker.quantization import current_config as current_quantization
from worker.models.rope import TransformersRope
from worker.models.weights import CheckpointTensor
from worker.parallel import get_tp_group

def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The window of layer `layer_idx`: where the config lists `layer_types` (Qwen2/3, Gemma), the
    window of its "sliding_attention" layers; elsewhere (Mistral, Mixtral, Phi-3, Qwen3-MoE) every
    layer's, when `sliding_window` is set (as transformers' modeling of each does)."""
    window = getattr(config, "sliding_window", None) or None
    if window is not None and window >= getattr(config, "max_position_embeddings", window + 1):
        return None  # a window as long as the context (Phi-3.5, Phi-4-mini: 262144) masks nothing
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        shard = self.qkv_proj.shard
        self.attn = Attention(shard.num_heads, shard.num_kv_heads, head_dim, self.scale(config),
                              layer_sliding_window(config, layer_idx), self.logit_softcap(config))

    def scale(self, config) -> float:
        return self.head_dim**-0.5

    def logit_softcap(self, config) -> float | None:
        return None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3 and Gemma 3 norm each head of q and k here; Llama does not."""
        return q, k

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.attn.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.attn.num_kv_heads, self.head_dim)
        v = v.view(-1, self.attn.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        rotary(positions, q, k)  # in place
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results)
        self.act_and_mul = act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    rope_key = "default"  # which of the model's rotary modules this layer's attention uses

    def __init__(self, config, layer_idx: int, self_attn: nn.Module, mlp: nn.Module, norm=RMSNorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, rotary)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embeddings, the layers and the final norm; one rotary module per kind of layer."""

    def __init__(self, config, layers: Iterable[nn.Module], norm=RMSNorm, embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = embed_scale  # Gemma: the embeddings times sqrt(hidden_size)
        head_dim = head_dim_of(config)
        self.rotary_embs = nn.ModuleDict({key: RotaryEmbedding(head_dim)
                                          for key in dict.fromkeys(layer.rope_key for layer in self.layers)})
        # a model that takes images: its prompts hold placeholder ids past the vocabulary
        # (common/multimodal.py), never embedded, and a draft may propose one
        self.max_token_id: int | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`images`: (rows, embeddings) that replace those rows' token embeddings (an image's encoder output)."""
        if self.max_token_id is not None:
            input_ids = input_ids.clamp(max=self.max_token_id)
        h, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:  # a host scalar (capturable), rounded to the dtype as transformers' is
            h = h * _rounded(self.embed_scale, h.dtype)
        if images is not None:
            rows, embeddings = images[0], images[1].to(h.dtype)
            hidden = h.shape[-1]
            h = h.index_copy(0, rows, embeddings[:, :hidden])
            if embeddings.shape[-1] > hidden:  # deepstack (Qwen3-VL): a part added after each early layer
                return self._forward_deepstack(positions, h, rows, embeddings[:, hidden:].split(hidden, dim=-1))
        for layer in self.layers:
            h, residual = layer(positions, h, residual, self.rotary_embs[layer.rope_key])
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def _forward_deepstack(self, positions: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                           deepstack: tuple[torch.Tensor, ...]) -> torch.Tensor:
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, self.rotary_embs[layer.rope_key])
            if i < len(deepstack):  # (the layer's output is h + residual: adding to h adds to it)
                h = h.index_add(0, rows, deepstack[i])
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


def _expected_shards(owner: nn.Module, param: torch.Tensor) -> set:
    """The parts a checkpoint must fill of a fused parameter ({None}: the tensor whole)."""
    return owner.shard_ids(param) if hasattr(owner, "shard_ids") else {None}


@functools.lru_cache(maxsize=16)
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class CausalLM(nn.Module):
    """A decoder-only model as the runner uses it: `forward(input_ids, positions)` -> hidden
    states, `compute_logits`, `attention_layers()`, `init_rope_cache`, `load_weights`.

    Subclasses set `rotary_class` (the family's transformers rotary module: worker/models/rope.py) and build
    `self.model` in `build_model`."""

    rotary_class = TransformersRope
    # (fused parameter part, checkpoint part, shard id): checkpoint tensors that fill a part of one
    # of our fused parameters
    STACKED_PARAMS = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    SKIPPED = ("rotary_emb.inv_freq",)  # checkpoint tensors that are not weights
    RENAMES: tuple[tuple[str, str], ...] = ()  # (checkpoint's, ours): the first that starts a name, or sits in it

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()
        self.model = self.build_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # vocabulary-parallel like the embedding (tied: the embedding's shard is the head's)
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None) or None
        scheme = current_quantization()
        self.logits_method = scheme.logits_method() if scheme is not None else None
        self.logits_head: LogitsHead | None = None  # made once loaded (`process_weights_after_loading`)
        self.vision: nn.Module | None = None  # a vision encoder (worker/models/vision.py), where the model takes images

    def build_model(self, config) -> DecoderModel:
        raise NotImplementedError

    def classifier_head(self, config, num_labels: int) -> nn.Module:
        """A pooling model's classifier (worker/models/pooling.py): transformers' `score` of a
        `*ForSequenceClassification` decoder, over the last token."""
        return ScoreHead(config.hidden_size, num_labels, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def attention_layers(self) -> list[Attention]:
        """Every layer's paged attention, in layer order (each owns its KV cache)."""
        return [module for module in self.modules() if isinstance(module, Attention)]

    def sliding_window(self) -> int | None:
        """W when every layer attends only to its last W keys (the scheduler may then free the
        blocks outside the window); None when any layer is global."""
        windows = {attn.sliding_window for attn in self.attention_layers()}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @torch.no_grad()
    def init_rope_cache(self, max_positions: int) -> None:
        """cos and sin of every position for each kind of layer, in float32 (call before casting)."""
        for key, rotary in self.model.rotary_embs.items():
            rotary.init_cache(self.rotary_class, self.config, max_positions, None if key == "default" else key)

    @property
    def max_positions(self) -> int:
        return next(iter(self.model.rotary_embs.values())).cos_cache.shape[0]

    @property
    def cos_cache(self) -> torch.Tensor:  # the first rotary module's (the benchmarks' stand-in rope)
        return next(iter(self.model.rotary_embs.values())).cos_cache

    @property
    def sin_cache(self) -> torch.Tensor:
        return next(iter(self.model.rotary_embs.values())).sin_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden_size].
        `images`: rows whose embeddings an image's encoder output replaces (worker/multimodal.py)."""
        if images is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, images)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, vocab_size] float32 logits; in a group, on rank 0 (None on the others)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = compute_logits(self.tp, hidden, head.weight, self.config.vocab_size, self.logits_head)
        if logits is not None and self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ weights
    def rename(self, name: str) -> str:
        """A checkpoint's name in our module tree (where a family's checkpoints name a module
        otherwise: Mixtral's block_sparse_moe, a multimodal checkpoint's language_model)."""
        for theirs, ours in self.RENAMES:
            if theirs in name:
                return name.replace(theirs, ours, 1)
        return name

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        """(our parameter's name, shard id) of a checkpoint tensor: the stacked projections fill a
        part of a fused parameter (shard id: which); every other tensor is its parameter whole."""
        for ours, theirs, shard in self.STACKED_PARAMS:
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}."), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy this rank's part of each checkpoint tensor into its parameter; every parameter
        must be set."""
        params = dict(self.named_parameters())
        owners = {f"{prefix}.{name}" if prefix else name: module for prefix, module in self.named_modules()
                  for name, _ in module.named_parameters(recurse=False)}
        loaded: dict[str, set] = {}  # parameter -> the parts filled (None: whole)
        for name, tensor in weights:
            name = self.rename(name)
            if any(skip in name for skip in self.SKIPPED) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if self.load_kv_scale(name, tensor):
                continue
            name, shard_id = self.map_checkpoint_name(name)
            if name not in params:
                raise ValueError(f"the checkpoint's {name} is no weight of {type(self).__name__}")
            param = params[name]  # a quantized format's scales have loaders of their own
            loader = getattr(param, "weight_loader", None) or getattr(owners[name], "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            loaded.setdefault(name, set()).add(shard_id)
        missing = [name for name, param in params.items() if None not in loaded.get(name, ())
                   and not (loaded.get(name) and _expected_shards(owners[name], param) <= loaded[name])]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")

    def process_weights_after_loading(self) -> None:
        """The quantized logits head, over the loaded head (worker/quantization)."""
        if self.logits_method is not None:
            head = self.model.embed_tokens if self.lm_head is None else self.lm_head
            self.logits_head = LogitsHead(head.weight, self.logits_method)
            self.logits_head.model_dtype = head.weight.dtype
            self.logits_method.process_weights_after_loading(self.logits_head)
    # an fp8 KV cache's per-layer scales: vLLM's names (`k_proj.k_scale` in older checkpoints)
    KV_SCALE = re.compile(r"(?P<attention>.+\.self_attn)\.(?:[kv]_proj\.|attn\.)?(?P<which>[kv]_scale)")

    def load_kv_scale(self, name: str, tensor: CheckpointTensor) -> bool:
        """Whether `name` is a layer's k_scale or v_scale, given to its Attention (kept as one float)."""
        match = self.KV_SCALE.fullmatch(name)
        if match is None:
            return False
        self.get_submodule(match["attention"]).attn.load_kv_scale(match["which"], tensor.load())
        return True

    def warmup_kernels(self) -> None:
        """Compile, at start-up, the kernels a family runs beyond attention (CUDA): none here."""


class LlamaForCausalLM(CausalLM):
    attention_class = LlamaAttention
    qkv_bias = False  # q, k and v have biases whatever the config says (Qwen2)

    def build_model(self, config) -> DecoderModel:
        return DecoderModel(config, (self.build_layer(config, i) for i in range(config.num_hidden_layers)))

    def build_layer(self, config, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx, self.build_attention(config, layer_idx),
                                 self.build_mlp(config, layer_idx))

    def build_attention(self, config, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))  # every projection's, as transformers' Llama
        return self.attention_class(config, layer_idx, qkv_bias=bias or self.qkv_bias, o_bias=bias)

    def build_mlp(self, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer where the config sets one (v0.1)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q, k and v biases; windows on the layers `layer_types` marks."""

    qkv_bias = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with its checkpoint's projections already fused (qkv_proj, gate_up_proj: the loaders
    split them by rank), LongRoPE and partial rotary through Phi-3's own rotary module."""

    rotary_class = functools.partial(TransformersRope, partial_default=True)
