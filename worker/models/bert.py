"""BERT-family encoders (BertModel, XLMRobertaModel: BGE, E5, GTE, bge-m3) served as pooling models.

An encoder attends both ways: every token of an input sees every other, so an input is computed
whole in one step (the scheduler does not chunk on an encoder: `WorkerHello.encoder`) and nothing of
it can come from the prefix cache (its pooling reads every position: mean or CLS). The layers are
transformers' post-norm blocks with absolute positions (XLM-RoBERTa's offset by its padding id + 1)
and token types (0: an input of one text), tensor parallel as the decoders are (q/k/v and the
intermediate split by columns, the outputs by rows). Attention runs per input over the step's own
rows (`EncoderAttention`); its layers still own a paged KV cache the engine sizes and schedules as
for any model, and never read it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker.context import get_context
from worker.models.layers import (
    Attention, ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, ScoreHead, VocabParallelEmbedding,
    compute_logits,
)
from worker.models.llama import CausalLM
from worker.parallel import get_tp_group


class EncoderAttention(Attention):
    """Bidirectional attention over each input's rows of the step (the whole input: checked)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        spans = ctx.kernel_cache.get("encoder_spans")
        if spans is None:
            starts, lengths = ctx.cu_seqlens_q.tolist(), ctx.seq_lens.tolist()
            spans = [(a, b) for a, b in zip(starts, starts[1:])]
            if any(b - a != n for (a, b), n in zip(spans, lengths)):
                raise ValueError("an encoder computes each input whole in one step (no chunk, no cached prefix)")
            ctx.kernel_cache["encoder_spans"] = spans
        out = torch.empty_like(q)
        for a, b in spans:  # [1, heads, rows, head_dim]: the fused kernels take 4-D inputs
            out[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
                scale=self.scale, enable_gqa=True)[0].transpose(0, 1)
        return out.reshape(-1, self.num_heads * self.head_dim)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=True)
        shard = self.qkv_proj.shard
        self.attn = EncoderAttention(shard.num_heads, shard.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        size = self.qkv_proj.q_size
        q, k, v = (x.view(-1, self.attn.num_heads, self.head_dim) for x in self.qkv_proj(h).split([size] * 3, dim=-1))
        return self.attn(q, k, v)


class BertOutput(nn.Module):
    """A row-parallel projection, then LayerNorm over it plus the residual (post-norm)."""

    def __init__(self, input_size: int, config) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        setattr(self, "self", BertSelfAttention(config))  # transformers' name: attention.self.query ...
        self.output = BertOutput(config.hidden_size, config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(getattr(self, "self")(h), h)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for an encoder (gelu only)")
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(h), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attention(h)
        return self.output(self.intermediate(h), h)


class BertEmbeddings(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

        self.sep_token_id: int | None = None  # a pair's token types: 1 after the first separator (the loader sets it)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if self.sep_token_id is None or self.token_type_embeddings.num_embeddings == 1:
            return self.LayerNorm(h + self.token_type_embeddings.weight[0])  # one text, or no types: type 0
        return self.LayerNorm(h + self.token_type_embeddings(self.token_types(input_ids)))

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """BERT's pair "[CLS] a [SEP] b [SEP]": type 0 up to the first separator, 1 after it, per input
        of the step (each whole: an encoder's)."""
        lengths = torch.diff(get_context().cu_seqlens_q).long()
        seps = (input_ids == self.sep_token_id).long()
        before = torch.cumsum(seps, 0) - seps  # separators before each token, over the whole step
        first = torch.cumsum(lengths, 0) - lengths  # each input's first row
        start = torch.repeat_interleave(before[first], lengths)
        return (before - start > 0).long()


class BertEncoderModel(nn.Module):
    def __init__(self, config, position_offset: int) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, position_offset)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:  # the draw that ends an input reads it (CausalLM's name)
        return self.embeddings.word_embeddings

    @property
    def norm(self) -> nn.LayerNorm:  # where a head's parameters live (their device)
        return self.embeddings.LayerNorm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            h = layer(h)
        return h


class EncoderClassifier(nn.Module):
    """A cross-encoder's head over the CLS token: BERT's pooler (dense, tanh) and classifier, or
    RoBERTa's classification head (the same shape), in float32."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = ScoreHead(hidden_size, hidden_size)
        self.out_proj = ScoreHead(hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertModel(CausalLM):
    """The runner's model interface (CausalLM's) over a BERT encoder; only a pooling model uses it."""

    STACKED_PARAMS = [("qkv_proj", "query", "q"), ("qkv_proj", "key", "k"), ("qkv_proj", "value", "v")]
    SKIPPED = ("position_ids", "pooler.", "cls.")  # buffers, an embedder's unused pooler, an MLM head
    # a cross-encoder's head: BERT's pooler and classifier, RoBERTa's classification head
    RENAMES = (("classifier.dense.", "score.dense."), ("classifier.out_proj.", "score.out_proj."),
               ("classifier.", "score.out_proj."), ("bert.pooler.", "score."), ("bert.", "model."),
               ("roberta.", "model."))
    position_offset = 0
    bidirectional = True  # WorkerHello.encoder: each input computed whole in one step

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported (absolute)")
        self.config = config
        self.tp = get_tp_group()
        self.model = BertEncoderModel(config, self.position_offset_of(config))
        self.tie_word_embeddings, self.lm_head, self.final_logit_softcap = True, None, None
        self.logits_method, self.logits_head = None, None

    def position_offset_of(self, config) -> int:
        return self.position_offset

    def classifier_head(self, config, num_labels: int) -> nn.Module:
        return EncoderClassifier(config.hidden_size, num_labels)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.encoder.layer

    def init_rope_cache(self, max_positions: int) -> None:
        """Absolute positions: no rotary cache; the context (--max-model-len), at most the position
        table's (XLM-RoBERTa's less its offset: 512 of 514)."""
        self.context = min(max_positions, self.config.max_position_embeddings - self.position_offset_of(self.config))

    @property
    def max_positions(self) -> int:
        return getattr(self, "context", self.config.max_position_embeddings - self.position_offset_of(self.config))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return compute_logits(self.tp, hidden, self.model.embed_tokens.weight, self.config.vocab_size, None)

    def process_weights_after_loading(self) -> None:
        """No quantized logits head (an encoder's one draw is discarded)."""


class XLMRobertaModel(BertModel):
    """RoBERTa's positions start after its padding id (transformers' create_position_ids)."""

    def position_offset_of(self, config) -> int:
        return int(config.pad_token_id) + 1
