"""A family's causal model served for pooling (common/pooling.py): embeddings or a classifier's scores.

The runner pools the final norm's hidden states (worker/pooler.py); this class adds what a pooling
checkpoint holds beyond the decoder: a classifier head (`score`, transformers'
`*ForSequenceClassification`), and the names of a base-model checkpoint (sentence-transformers
saves `Qwen3Model`: no `model.` prefix, no LM head). No LM head is read: the one token a prompt's
last step draws (and discards) comes from the tied embedding.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from common.pooling import PoolerConfig
from common.protocol import PoolingParams
from worker.models.layers import ScoreHead

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


@torch.no_grad()
def score_from_rows(negative: torch.Tensor, positive: torch.Tensor, device: torch.device) -> nn.Linear:
    """vLLM's two-way softmax conversion: sigmoid((w_pos - w_neg) . h) is the positive token's
    probability of the two (a softmax over their logits)."""
    score = ScoreHead(negative.shape[0], 1, bias=False, device=device)
    score.weight.copy_((positive - negative).to(device)[None])
    return score


@functools.cache
def pooling_model(cls: type, pooler: PoolerConfig) -> type:
    """`cls` (a causal family class) with the pooling head `pooler` asks for."""

    class PoolingModel(cls):
        def __init__(self, config) -> None:
            # a classifier from two tokens' logits reads its LM head's rows (`load_weights`)
            self.from_tokens = getattr(config, "classifier_from_token_ids", None)
            if not self.from_tokens:
                config.tie_word_embeddings = True
            super().__init__(config)
            self.pooler_config = pooler
            # replicated on every rank, outside the quantization scheme (plain Linears)
            self.score = self.classifier_head(config, pooler.num_labels) \
                if pooler.task == "classify" and not self.from_tokens else None

        def load_weights(self, weights) -> None:
            if not self.from_tokens:
                return super().load_weights(weights)
            # every rank reads the two rows whole from the checkpoint (its own shard of the head
            # may hold neither), as the head's tensor goes by
            head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
            rows = []

            def watched(weights):
                for name, tensor in weights:
                    if self.rename(name) == head:
                        rows.extend(tensor.narrow(0, token, 1)[0].float() for token in self.from_tokens)
                    yield name, tensor

            super().load_weights(watched(weights))
            self.score = score_from_rows(*rows, self.model.norm.weight.device)

        def _dummy_score(self) -> nn.Linear:
            """Random weights, one rank: the rows as drawn."""
            head = self.model.embed_tokens if self.lm_head is None else self.lm_head
            rows = (head.weight[token].float() for token in self.from_tokens)
            return score_from_rows(*rows, self.model.norm.weight.device)

        def rename(self, name: str) -> str:
            name = super().rename(name)
            return name if name.startswith(_OWN_PREFIXES) else "model." + name

        def pool_head(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
            """[n, hidden] float32 pooled states -> the vectors the API returns (float32), as `params` asks."""
            if params.task == "classify":
                if self.score is None and self.from_tokens and self.tp.world_size == 1:  # dummy weights: none loaded
                    self.score = self._dummy_score()
                if self.score is None:
                    raise ValueError("a classify request to a model without a classifier head")
                logits = self.score(pooled)
                return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
            return F.normalize(pooled, p=2, dim=-1) if params.normalize else pooled

    PoolingModel.__name__ = PoolingModel.__qualname__ = f"{cls.__name__}Pooling"
    return PoolingModel
