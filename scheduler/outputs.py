"""What a request gained in a step, as the RequestOutput the scheduler returns from `update`.

A group that streams (one sequence, or `n` samples without `best_of` > `n`) reports every sample
each step, with the tokens it gained; one whose outputs are chosen at the end (beam search, or
`best_of` > `n`) reports once, finished, its best `n`; `max_tokens` 0 reports `n` empty outputs.
"""
from __future__ import annotations

from common.protocol import PromptLogprobs, SampledToken
from scheduler.sequence import RequestOutput, Sequence, SequenceGroup, SequenceOutput


def samples_by_seq(drawn: list[SampledToken]) -> dict[int, SampledToken | list[SampledToken]]:
    """seq_id -> its token; in lists when some sequence drew several (best_of, n)."""
    samples: dict[int, SampledToken | list[SampledToken]] = {s.seq_id: s for s in drawn}
    if len(samples) == len(drawn):
        return samples
    samples = {}
    for sampled in drawn:
        if (tokens := samples.get(sampled.seq_id)) is None:
            samples[sampled.seq_id] = [sampled]
        else:
            tokens.append(sampled)
    return samples


def stream_output(group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput:
    """`request_output` of a group of one sequence that streams, without its branches."""
    seq = group.seqs[0]
    status = seq.status
    return RequestOutput(
        group.request_id, seq.prompt_token_ids, [SequenceOutput(
            seq.index, seq.output_token_ids, new_counts.get(seq.seq_id, 0), seq.cumulative_logprob,
            seq.output_logprobs if group.sampling_params.logprobs is not None else None, status.finish_reason,
        )], status.finished, group.first_scheduled_time,
        group.prompt_logprobs if group.num_prompt_logprobs_missing == 0 else None, group.num_cached_tokens,
    )


def request_output(group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput | None:
    """The group's output this step (`new_counts`: seq_id -> tokens it gained); None while its
    outputs, chosen at the end, are not known yet."""
    if group.sampling_params.max_tokens == 0:
        return _output(group, _empty_outputs(group), True)
    if not group.selects_at_end:
        return _output(group, _streamed_outputs(group.seqs, new_counts, group.sampling_params.logprobs is not None),
                       group.is_finished)
    if not group.is_finished:
        return None
    return _output(group, _selected_outputs(group), True)


def _output(group: SequenceGroup, outputs: list[SequenceOutput], finished: bool) -> RequestOutput:
    return RequestOutput(group.request_id, group.prompt_token_ids, outputs, finished, group.first_scheduled_time,
                         group.complete_prompt_logprobs, group.num_cached_tokens, group.pooled)


def _empty_outputs(group: SequenceGroup) -> list[SequenceOutput]:
    """max_tokens 0: every choice empty."""
    logprobs = [] if group.sampling_params.logprobs is not None else None
    return [SequenceOutput(i, [], 0, 0.0, logprobs, "length") for i in range(group.sampling_params.n)]


def _streamed_outputs(seqs: list[Sequence], new_counts: dict[int, int], logprobs: bool) -> list[SequenceOutput]:
    outputs = []
    for seq in seqs:  # a loop, not a comprehension: most groups have one sequence
        outputs.append(SequenceOutput(  # views of the sequence's lists, not copies: this runs every step
            seq.index, seq.output_token_ids, new_counts.get(seq.seq_id, 0), seq.cumulative_logprob,
            seq.output_logprobs if logprobs else None, seq.status.finish_reason,
        ))
    return outputs


def _selected_outputs(group: SequenceGroup) -> list[SequenceOutput]:
    """The best `n`: finished beam hypotheses, or the samples of highest cumulative logprob."""
    n = group.sampling_params.n
    if group.beam is not None:
        best = [(h.token_ids, h.cumulative_logprob, None, h.finish_reason) for h in group.beam.finished[:n]]
    else:
        seqs = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        logprobs = group.sampling_params.logprobs is not None
        best = [(s.output_token_ids, s.cumulative_logprob, s.output_logprobs if logprobs else None, s.finish_reason)
                for s in seqs]
    return [SequenceOutput(i, tokens, len(tokens), cum, lps, reason)
            for i, (tokens, cum, lps, reason) in enumerate(best)]


def collect_prompt_logprobs(scored_prompts: list[PromptLogprobs], group_of_seq: dict[int, SequenceGroup]) -> None:
    """Each scored position once: a recompute after preemption scores held positions again."""
    for scored in scored_prompts:
        group = group_of_seq.get(scored.seq_id)
        if group is None or not group.needs_prompt_logprobs:
            continue
        held = group.prompt_logprobs
        for position, logprob, rank, top in zip(
            range(scored.start, scored.start + len(scored.logprobs)), scored.logprobs, scored.ranks, scored.top,
        ):
            if 0 < position < len(held) and held[position] is None:
                held[position] = [logprob, rank, top]
                group.num_prompt_logprobs_missing -= 1
