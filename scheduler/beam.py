"""Beam search (transformers' GenerationMixin._beam_search) over a request's sequences, one step
at a time: the scheduler gathers every beam's top logprobs (`BeamState.pending`), then `beam_step`
files the finished hypotheses and picks the next beams; it forks and finishes sequences through
the scheduler (`SequenceOps`), whose block manager shares a forked beam's blocks copy-on-write."""
from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import num_beam_candidates
from scheduler.sequence import BeamHypothesis, BeamState, Sequence, SequenceGroup, SequenceStatus


@dataclass(frozen=True, slots=True)
class SequenceOps:
    """What beam search asks of the scheduler."""

    fork: Callable[[SequenceGroup, Sequence, int], Sequence]  # a sequence sharing every block of its parent
    finish: Callable[[Sequence, SequenceStatus], None]  # ended: its blocks freed
    forget: Callable[[Sequence], None]  # no longer one of its group's sequences


def beam_step(group: SequenceGroup, eos_token_ids: frozenset[int] | set[int], num_eos_token_ids: int,
              ops: SequenceOps) -> None:
    """One step for one request: keep the best 2 * width continuations of all beams, file those
    among the first `width` that end (EOS, or the length limit) as finished hypotheses, go on with
    the best `width` that do not. Scores are float32 sums, as transformers' are."""
    beam = group.beam
    beams = group.seqs
    pending, beam.pending = beam.pending, {}
    k = num_beam_candidates(beam.width, num_eos_token_ids)
    candidates = []  # (score, beam index, token, logprob)
    for b, seq in enumerate(beams):
        for token, logprob in pending[seq.seq_id].top_logprobs[:k]:
            candidates.append((_f32(seq.cumulative_logprob + logprob), b, token, logprob))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    candidates = candidates[:k]
    generated = len(beams[0].output_token_ids) + 1
    at_max = generated >= beam.max_new_tokens
    ends = [at_max or c[2] in eos_token_ids for c in candidates]
    penalty = _f32(generated ** beam.length_penalty)
    for (score, b, token, _), ended in zip(candidates[: beam.width], ends):
        if ended:
            reason = "stop" if token in eos_token_ids else "length"
            _file_hypothesis(beam, BeamHypothesis(_f32(score / penalty), beams[b].output_token_ids + [token], score,
                                                  reason))
    going_on = [c for c, ended in zip(candidates, ends) if not ended][: beam.width]
    beam.done = not going_on or _settled(beam, going_on[0][0], generated)
    if beam.done:
        for seq in beams:
            ops.finish(seq, SequenceStatus.FINISHED_STOPPED)
        return
    _advance_beams(group, going_on, ops)


def _settled(beam: BeamState, best_score: float, generated: int) -> bool:
    """Whether the running beams can no longer beat the finished hypotheses (transformers' rule)."""
    if len(beam.finished) == beam.width:
        length = beam.max_new_tokens if beam.early_stopping == "never" and beam.length_penalty > 0 else generated
        best_possible = _f32(best_score / _f32(length ** beam.length_penalty))
        beam.improvable = best_possible > beam.finished[-1].score
    return not beam.improvable or (beam.early_stopping is True and len(beam.finished) == beam.width)


def _file_hypothesis(beam: BeamState, hypothesis: BeamHypothesis) -> None:
    finished = beam.finished
    at = len(finished)
    while at > 0 and finished[at - 1].score < hypothesis.score:
        at -= 1
    finished.insert(at, hypothesis)
    del finished[beam.width:]


def _advance_beams(group: SequenceGroup, going_on: list[tuple], ops: SequenceOps) -> None:
    """The next beams: a parent chosen once goes on as itself, chosen again it is forked (sharing
    its blocks), not chosen it is freed."""
    parents = list(group.seqs)
    chosen: set[int] = set()
    next_beams = []
    for score, b, token, _ in going_on:
        parent = parents[b]
        seq = ops.fork(group, parent, 0) if parent.seq_id in chosen else parent
        chosen.add(parent.seq_id)
        next_beams.append((seq, score, token))
    for parent in parents:
        if parent.seq_id not in chosen:
            ops.finish(parent, SequenceStatus.FINISHED_ABORTED)
            ops.forget(parent)
    for seq, score, token in next_beams:
        seq.output_token_ids.append(token)
        seq.cumulative_logprob = score
    group.seqs = [seq for seq, _, _ in next_beams]


def _f32(x: float) -> float:
    """Round to float32, as transformers' beam scores are."""
    return struct.unpack("f", struct.pack("f", x))[0]
