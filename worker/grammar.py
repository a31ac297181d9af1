"""The grammar state of a worker's constrained sequences (structured output), with xgrammar.

A request's StructuredOutput is compiled once per distinct (kind, spec) against the served model's
tokenizer (an LRU of CompiledGrammars) by the rule the gateway checks requests with
(common/structured_output.py). Each held constrained sequence has a GrammarMatcher, kept like the
sampler's TokenCounts: freed with the plan's finished and preempted ids; a sequence met first (a
NewSequence: first scheduling, a fork, a swap-in, a recompute after preemption) gets a new matcher
that replays its output tokens, so its state after preemption is the one it had; a held one
consumes the tokens appended to it since. Per step `fill` writes one bitmask, a row per
constrained sampling row, that the Sampler applies as one batched op. A thinking model's sequence
passes its reasoning through a ReasoningGate first (worker/reasoning_gate.py): the grammar applies
after the reasoning ends, and a thinking budget forces the end.

Only rank 0 (the one with the Sampler) holds grammar state. The tokenizer is loaded, and xgrammar
imported, when the first constrained sequence arrives: an unconstrained workload pays nothing.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from common.plan_state import HeldSequence
from common.protocol import StructuredOutput
from common.structured_output import InvalidStructuredOutput, compile_structured_output
from worker.reasoning_gate import ReasoningGate, gated

log = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is ~10-100 KB)


class _Failed:
    """A grammar that could not be had (the compiler could not be built, or the spec not compiled):
    kept in the cache like a CompiledGrammar, so a spec that failed is not compiled again."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    @property
    def reason(self) -> str:
        return str(self.error)


@dataclass(slots=True)
class _Matched:
    matcher: Any  # xgr.GrammarMatcher; None without a grammar, or when it failed to compile or a token broke it
    num_tokens: int  # tokens of the sequence consumed: prompt tokens count as consumed
    # while its grammar compiles: the compile, and the sequence whose tokens are replayed once it is done
    compiling: Future | None = None
    held: HeldSequence | None = None
    gate: ReasoningGate | None = None  # the reasoning the grammar waits for
    grammar: bool = True  # False: only the gate masks its draws (a thinking budget without a grammar)


_STOP = object()  # a draw masked to the stop tokens: the grammar ended, or could not be had


