"""worker.sampler.Sampler on hand-built logits (CPU)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from common.plan_state import HeldSequence
from common.protocol import SamplingParams
from worker.sampler import Sampler, SamplingRow

EOS = 9
VOCAB = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny tensors: intra-op threads only add overhead."""


@dataclass
class Seq:
    """A sequence as the worker holds it: its tokens and params."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]

    def held(self) -> HeldSequence:
        return HeldSequence([*self.prompt, *self.output], len(self.prompt), 0, [], self.params)


class SequenceSampler:
    """The Sampler as the Executor drives it: the rows of a call arrive as new sequences (their
    tokens synced into the penalty counts), are sampled, and leave. One Sampler per vocabulary."""

    def __init__(self) -> None:
        self.samplers: dict[int, Sampler] = {}
        self.next_seq_id = 0

    def __call__(self, logits: torch.Tensor, seqs: list[Seq]):
        sampler = self.samplers.setdefault(logits.shape[1], Sampler([EOS], logits.shape[1]))
        seq_ids = list(range(self.next_seq_id, self.next_seq_id + len(seqs)))
        self.next_seq_id += len(seqs)
        sampler.token_counts.sync((i, seq.held()) for i, seq in zip(seq_ids, seqs))
        out = sampler(logits, [SamplingRow(i, seq.params, len(seq.output)) for i, seq in zip(seq_ids, seqs)])
        sampler.token_counts.free(seq_ids)
        return out


@pytest.fixture
def sampler() -> SequenceSampler:
    return SequenceSampler()


def row(prompt=(1, 2, 3), output=(), **params) -> Seq:
    return Seq(SamplingParams(**params), list(prompt), list(output))


def logits_of(*values: float, vocab: int = VOCAB, fill: float = -10.0) -> torch.Tensor:
    """One row: the given leading logits, the rest of the vocabulary far below."""
    out = torch.full((vocab,), fill)
    out[: len(values)] = torch.tensor(values)
    return out


def draw_counts(sampler, logits: torch.Tensor, n: int, **params) -> Counter:
    """n unseeded draws of one distribution, as n rows of one batch."""
    out = sampler(logits.expand(n, -1).contiguous(), [row(**params) for _ in range(n)])
    return Counter(out.token_ids)


# ----------------------------------------------------------------------------- greedy and logprobs


def test_greedy_picks_argmax(sampler):
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    out = sampler(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.top_logprobs == [[] for _ in range(8)]


def test_logprob_is_raw_log_softmax_at_chosen_token(sampler):
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 3
    rows = [
        row(temperature=0.0),
        row(temperature=0.7, seed=3),
        row(temperature=1.0, top_k=3, top_p=0.8),
        # Penalties and min_tokens change the choice, not the reported (raw) logprob.
        row(temperature=0.0, repetition_penalty=1.8, presence_penalty=1.0, output=(5, 5), min_tokens=4,
            stop_token_ids=[7]),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(lp, raw[i, tok].item(), rel_tol=1e-5, abs_tol=1e-5)


def test_top_logprobs_are_the_k_best_best_first(sampler):
    logits = torch.tensor([
        [0.1, 3.0, -1.0, 2.5, 0.0, 4.0, 1.0, -2.0],
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0],
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        [1.0, 1.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    rows = [row(temperature=0.0, logprobs=3), row(temperature=0.0, logprobs=5),
            row(temperature=0.0, logprobs=0), row(temperature=0.0)]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert [t for t, _ in out.top_logprobs[0]] == [5, 1, 3]
    assert [t for t, _ in out.top_logprobs[1]] == [0, 1, 2, 3, 4]
    assert out.top_logprobs[2] == [] and out.top_logprobs[3] == []
    for i in (0, 1):
        values = [v for _, v in out.top_logprobs[i]]
        assert values == sorted(values, reverse=True)
        for t, v in out.top_logprobs[i]:
            assert isinstance(t, int)
            assert math.isclose(v, raw[i, t].item(), rel_tol=1e-5, abs_tol=1e-5)
    # The greedy token is the best top logprob, with the same value.
    assert out.top_logprobs[0][0][0] == out.token_ids[0]
    assert math.isclose(out.top_logprobs[0][0][1], out.logprobs[0], rel_tol=1e-6)


# ----------------------------------------------------------------------------- truncation


def test_top_k_1_is_argmax_even_at_temperature_1(sampler):
    torch.manual_seed(2)
    logits = logits_of(1.0, 1.2, 1.1, 0.9)  # a near-uniform head: without top_k, other tokens win often
    assert set(draw_counts(sampler, logits, 500, top_k=1)) == {1}
    assert len(draw_counts(sampler, logits, 500)) > 1


def test_top_k_keeps_the_k_best_with_their_relative_odds(sampler):
    torch.manual_seed(3)
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    counts = draw_counts(sampler, p.log(), 4000, top_k=2)
    assert set(counts) == {1, 2}
    assert abs(counts[1] / 4000 - 4 / 7) < 0.04


def test_small_top_p_keeps_only_the_top_token(sampler):
    torch.manual_seed(4)
    logits = logits_of(1.0, 1.2, 1.1, 0.9)
    assert set(draw_counts(sampler, logits, 500, top_p=0.01)) == {1}


def test_top_p_keeps_the_smallest_prefix_reaching_it(sampler):
    torch.manual_seed(5)
    p = torch.tensor([0.5, 0.3, 0.2])
    # 0.5 < 0.7 <= 0.5 + 0.3: tokens 0 and 1 stay, token 2 goes; renormalised to 5/8, 3/8.
    counts = draw_counts(sampler, p.log(), 4000, top_p=0.7)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 4000 - 0.625) < 0.04


def test_min_p_filters_tokens_below_a_fraction_of_the_best(sampler):
    torch.manual_seed(6)
    p = torch.tensor([0.55, 0.3, 0.1, 0.05])
    counts = draw_counts(sampler, p.log(), 3000, min_p=0.15)  # threshold 0.0825: token 3 goes
    assert set(counts) == {0, 1, 2}
    counts = draw_counts(sampler, p.log(), 3000, min_p=0.5)  # threshold 0.275: tokens 2 and 3 go
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 3000 - 0.55 / 0.85) < 0.04


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_seen_logits(sampler):
    logits = logits_of(2.0, 1.5, 0.5)[None]
    assert sampler(logits, [row(temperature=0.0)]).token_ids == [0]
    # Token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.5.
    assert sampler(logits, [row(prompt=(0, 4), temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]
    # Seen in the output counts as well.
    assert sampler(logits, [row(prompt=(4,), output=(0,), temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]
    # Penalised once, not once per occurrence: 2.0 / 1.2 = 1.67 > 1.5 keeps token 0 (1.2 ** 5 would not).
    assert sampler(logits, [row(prompt=(0, 0, 0), output=(0, 0), temperature=0.0, repetition_penalty=1.2)]).token_ids == [0]
    # Unseen tokens are untouched.
    assert sampler(logits, [row(prompt=(2, 4), temperature=0.0, repetition_penalty=2.0)]).token_ids == [0]


def test_repetition_penalty_multiplies_negative_seen_logits(sampler):
    logits = logits_of(-1.0, -1.2, -3.0)[None]
    assert sampler(logits, [row(temperature=0.0)]).token_ids == [0]
    # Token 0 seen: -1.0 * 1.5 = -1.5 < -1.2. (Dividing would raise it to -0.67 and keep it.)
    assert sampler(logits, [row(prompt=(0,), temperature=0.0, repetition_penalty=1.5)]).token_ids == [1]
    # A penalty below 1 encourages repeats: token 1 seen: -1.2 * 0.5 = -0.6 > -1.0.
    assert sampler(logits, [row(prompt=(1,), temperature=0.0, repetition_penalty=0.5)]).token_ids == [1]


def test_presence_penalty_counts_output_tokens_only(sampler):
    logits = logits_of(2.0, 1.5, 0.5)[None]
    assert sampler(logits, [row(output=(0,), temperature=0.0, presence_penalty=1.0)]).token_ids == [1]
    # Presence does not grow with the count: 2.0 - 0.4 = 1.6 > 1.5 however often token 0 came out.
    assert sampler(logits, [row(output=(0, 0, 0, 0), temperature=0.0, presence_penalty=0.4)]).token_ids == [0]
    # The prompt does not count.
    assert sampler(logits, [row(prompt=(0, 0), temperature=0.0, presence_penalty=2.0)]).token_ids == [0]
    # A negative penalty encourages: token 2 out once: 0.5 + 2.0 = 2.5 > 2.0.
    assert sampler(logits, [row(output=(2,), temperature=0.0, presence_penalty=-2.0)]).token_ids == [2]


def test_frequency_penalty_grows_with_the_count(sampler):
    logits = logits_of(2.0, 1.5, 0.5)[None]
    # 2.0 - 0.2 * 2 = 1.6 > 1.5, but 2.0 - 0.2 * 3 = 1.4 < 1.5.
    assert sampler(logits, [row(output=(0, 0, 4), temperature=0.0, frequency_penalty=0.2)]).token_ids == [0]
    assert sampler(logits, [row(output=(0, 4, 0, 0), temperature=0.0, frequency_penalty=0.2)]).token_ids == [1]
    assert sampler(logits, [row(prompt=(0,) * 10, temperature=0.0, frequency_penalty=2.0)]).token_ids == [0]


def test_presence_and_frequency_add_up(sampler):
    logits = logits_of(2.0, 1.5, 0.5)[None]
    # 2.0 - 0.3 (presence) - 2 * frequency against 1.5: 0.11 gives 1.48 (token 1), 0.09 gives 1.52 (token 0).
    assert sampler(
        logits, [row(output=(0, 0), temperature=0.0, presence_penalty=0.3, frequency_penalty=0.11)]
    ).token_ids == [1]
    assert sampler(
        logits, [row(output=(0, 0), temperature=0.0, presence_penalty=0.3, frequency_penalty=0.09)]
    ).token_ids == [0]


def test_penalties_apply_per_row_only(sampler):
    logits = torch.stack([logits_of(2.0, 1.5), logits_of(2.0, 1.5)])
    out = sampler(logits, [row(output=(0,), temperature=0.0, presence_penalty=1.0), row(output=(0,), temperature=0.0)])
    assert out.token_ids == [1, 0]


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_until_reached(sampler):
    logits = logits_of(1.0, 0.5)
    logits[EOS] = 5.0
    logits = logits[None]
    for n_out, expected in [(0, 0), (2, 0), (3, EOS), (5, EOS)]:
        out = sampler(logits, [row(output=(4,) * n_out, temperature=0.0, min_tokens=3)])
        assert out.token_ids == [expected], n_out


def test_min_tokens_masks_stop_token_ids_until_reached(sampler):
    logits = logits_of(1.0, 0.5, 0.2, 4.0, 3.0)
    logits[EOS] = 2.0
    logits = logits[None]
    # Stops 3 and 4 and EOS all masked: token 0 wins.
    assert sampler(logits, [row(temperature=0.0, min_tokens=2, stop_token_ids=[3, 4])]).token_ids == [0]
    assert sampler(logits, [row(output=(1, 1), temperature=0.0, min_tokens=2, stop_token_ids=[3, 4])]).token_ids == [3]
    # Without min_tokens nothing is masked.
    assert sampler(logits, [row(temperature=0.0, stop_token_ids=[3, 4])]).token_ids == [3]


def test_min_tokens_masks_stops_when_sampling(sampler):
    torch.manual_seed(7)
    logits = logits_of(0.0, 0.0, 0.0, 3.0)
    logits[EOS] = 3.0
    counts = draw_counts(sampler, logits, 500, min_tokens=1, stop_token_ids=[3])
    assert set(counts) == {0, 1, 2}
    # Reached: the stops come back (they dominate the distribution).
    out = sampler(logits.expand(500, -1).contiguous(), [row(output=(0,), min_tokens=1, stop_token_ids=[3])] * 500)
    assert {3, EOS} <= set(out.token_ids)


# ----------------------------------------------------------------------------- seeds and statistics


def test_seeded_draw_is_independent_of_batch_and_order(sampler):
    torch.manual_seed(8)
    target_logits = torch.randn(VOCAB)
    target = row(temperature=1.0, seed=1234, output=(1, 2))
    alone = sampler(target_logits[None], [target]).token_ids[0]

    for trial in range(10):
        n_other = trial + 1
        others = torch.randn(n_other, VOCAB)
        other_rows = [row(temperature=0.9, top_p=0.9, seed=(None if j % 2 else j)) for j in range(n_other)]
        pos = trial % (n_other + 1)
        logits = torch.cat([others[:pos], target_logits[None], others[pos:]])
        rows = other_rows[:pos] + [target] + other_rows[pos:]
        assert sampler(logits, rows).token_ids[pos] == alone, trial


def test_seeded_draw_is_reproducible_and_seeds_differ(sampler):
    logits = torch.zeros(1, 64)  # uniform
    draws = [sampler(logits, [row(temperature=1.0, seed=s)]).token_ids[0] for s in range(200)]
    again = [sampler(logits, [row(temperature=1.0, seed=s)]).token_ids[0] for s in range(200)]
    assert draws == again
    assert len(set(draws)) > 40  # 200 uniform draws over 64 tokens hit ~61 distinct ones
    # One seed across the steps of a sequence (growing output) does not repeat one token forever.
    steps = [sampler(logits, [row(temperature=1.0, seed=7, output=(0,) * t)]).token_ids[0] for t in range(50)]
    assert len(set(steps)) > 10


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_temperature_1_sampling_matches_the_distribution(sampler, seeded):
    torch.manual_seed(9)
    n = 4000
    p = torch.tensor([0.5, 0.3, 0.2])
    rows = [row(temperature=1.0, seed=(i if seeded else None)) for i in range(n)]
    out = sampler(p.log().expand(n, -1).contiguous(), rows)
    counts = Counter(out.token_ids)
    assert set(counts) <= {0, 1, 2}
    for t in range(3):
        assert abs(counts[t] / n - p[t].item()) < 0.03, (t, counts)


def test_temperature_rescales_the_distribution(sampler):
    torch.manual_seed(10)
    n = 4000
    p = torch.tensor([0.6, 0.3, 0.1])
    expected = p.sqrt() / p.sqrt().sum()  # temperature 2: p ** (1 / 2), renormalised
    counts = draw_counts(sampler, p.log(), n, temperature=2.0)
    for t in range(3):
        assert abs(counts[t] / n - expected[t].item()) < 0.03, (t, counts)
    # A tiny temperature is (almost) greedy.
    assert set(draw_counts(sampler, p.log(), 300, temperature=1e-3)) == {0}


def test_greedy_and_sampled_rows_mixed(sampler):
    torch.manual_seed(11)
    logits = torch.randn(6, 40)
    rows = [row(temperature=0.0), row(temperature=1.0, seed=1), row(temperature=0.0, logprobs=2),
            row(temperature=0.5, top_k=1), row(temperature=0.0), row(temperature=1.0, seed=2)]
    out = sampler(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    for i in (0, 2, 3, 4):
        assert out.token_ids[i] == argmax[i]
    assert len(out.top_logprobs[2]) == 2 and out.top_logprobs[2][0][0] == argmax[2]
    assert out.top_logprobs[0] == [] and len(out.token_ids) == len(out.logprobs) == 6
