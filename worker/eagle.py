"""`method: eagle` / `eagle3`: an EAGLE head (Li et al. 2024, 2025) drafts from the
target's own hidden states, in the checkpoint layouts vLLM loads for Llama-shaped targets:
EAGLE-1, `fc` over [embedding, hidden] then one decoder layer without its input norm, the
target's LM head; EAGLE-3, `fc` fusing the residual stream entering three of the target's layers,
one layer over [norm(embedding), norm(hidden)], its own norm and LM head over a draft vocabulary
(`d2t` maps it to the target's). Both use the target's embeddings.

The head's input at position p is (token p + 1, the target's hidden state at p), and its output
there predicts token p + 2. It runs on rank 0 of a group of one, just before the target's
forward, as the draft model does (worker/drafter.py), over its own one-layer KV pool under the
target's block ids:

  catch-up:  the positions the target computed last step (their hidden states kept since), with
             the tokens after them, now all known: the head's KV there, and at the last one
             (L - 1, before the sequence's last token x_L) the logits of d_1;
  pass i:    d_(i-1) with the head's own output before it, at position L + i - 2: d_i.

The catch-up of the next step rewrites the positions the drafting passes wrote, with the target's
hidden states, as far as the target kept the drafts. Under async scheduling a position whose next
token is still on the device waits for a later catch-up. A sequence that lost its kept states (a
swap) drafts nothing useful for a step: its placeholders stay 0 and are rejected, and the head's KV of the positions of its last step before stays empty. A block
shared from the prefix cache holds the head's KV of its last position for the
token that followed it in the sequence that computed it, which may not be this one's next token:
acceptance, never the output, can tell.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from common.config import EngineConfig
from common.models import resolve_model
from common.plan_state import ScheduledSequence
from worker.context import AttentionContext, attention_context
from worker.drafter import one_token_each
from worker.input_batch import StepTensors
from worker.loader import hf_directory
from worker.models.layers import QKVParallelLinear, RMSNorm, RotaryEmbedding, default_weight_loader
from worker.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from worker.models.rope import TransformersRope
from worker.models.weights import iter_safetensors
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from transformers import AutoConfig

log = logging.getLogger(__name__)

STACKED_PARAMS = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
SHARED = ("embed_tokens.", "lm_head.")  # the target's, whatever the checkpoint holds


class EagleLayer(nn.Module):
    """A Llama decoder layer without its input norm (EAGLE-1): returns its output plus the residual."""

    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, 0, qkv_bias=bool(getattr(config, "attention_bias", False)))
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        residual = h
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, rotary), residual)
        return self.mlp(h) + residual


class Eagle3Layer(nn.Module):
    """EAGLE-3's one layer (`midlayer` in its checkpoints): attention over [norm(embedding),
    norm(hidden)] (q, k, v take 2 x hidden), the hidden states as the residual stream."""

    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, 0)
        head_dim = head_dim_of(config)
        self.self_attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, head_dim, config.num_attention_heads,
                                                    config.num_key_value_heads,
                                                    bias=bool(getattr(config, "attention_bias", False)))
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, embeddings, h, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        residual = h
        x = torch.cat([self.input_layernorm(embeddings), self.hidden_norm(h)], dim=-1)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, x, rotary), residual)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    """EAGLE-3 (Li et al. 2025): `fc` fuses three of the target's layers' hidden states (low, middle,
    high); one layer; its own norm and LM head over a draft vocabulary mapped to the target's by
    `d2t` (target id = draft id + d2t[draft id])."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * getattr(config, "target_hidden_size", h), h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
        self.rotary = RotaryEmbedding(head_dim_of(config))

    def forward(self, embeddings, hidden, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output for the logits, the output before the norm: the next pass's hidden)."""
        h, residual = self.layers[0](positions, embeddings, hidden, self.rotary)
        return self.norm(h, residual)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class EagleHead(nn.Module):
    def __init__(self, config, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([EagleLayer(config)])
        self.rotary = RotaryEmbedding(head_dim_of(config))

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        out = self.layers[0](positions, self.fc(torch.cat([embeddings, hidden], dim=-1)), self.rotary)
        return out, out


def load_head_weights(head: nn.Module, weights) -> None:
    params = dict(head.named_parameters())
    owners = {f"{prefix}.{name}" if prefix else name: module for prefix, module in head.named_modules()
              for name, _ in module.named_parameters(recurse=False)}
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if (name.startswith(SHARED) and name not in params) or "rotary_emb.inv_freq" in name or name == "t2d":
            continue
        shard = None
        for ours, theirs, shard_id in STACKED_PARAMS:
            if f".{theirs}." in name:
                name, shard = name.replace(f".{theirs}.", f".{ours}."), shard_id
                break
        if name not in params:
            raise ValueError(f"the EAGLE checkpoint's {name} is no weight of {type(head).__name__}")
        param = params[name]
        loader = getattr(param, "weight_loader", None) or getattr(owners[name], "weight_loader",
                                                                   default_weight_loader)
        if name == "d2t":
            param.data.copy_(tensor.load())
        else:
            loader(param, tensor, shard)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights missing from the EAGLE checkpoint: {missing[:5]}")


@dataclass(slots=True)
class CatchUp:
    """The catch-up forward's batch: per sequence, the kept positions whose next token is known."""
    ids: list[int]  # the next token of each position
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    cu: list[int]  # cu_seqlens_q
    hiddens: list[torch.Tensor]  # the target's kept hidden states, one tensor per sequence
    table_rows: list[int]  # the scheduled index of each sequence
    last: dict[int, int]  # scheduled index -> the catch-up row of its position L - 1


class EagleDrafter:
    """The head, its KV pool's one layer, and the target hidden states each sequence's next
    catch-up needs (seq_id -> (first position, [n, hidden]))."""

    def __init__(self, config: EngineConfig, target: nn.Module, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, kv_cache_dtype: torch.dtype) -> None:
        source = resolve_model(config.speculative.model, None, config.download_dir)
        hf_config = AutoConfig.from_pretrained(hf_directory(source))  # its architecture is no target's
        if hf_config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the EAGLE head {source.name} has hidden size {hf_config.hidden_size}, the target "
                             f"{target.config.hidden_size}")
        self.eagle3 = config.speculative.method == "eagle3"
        names = [name for name, _ in iter_safetensors(hf_directory(source))]
        group = get_tp_group()
        set_tp_group(TensorParallelGroup())  # whole on rank 0
        try:
            head = (Eagle3Head(hf_config) if self.eagle3 else
                    EagleHead(hf_config, fc_bias=any(n.removeprefix("model.") == "fc.bias" for n in names)))
        finally:
            set_tp_group(group)
        load_head_weights(head, iter_safetensors(hf_directory(source)))
        head.rotary.init_cache(TransformersRope, hf_config, max_model_len)
        self.head = head.to(device=device, dtype=dtype).eval()
        self.target = target
        # EAGLE-3 reads the residual stream entering three of the target's layers (vLLM's choice)
        num_layers = len(target.layers)
        self.aux_layers = (2, num_layers // 2, num_layers - 3) if self.eagle3 else ()
        if self.eagle3 and num_layers < 7:  # three distinct layers, in order
            raise ValueError(f"EAGLE-3 reads the target's layers 2, L/2 and L-3: the target has {num_layers}")
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.layers = [head.layers[0].self_attn.attn]
        self.max_positions = max_model_len
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        log.info("EAGLE head %s loaded", source.name)

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.layers[0]
        return 2 * block_size * a.num_kv_heads * a.head_dim * torch.finfo(self.kv_cache_dtype).bits // 8

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.pending.pop(seq_id, None)

    def reset(self) -> None:
        self.pending.clear()

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, context: AttentionContext):
        """(the output the logits read, the next pass's hidden input)."""
        with attention_context(context):
            ids = ids if self.target.model.max_token_id is None else ids.clamp(max=self.target.model.max_token_id)
            return self.head(self.target.model.embed_tokens(ids), hidden.to(self.dtype), positions)

    def _greedy(self, out: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.head.to_target_ids(self.head.lm_head(out).argmax(dim=-1))
        return self.target.compute_logits(out).argmax(dim=-1)

    @torch.inference_mode()
    def propose(self, step: StepTensors, rows: list[int], starts: list[int], ks: list[int],
                scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """The drafts of the drafting rows, flat ([sum(ks)]), after the catch-up of every
        scheduled sequence with kept hidden states (see the module docstring)."""
        device = step.input_ids.device
        drafts = torch.zeros((len(rows), max(ks, default=0)), dtype=torch.int64, device=device)
        batch = self._catch_up_batch(scheduled)
        with_first = [j for j, r in enumerate(rows) if r in batch.last]
        if not batch.ids:
            return _flat(drafts, ks)
        out, g = self._catch_up(step, batch)
        if not with_first:
            return _flat(drafts, ks)
        index = torch.tensor([batch.last[rows[j]] for j in with_first], device=device)
        token, g = self._greedy(out[index]), g[index]
        drafts[with_first, 0] = token
        self._draft_rest(step, drafts, rows, starts, ks, with_first, token, g)
        return _flat(drafts, ks)

    def _catch_up_batch(self, scheduled: list[ScheduledSequence]) -> CatchUp:
        """Each scheduled sequence's kept positions whose next token the host holds, taken from
        `pending` (the rest stay there for the next step)."""
        ids, positions, slots, seq_lens, cu, hiddens, table_rows = [], [], [], [], [0], [], []
        last: dict[int, int] = {}  # scheduled index -> the catch-up row of its position L - 1
        for r, s in enumerate(scheduled):
            kept = self.pending.pop(s.seq_id, None)
            if kept is None:
                continue
            start, hidden = kept
            tokens, table, bs = s.held.token_ids, s.held.block_table, self.layers[0].kv_cache.shape[2]
            valid = min(hidden.shape[0], s.num_computed_tokens - start)  # positions the target kept
            n = min(valid, len(tokens) - start - 1)
            while n > 0 and tokens[start + n] < 0:  # a token still on the device (async): next step
                n -= 1
            if n < valid:
                self.pending[s.seq_id] = (start + n, hidden[n:valid])
            if n <= 0:
                continue
            ids += tokens[start + 1:start + n + 1]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            hiddens.append(hidden[:n])
            table_rows.append(r)
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
            if start + n == s.num_computed_tokens:
                last[r] = cu[-1] - 1
        return CatchUp(ids, positions, slots, seq_lens, cu, hiddens, table_rows, last)

    def _catch_up(self, step: StepTensors, batch: CatchUp) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the catch-up batch, writing its KV: (output, hidden state) per catch-up row."""
        device = step.input_ids.device
        context = AttentionContext(
            slot_mapping=torch.tensor(batch.slots, dtype=torch.int64, device=device),
            block_tables=step.context.block_tables.index_select(0, torch.tensor(batch.table_rows, device=device)),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(batch.cu, dtype=torch.int32, device=device),
        )
        hidden = torch.cat(batch.hiddens).to(self.dtype)
        if self.eagle3:  # the three layers' states, fused
            hidden = self.head.fc(hidden)
        return self._run(torch.tensor(batch.ids, device=device), hidden,
                         torch.tensor(batch.positions, device=device), context)

    def _draft_rest(self, step: StepTensors, drafts: torch.Tensor, rows: list[int], starts: list[int], ks: list[int],
                    live: list[int], token: torch.Tensor, g: torch.Tensor) -> None:
        """Drafts 1.. of the `live` rows (draft 0 is `token`, from hidden states `g`) into `drafts`,
        one token per row per forward, each row up to its k."""
        device = step.input_ids.device
        flat = torch.tensor(starts, dtype=torch.int64, device=device)
        scheduled_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        for i in range(1, max(ks)):  # d_i (0-based column i) from d_(i-1) at position L + i - 1
            keep = [n for n, j in enumerate(live) if ks[j] > i]
            if not keep:
                break
            live, token, g = [live[n] for n in keep], token[keep], g[keep]
            pos, context = one_token_each(step, flat[live] + i - 1, scheduled_rows[live])
            out, g = self._run(token, g, pos, context)
            token = self._greedy(out)
            drafts[live, i] = token

    def keep(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """The target's hidden states of the step, per sequence, for its next catch-up."""
        i = 0
        for s in scheduled:
            n = s.num_scheduled_tokens
            kept = hidden[i:i + n].clone()  # not a view: the step's whole tensor would stay alive
            left = self.pending.get(s.seq_id)  # positions whose next token the catch-up lacked
            if left is not None and left[0] + left[1].shape[0] == s.num_computed_tokens:
                self.pending[s.seq_id] = (left[0], torch.cat([left[1], kept]))
            else:
                self.pending[s.seq_id] = (s.num_computed_tokens, kept)
            i += n


def _flat(drafts: torch.Tensor, ks: list[int]) -> torch.Tensor:
    keep = torch.tensor([j < k for k in ks for j in range(drafts.shape[1])], dtype=torch.bool, device=drafts.device)
    return drafts.view(-1)[keep]