@dataclass(slots=True)
class TokenMask:
    """A step's grammar masks: logits row `rows[i]` may only take the tokens set in `bitmask[i]`
    (xgrammar's packing: bit t % 32 of int32 word t // 32)."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the host


class GrammarState:
    """`load_tokenizer`: returns the served model's tokenizer (called once, on the first
    constrained sequence). `vocab_size`: the model's (the logits' width, past the tokenizer's
    own tokens where the embedding is padded). `stop_token_ids`: what ends a finished grammar.

    Grammars compile on one background thread (xgrammar releases the GIL while it compiles):
    `sync` starts the compile of a sequence's new spec, before the step's forward, and `fill`
    waits for it only when the sequence first samples, so a compile overlaps the prefill and the
    forward. A failure (the tokenizer, the compiler, the spec) never fails the step: the
    sequence's matcher is None (it may only end), and the failure is remembered, logged once."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # CompiledGrammar or _Failed
        self.compiling: dict[tuple[str, str], Future] = {}  # one compile per spec at a time
        self.matchers: dict[int, _Matched] = {}
        self._compiler = None
        self._compiler_error: str | None = None
        self._batch = None
        self._xgr = None
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------- grammars

    @property
    def compiler(self):
        """Built once, on the compile thread. Raises _CompilerUnavailable once it failed (the
        failure is logged the first time only)."""
        if self._compiler_error is not None:
            raise _CompilerUnavailable(self._compiler_error)
        if self._compiler is None:
            try:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # one cache, ours (bounded by count); one thread: compiles run one at a time
                compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            except Exception as e:  # noqa: BLE001 - a tokenizer or xgrammar failure: constrained sequences may only end
                self._compiler_error = f"no grammar compiler for this model ({type(e).__name__}: {e})"
                log.error("%s; constrained sequences may only end", self._compiler_error)
                raise _CompilerUnavailable(self._compiler_error) from e
            self._xgr, self._compiler = xgr, compiler
        return self._compiler

    def compile(self, spec: StructuredOutput):
        """The CompiledGrammar of `spec`, from the cache; compiled now (waiting for the compile
        thread) if it is not there. Raises InvalidStructuredOutput, or RuntimeError when there is
        no compiler for this model."""
        compiled = self._result(self.start_compile(spec), (spec.kind, spec.spec))
        if isinstance(compiled, _Failed):
            raise compiled.error
        return compiled

    def start_compile(self, spec: StructuredOutput) -> Future:
        """A future of `spec`'s CompiledGrammar or _Failed: done at once from the cache, else the
        compile already running for that spec, else a new one on the compile thread."""
        key = (spec.kind, spec.spec)
        compiled = self.compiled.get(key)
        if compiled is not None:
            self.compiled.move_to_end(key)
            done: Future = Future()
            done.set_result(compiled)
            return done
        future = self.compiling.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            future = self.compiling[key] = self._pool.submit(self._compile_now, spec)
        return future

    def _compile_now(self, spec: StructuredOutput):
        """On the compile thread: the CompiledGrammar, or a _Failed for any failure."""
        try:
            return compile_structured_output(self.compiler, spec)
        except (_CompilerUnavailable, InvalidStructuredOutput) as e:  # the gateway checks specs by the same rule
            return _Failed(e)
        except Exception as e:  # noqa: BLE001 - xgrammar's own failure: the step goes on
            return _Failed(RuntimeError(f"{type(e).__name__}: {e}"))

    def _result(self, future: Future, key: tuple[str, str]):
        """`future`'s grammar (waiting for it), cached: the first to see a compile's result moves
        it from `compiling` into the LRU, logging a failure then (once per spec)."""
        compiled = future.result()
        if self.compiling.get(key) is future:
            del self.compiling[key]
            if isinstance(compiled, _Failed) and compiled.reason != self._compiler_error:
                log.error("grammar %s %.200r: %s; its sequences may only end", *key, compiled.reason)
            self.compiled[key] = compiled
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
        """Bring the matchers of these sequences up to their tokens. A sequence met first gets a new
        matcher replaying its output once its grammar is compiled: the compile starts here, and
        the matcher is made when the sequence samples (`fill`). Unconstrained sequences are skipped."""
        for key, future in list(self.compiling.items()):  # the compiles done whose sequences left before sampling
            if future.done():
                self._result(future, key)
        for seq_id, held in seqs:
            params = held.sampling_params
            if not gated(params):
                continue
            matched = self.matchers.get(seq_id)
            if matched is None:
                spec = params.structured_output
                matched = self.matchers[seq_id] = _Matched(
                    None, held.num_prompt_tokens, None if spec is None else self.start_compile(spec),
                    gate=ReasoningGate.of(params), grammar=spec is not None)
            if matched.compiling is not None:
                matched.held = held  # its tokens are replayed once the grammar is there
                continue
            self._catch_up(seq_id, matched, held)

    def _catch_up(self, seq_id: int, matched: _Matched, held: HeldSequence) -> None:
        token_ids = held.token_ids
        if matched.num_tokens < len(token_ids):
            self._consume(seq_id, matched, token_ids[matched.num_tokens:])
            matched.num_tokens = len(token_ids)

    def _finish_compile(self, seq_id: int, matched: _Matched) -> None:
        """Wait for the sequence's grammar; make its matcher and replay its tokens."""
        held = matched.held
        spec = held.sampling_params.structured_output
        compiled = self._result(matched.compiling, (spec.kind, spec.spec))
        matched.compiling = matched.held = None
        if not isinstance(compiled, _Failed):  # else matcher None: it may only end, once it has reasoned
            matched.matcher = self._xgr.GrammarMatcher(compiled)
        self._catch_up(seq_id, matched, held)

    def _consume(self, seq_id: int, matched: _Matched, token_ids: list[int]) -> None:
        """The reasoning's tokens to the gate, the rest to the grammar's matcher."""
        gate = matched.gate
        for i, token in enumerate(token_ids):
            if gate is None or not gate.open:
                self._accept(seq_id, matched, token_ids[i:])
                return
            gate.consume(token)

    def _accept(self, seq_id: int, matched: _Matched, token_ids: list[int]) -> None:
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

    def fill(self, rows: list[tuple[int, int]], drafted: dict[int, list[int]] | None = None) -> TokenMask | None:
        """The step's mask for these (logits row, seq_id) pairs, synced first; None when no row is
        constrained. A finished grammar allows only the stop tokens. `drafted`: the
        drafts of sequences that verify some; each has 1 + k rows, in order, masked as the grammar
        stands after the drafts before them (`_fill_drafted`)."""
        rows = [(row, seq_id) for row, seq_id in rows if seq_id in self.matchers]
        if not rows:
            return None
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        live, live_at = [], []
        drafted_at: dict[int, list[int]] = {}
        for i, (_, seq_id) in enumerate(rows):
            if drafted and seq_id in drafted:
                drafted_at.setdefault(seq_id, []).append(i)
                continue
            matched = self.matchers[seq_id]
            if matched.compiling is not None:
                self._finish_compile(seq_id, matched)
            mask = self._next_mask(matched, matched.gate)
            if mask is not None and not self._write_mask(mask, bitmask, i):
                live.append(mask)
                live_at.append(i)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_at)
        for seq_id, at in drafted_at.items():
            self._fill_drafted(seq_id, drafted[seq_id], bitmask, at)
        return TokenMask([row for row, _ in rows], bitmask)

    @staticmethod
    def _next_mask(matched: _Matched, gate: ReasoningGate | None):
        """What masks the sequence's next draw: None (a free draw), a forced token id, _STOP, or
        its matcher."""
        if gate is not None and gate.open:
            return gate.forced()
        if not matched.grammar:
            return None
        matcher = matched.matcher
        return _STOP if matcher is None or matcher.is_terminated() else matcher

    def _write_mask(self, mask, bitmask: torch.Tensor, i: int) -> bool:
        """Row i for a forced token or the stop tokens; False for a matcher (the caller fills it)."""
        if mask is _STOP:
            bitmask[i] = _only(self.stop_token_ids, bitmask.shape[1])
        elif isinstance(mask, int):
            bitmask[i] = _only([mask], bitmask.shape[1])
        else:
            return False
        return True

    def _fill_drafted(self, seq_id: int, drafts: list[int], bitmask: torch.Tensor, at: list[int]) -> None:
        """Position j's mask is the one after d_1..d_j: a copy of the gate takes the reasoning
        drafts, then the matcher accepts the rest one by one and rolls them back (the verification
        decides what stays; the next plan's tokens are consumed as any). After a draft the mask
        refuses, the positions are unreachable (the draw before it cannot equal it): they repeat
        the last mask."""
        matched = self.matchers[seq_id]
        if matched.compiling is not None:
            self._finish_compile(seq_id, matched)
        gate = matched.gate.copy() if matched.gate is not None and matched.gate.open else None
        accepted = 0
        for j, i in enumerate(at):
            mask = self._next_mask(matched, gate)
            if mask is not None and not self._write_mask(mask, bitmask, i):
                mask.fill_next_token_bitmask(bitmask, i)
            if j == len(drafts):
                break
            token = drafts[j]
            if gate is not None and gate.open:  # a reasoning draft: free, or the forced token
                taken = mask is None or mask == token
                if taken:
                    gate.consume(token)
            else:
                taken = mask is None or (mask is not _STOP and mask.accept_token(token))
                accepted += mask is not None and taken
            if not taken:
                for rest in at[j + 1:]:
                    bitmask[rest] = bitmask[i]
                break
        if accepted:
            matched.matcher.rollback(accepted)


def _only(token_ids: list[int], num_words: int) -> torch.Tensor:
    words = [0] * num_words
    for t in token_ids:
        if t // 32 < num_words:
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class _CompilerUnavailable(RuntimeError):
    """The grammar compiler could not be built (tokenizer, TokenizerInfo): remembered, not retried."""
