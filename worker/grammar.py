"""The grammar state of a worker's constrained sequences (structured output), with xgrammar.

A request's StructuredOutput is compiled once per distinct (kind, spec) against the served model's
tokenizer (an LRU of CompiledGrammars) by the rule the gateway checks requests with
(common/structured_output.py). Each held constrained sequence has a GrammarMatcher, kept like the
sampler's TokenCounts: freed with the plan's finished and preempted ids; a sequence met first (a
NewSequence: first scheduling, a fork, a swap-in, a recompute after preemption) gets a new matcher
that replays its output tokens, so its state after preemption is the one it had; a held one
consumes the tokens appended to it since. Per step `fill` writes one bitmask, a row per
constrained sampling row, that the Sampler applies as one batched op.

Only rank 0 (the one with the Sampler) holds grammar state. The tokenizer is loaded, and xgrammar
imported, when the first constrained sequence arrives: an unconstrained workload pays nothing.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from common.plan_state import HeldSequence
from common.protocol import StructuredOutput
from common.structured_output import InvalidStructuredOutput, compile_structured_output

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is ~10-100 KB)


@dataclass(slots=True)
class _Matched:
    matcher: Any  # xgr.GrammarMatcher, or None when the grammar failed to compile or a token broke it
    num_tokens: int  # tokens of the sequence consumed: prompt tokens count as consumed


@dataclass(slots=True)
class TokenMask:
    """A step's grammar masks: logits row `rows[i]` may only take the tokens set in `bitmask[i]`
    (xgrammar's packing: bit t % 32 of int32 word t // 32)."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the host


class GrammarState:
    """`load_tokenizer`: returns the served model's tokenizer (called once, on the first
    constrained sequence). `vocab_size`: the model's (the logits' width, past the tokenizer's
    own tokens where the embedding is padded). `stop_token_ids`: what ends a finished grammar."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.matchers: dict[int, _Matched] = {}
        self._compiler = None
        self._batch = None
        self._xgr = None

    # ------------------------------------------------------------------------- grammars

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # one cache, ours (bounded by count); one thread: a compile runs inside a step
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._xgr = xgr
        return self._compiler

    def compile(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec`, from the cache. Raises InvalidStructuredOutput."""
        key = (spec.kind, spec.spec)
        compiled = self.compiled.get(key)
        if compiled is not None:
            self.compiled.move_to_end(key)
            return compiled
        compiled = self.compiled[key] = compile_structured_output(self.compiler, spec)
        if len(self.compiled) > self.cache_size:
            self.compiled.popitem(last=False)
        return compiled

    # ------------------------------------------------------------------------- matchers

    def reset(self) -> None:
        self.matchers.clear()

    def free(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)

    def sync(self, seqs: Iterable[tuple[int, HeldSequence]]) -> None:
        """Bring the matchers of these sequences up to their tokens (a sequence met first: a new
        matcher replaying its output). Unconstrained sequences are skipped."""
        for seq_id, held in seqs:
            spec = held.sampling_params.structured_output
            if spec is None:
                continue
            matched = self.matchers.get(seq_id)
            if matched is None:
                matched = self.matchers[seq_id] = _Matched(self._new_matcher(seq_id, spec), held.num_prompt_tokens)
            token_ids = held.token_ids
            if matched.num_tokens < len(token_ids):
                self._consume(seq_id, matched, token_ids[matched.num_tokens:])
                matched.num_tokens = len(token_ids)

    def _new_matcher(self, seq_id: int, spec: StructuredOutput):
        try:
            compiled = self.compile(spec)
        except InvalidStructuredOutput as e:  # the gateway checks by the same rule: not expected here
            log.error("sequence %d: %s; it may only end", seq_id, e)
            return None
        return self._xgr.GrammarMatcher(compiled)

    def _consume(self, seq_id: int, matched: _Matched, token_ids: list[int]) -> None:
        matcher = matched.matcher
        if matcher is None:
            return
        for token in token_ids:
            if matcher.is_terminated():  # past its stop token (ignore_eos): it stays ended
                return
            if not matcher.accept_token(token):
                log.error("sequence %d: token %d breaks its grammar; it may only end", seq_id, token)
                matched.matcher = None
                return

    # ------------------------------------------------------------------------- masks

    def fill(self, rows: list[tuple[int, int]]) -> TokenMask | None:
        """The step's mask for these (logits row, seq_id) pairs, synced first; None when no row is
        constrained. A finished grammar allows only the stop tokens."""
        rows = [(row, seq_id) for row, seq_id in rows if seq_id in self.matchers]
        if not rows:
            return None
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        live, live_at, ended_at = [], [], []
        for i, (_, seq_id) in enumerate(rows):
            matcher = self.matchers[seq_id].matcher
            if matcher is None or matcher.is_terminated():
                ended_at.append(i)
            else:
                live.append(matcher)
                live_at.append(i)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_at)
        for i in ended_at:
            bitmask[i] = _only(self.stop_token_ids, bitmask.shape[1])
        return TokenMask([row for row, _ in rows], bitmask)


def _only(token_ids: list[int], num_words: int) -> torch.Tensor:
    words = [0] * num_words
    for t in token_ids:
        if t // 32 < num_words:
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
