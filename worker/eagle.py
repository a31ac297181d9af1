"""[speculative] `method: eagle`: an EAGLE head (Li et al. 2024) drafts from the target's own
hidden states, in the checkpoint format vLLM loads (EAGLE-1 for Llama: `fc` over [embedding,
hidden] then one decoder layer without its input norm; the target's embeddings and LM head).

The head's input at position p is (token p + 1, the target's hidden state at p), and its output
there predicts token p + 2. It runs on rank 0 of a group of one, just before the target's
forward, as the draft model does (worker/drafter.py), over its own one-layer KV pool under the
target's block ids:

  catch-up:  the positions the target computed last step (their hidden states kept since), with
             the tokens after them, now all known: the head's KV there, and at the last one
             (L - 1, before the sequence's last token x_L) the logits of d_1;
  pass i:    d_(i-1) with the head's own output before it, at position L + i - 2: d_i.

The catch-up of the next step rewrites the positions the drafting passes wrote, with the target's
hidden states, as far as the target kept the drafts. A sequence that lost its kept states (a
swap, a recompute's first step) drafts nothing useful for a step: its placeholders stay 0 and are
rejected. A block shared from the prefix cache holds the head's KV of its last position for the
token that followed it in the sequence that computed it, which may not be this one's next token:
acceptance, never the output, can tell.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from common.config import EngineConfig
from common.models import resolve_model
from common.plan_state import ScheduledSequence
from worker.context import AttentionContext, attention_context
from worker.input_batch import StepTensors
from worker.loader import hf_directory
from worker.models.layers import RMSNorm, RotaryEmbedding, default_weight_loader
from worker.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from worker.models.weights import iter_safetensors
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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


class EagleHead(nn.Module):
    def __init__(self, config, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([EagleLayer(config)])
        self.rotary = RotaryEmbedding(head_dim_of(config))

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layers[0](positions, self.fc(torch.cat([embeddings, hidden], dim=-1)), self.rotary)

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        owners = {f"{prefix}.{name}" if prefix else name: module for prefix, module in self.named_modules()
                  for name, _ in module.named_parameters(recurse=False)}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(SHARED) or "rotary_emb.inv_freq" in name:
                continue
            shard = None
            for ours, theirs, shard_id in STACKED_PARAMS:
                if f".{theirs}." in name:
                    name, shard = name.replace(f".{theirs}.", f".{ours}."), shard_id
                    break
            if name not in params:
                raise ValueError(f"the EAGLE checkpoint's {name} is no weight of an EAGLE-1 Llama head")
            param = params[name]
            loader = getattr(param, "weight_loader", None) or getattr(owners[name], "weight_loader",
                                                                       default_weight_loader)
            loader(param, tensor, shard)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"weights missing from the EAGLE checkpoint: {missing[:5]}")


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
        names = [name for name, _ in iter_safetensors(hf_directory(source))]
        group = get_tp_group()
        set_tp_group(TensorParallelGroup())  # whole on rank 0
        try:
            head = EagleHead(hf_config, fc_bias=any(n.removeprefix("model.") == "fc.bias" for n in names))
        finally:
            set_tp_group(group)
        head.load_weights(iter_safetensors(hf_directory(source)))
        head.rotary.init_cache(LlamaRotaryEmbedding, hf_config, max_model_len)
        self.head = head.to(device=device, dtype=dtype).eval()
        self.target = target
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.layers = [head.layers[0].self_attn.attn]
        self.max_positions = max_model_len
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        log.info("EAGLE head %s loaded", source.name)

    def kv_bytes_per_block(self, block_size: int) -> int:
        a = self.layers[0]
        return 2 * block_size * a.num_kv_heads * a.head_dim * torch.finfo(self.kv_cache_dtype).bits // 8

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[torch.Tensor]:
        a = self.layers[0]
        a.kv_cache = torch.zeros((num_blocks, 2, block_size, a.num_kv_heads, a.head_dim),
                                 dtype=self.kv_cache_dtype, device=device)
        return [a.kv_cache]

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.pending.pop(seq_id, None)

    def reset(self) -> None:
        self.pending.clear()

    def _run(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, context: AttentionContext):
        with attention_context(context):
            return self.head(self.target.model.embed_tokens(ids), hidden.to(self.dtype), positions)

    @torch.inference_mode()
    def propose(self, step: StepTensors, rows: list[int], starts: list[int], ks: list[int],
                scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """The drafts of the drafting rows, flat ([sum(ks)]), after the catch-up of every
        scheduled sequence with kept hidden states (see the module docstring)."""
        device = step.input_ids.device
        drafts = torch.zeros((len(rows), max(ks, default=0)), dtype=torch.int64, device=device)
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
        with_first = [j for j, r in enumerate(rows) if r in last]
        if not ids:
            return _flat(drafts, ks)
        context = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=step.context.block_tables.index_select(0, torch.tensor(table_rows, device=device)),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        )
        out = self._run(torch.tensor(ids, device=device), torch.cat(hiddens),
                        torch.tensor(positions, device=device), context)
        if not with_first:
            return _flat(drafts, ks)
        g = out[torch.tensor([last[rows[j]] for j in with_first], device=device)]
        token = self.target.compute_logits(g).argmax(dim=-1)
        live = with_first
        drafts[live, 0] = token
        flat = torch.tensor(starts, dtype=torch.int64, device=device)
        scheduled_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        for i in range(1, max(ks)):  # d_i (0-based column i) from d_(i-1) at position L + i - 1
            keep = [n for n, j in enumerate(live) if ks[j] > i]
            if not keep:
                break
            live, token, g = [live[n] for n in keep], token[keep], g[keep]
            at = flat[live] + i - 1
            pos = step.positions[at]
            context = AttentionContext(
                slot_mapping=step.context.slot_mapping[at],
                block_tables=step.context.block_tables.index_select(0, scheduled_rows[live]),
                seq_lens=(pos + 1).to(torch.int32),
                cu_seqlens_q=torch.arange(len(live) + 1, dtype=torch.int32, device=device),
            )
            g = self._run(token, g, pos, context)
            token = self.target.compute_logits(g).argmax(dim=-1)
            drafts[live, i] = token
        return _flat(drafts, ks)

    def keep(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        """The target's hidden states of the step, per sequence, for its next catch-up."""
        i = 0
        for s in scheduled:
            n = s.num_scheduled_tokens
            kept = hidden[i:i + n]
            left = self.pending.get(s.seq_id)  # positions whose next token the catch-up lacked
            if left is not None and left[0] + left[1].shape[0] == s.num_computed_tokens:
                self.pending[s.seq_id] = (left[0], torch.cat([left[1], kept]))
            else:
                self.pending[s.seq_id] = (s.num_computed_tokens, kept)
            i += n


def _flat(drafts: torch.Tensor, ks: list[int]) -> torch.Tensor:
    keep = torch.tensor([j < k for k in ks for j in range(drafts.shape[1])], dtype=torch.bool, device=drafts.device)
    return drafts.view(-1)[keep]
