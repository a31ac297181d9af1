"""worker.sampler.Sampler on hand-built logits, its batched paths against a per-row reference, no host
sync in a step, and the penalty counts it keeps per sequence (CPU; one test on a GPU)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from common.plan_state import HeldSequence
from common.protocol import SamplingParams, num_beam_candidates, sample_seed
from tests.conftest import TINY_LLAMA
from worker.sampler import Sampler, SamplingRow, argmax
from worker.seeded_noise import noise_key, seeded_gumbel

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


@pytest.mark.parametrize("vocab", [4096, 5000, 6143])
def test_blocked_argmax_is_torch_argmax(vocab):
    """The CPU argmax by blocks returns argmax's index: the first of tied bests, the first NaN,
    a best in the short last block, on rows read through a stride."""
    x = torch.randn(16, vocab, generator=torch.Generator().manual_seed(vocab))
    x[1] = 0.0
    x[2, ::7] = 5.0  # ties in many blocks
    x[3, -1] = 100.0
    x[4, -3:] = 100.0
    x[5] = float("-inf")
    x[6, [17, 4000]] = float("nan")
    x[7, -5:] = float("nan")
    x[8] = float("inf")
    x[9, [1023, 1024]] = 9.0  # tied across a block edge
    x[10] = x[10].bfloat16().float()
    for t in (x, x[:, : vocab - 1], x[::2]):
        assert argmax(t).tolist() == t.argmax(dim=-1).tolist()


def test_logprobs_over_a_large_batch(sampler):
    """More rows and vocabulary than one chunk of the CPU's logsumexp, greedy by blocks: each
    token is argmax, each logprob log_softmax's, and a row that reports top logprobs reports
    its token's with the same value to the bit."""
    logits = torch.randn(300, 5000, generator=torch.Generator().manual_seed(3)) * 4
    rows = [row(temperature=0.0, logprobs=2 if i % 50 == 0 else None) for i in range(300)]
    out = sampler(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    # float32: a sum of 5,000 exponentials rounds by a few 1e-6, its digits set by the CPU's vector
    # width (torch's own float32 log_softmax of these logits is 5e-6 off on an AVX2 CPU)
    assert out.logprobs == pytest.approx(exact.tolist(), rel=0, abs=1e-5)
    raw = torch.log_softmax(logits, dim=-1)
    for i in range(0, 300, 50):
        assert out.top_logprobs[i][0] == [out.token_ids[i], out.logprobs[i]]
        assert out.logprobs[i] == raw[i, out.token_ids[i]].item()


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


# ----------------------------------------------------------------------------- a per-row reference


def reference_logits(logits: torch.Tensor, seq: Seq) -> torch.Tensor:
    """One row's logits after the penalties and the min_tokens mask, counted from its token lists."""
    p, x, vocab = seq.params, logits.clone(), logits.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[sorted(set(seq.prompt + seq.output))] = True
        penalty = torch.tensor(p.repetition_penalty)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(torch.tensor(seq.output, dtype=torch.int64), minlength=vocab).float()
        x = x - (torch.tensor(p.frequency_penalty) * counts + torch.tensor(p.presence_penalty) * (counts > 0).float())
    if len(seq.output) < p.min_tokens:
        stops = p.stop_token_ids + ([] if p.ignore_eos else [EOS])
        x[[t for t in stops if t < vocab]] = float("-inf")
    return x


def reference_kept(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens temperature, top-k, top-p and min-p keep, over the whole vocabulary: [vocab] bool."""
    vocab = x.shape[0]
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < p.top_k < vocab:
        keep &= x >= x.sort(descending=True).values[p.top_k - 1]
    if p.top_p < 1.0:
        probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
        keep[order[drop]] = False
    if p.min_p > 0:
        keep &= ~(x < x.masked_fill(~keep, float("-inf")).max() + torch.tensor(math.log(p.min_p)))
    return keep


def reference_sample(logits: torch.Tensor, seq: Seq, index: int) -> tuple[int | None, set[int]]:
    """(the token of sample `index`, None where unseeded; the tokens it may draw)."""
    x = reference_logits(logits, seq)
    p = seq.params
    if p.greedy:
        token = int(x.argmax())
        return token, {token}
    x = x / torch.tensor(p.temperature)
    keep = reference_kept(x, p)
    seed = sample_seed(p.seed, index)
    if seed is None:
        return None, set(keep.nonzero()[:, 0].tolist())
    noise = seeded_gumbel(torch.arange(x.shape[0])[None], torch.tensor([[noise_key(seed, len(seq.output))]]))[0]
    token = int((x.masked_fill(~keep, float("-inf")) + noise).argmax())
    return token, {token}


def reference_top(logits: torch.Tensor, p: SamplingParams) -> tuple[list[int], torch.Tensor]:
    k = p.logprobs or 0
    if p.beam_width:
        k = max(k, num_beam_candidates(p.beam_width, 1))
    values, ids = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[0]))
    return ids.tolist(), values


@st.composite
def sequences(draw, vocab: int) -> tuple[Seq, int]:
    """(a sequence with random sampling params, its number of samples)."""
    greedy = draw(st.integers(0, 3)) == 0
    beam_width = draw(st.sampled_from([0, 0, 0, 0, 2])) if greedy else 0
    num_samples = 1 if beam_width else draw(st.sampled_from([1, 1, 1, 2, 3]))
    params = SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.3, 0.8, 1.0, 1.7])),
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        top_k=draw(st.sampled_from([0, 0, -1, 1, 3, 10, vocab - 1, vocab, vocab + 5])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.5]) | st.floats(0.05, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.02, 0.2])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.8, 1.3])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5, -0.4])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.3, -0.2])),
        min_tokens=draw(st.integers(0, 4)), stop_token_ids=draw(st.lists(st.integers(0, vocab + 3), max_size=3)),
        ignore_eos=draw(st.booleans()), logprobs=draw(st.none() | st.integers(0, 6)), beam_width=beam_width,
        n=1, best_of=num_samples if num_samples > 1 else None, max_tokens=None,
    )
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=10))
    return Seq(params, prompt, output), num_samples


def sync_growing(sampler: Sampler, seq_ids: list[int], seqs: list[Seq], arrived: list[int]) -> None:
    """Bring the sequences into the counts as a worker would: each arrives with the first
    `arrived` tokens of its output, then takes the rest one token per step."""
    held = [HeldSequence(s.prompt + s.output[:a], len(s.prompt), 0, [], s.params) for s, a in zip(seqs, arrived)]
    sampler.token_counts.sync(zip(seq_ids, held))
    for step in range(max((len(s.output) for s in seqs), default=0)):
        for h, s in zip(held, seqs):
            if h.num_tokens < len(s.prompt) + len(s.output):
                h.token_ids.append(s.output[h.num_tokens - len(s.prompt)])
        sampler.token_counts.sync(zip(seq_ids, held))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), vocab=st.sampled_from([16, 64, 300]), logits_seed=st.integers(0, 2**32 - 1))
def test_batched_paths_match_a_per_row_reference(data, vocab, logits_seed):
    batch = data.draw(st.lists(sequences(vocab), min_size=1, max_size=8))
    seqs = [s for s, _ in batch]
    arrived = [data.draw(st.integers(0, len(s.output))) for s in seqs]
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(logits_seed)) * 3
    sampler = Sampler([EOS], vocab)
    # Rows reused: sequences that came and went before this batch.
    gone = [Seq(SamplingParams(frequency_penalty=1.0), [i], [i, i]) for i in range(9)]
    sampler.token_counts.sync((100 + i, seq.held()) for i, seq in enumerate(gone))
    sampler.token_counts.free(range(100, 109, 2))
    sync_growing(sampler, list(range(len(seqs))), seqs, arrived)

    out = sampler(logits, [SamplingRow(i, s.params, len(s.output), n) for i, (s, n) in enumerate(batch)])

    j = 0
    for i, (seq, num_samples) in enumerate(batch):
        raw = torch.log_softmax(logits[i], dim=-1)
        top_ids, top_values = reference_top(logits[i], seq.params)
        for index in range(num_samples):
            token, allowed = reference_sample(logits[i], seq, index)
            got = out.token_ids[j]
            if token is not None:
                assert got == token, (i, index, seq)
            assert got in allowed, (i, index, seq)
            assert out.logprobs[j] == pytest.approx(raw[got].item(), abs=1e-6)
            assert [t for t, _ in out.top_logprobs[j]] == top_ids
            assert [v for _, v in out.top_logprobs[j]] == pytest.approx(top_values.tolist(), abs=1e-6)
            j += 1
    assert j == len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), logits_seed=st.integers(0, 2**32 - 1))
def test_a_seeded_row_draws_the_same_token_in_any_batch(data, logits_seed):
    """Alone or among rows of every other path (other top-k widths, unseeded neighbours, fan-out),
    at any position: a seeded row's tokens depend on its seed, its output length and its logits."""
    vocab = 64
    target, num_samples = data.draw(sequences(vocab).filter(lambda b: b[0].params.seed is not None))
    others = data.draw(st.lists(sequences(vocab), max_size=6))
    position = data.draw(st.integers(0, len(others)))
    generator = torch.Generator().manual_seed(logits_seed)
    target_logits = torch.randn(vocab, generator=generator) * 3
    other_logits = torch.randn(len(others), vocab, generator=generator) * 3

    def draw(batch, logits):
        sampler = Sampler([EOS], vocab)
        sampler.token_counts.sync((i, s.held()) for i, (s, _) in enumerate(batch))
        out = sampler(logits, [SamplingRow(i, s.params, len(s.output), n) for i, (s, n) in enumerate(batch)])
        start = sum(n for _, n in batch[:position]) if len(batch) > 1 else 0
        return out.token_ids[start:start + num_samples]

    alone = draw([(target, num_samples)], target_logits[None])
    batch = others[:position] + [(target, num_samples)] + others[position:]
    logits = torch.cat([other_logits[:position], target_logits[None], other_logits[position:]])
    assert draw(batch, logits) == alone


# ----------------------------------------------------------------------------- no host sync


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# Ops that read a value back to the host or whose output shape depends on the data (both wait for
# the device on a GPU).
SYNCING_OPS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.nonzero",
               "aten.masked_select", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
               "aten.bincount", "aten.repeat_interleave", "aten.allclose"}


def mixed_batch(vocab: int) -> tuple[list[Seq], list[int]]:
    """Every path at once: greedy, top-k, top-p, full vocabulary, min-p, seeded and not, penalties,
    min_tokens, fan-out, logprobs, beam search."""
    seqs = [
        row(temperature=0.0),
        row(temperature=0.0, beam_width=2, n=2, logprobs=1),
        row(temperature=0.8, top_k=5, top_p=0.9, seed=1, frequency_penalty=0.5, presence_penalty=0.5, output=(3, 3, 4)),
        row(temperature=0.8, top_k=7, min_p=0.1),
        row(temperature=1.0, top_p=0.7, seed=2, repetition_penalty=1.3, output=(5,), logprobs=3),
        row(temperature=1.0, top_p=0.8),
        row(temperature=1.2, min_p=0.05, seed=3, min_tokens=2, stop_token_ids=[4]),
        row(temperature=0.7, best_of=3, seed=4, logprobs=2),
    ]
    return seqs, [1, 1, 1, 1, 1, 1, 1, 3]


def test_a_step_reads_the_device_back_once(monkeypatch):
    vocab = 64
    seqs, num_samples = mixed_batch(vocab)
    sampler = Sampler([EOS], vocab)
    logits = torch.randn(len(seqs), vocab)
    rows = [SamplingRow(i, s.params, len(s.output), n) for i, (s, n) in enumerate(zip(seqs, num_samples))]
    reads = Counter()
    for name in ("tolist", "item", "cpu", "numpy", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k: (
            reads.update([_name]), _real(self, *a, **k))[1])
    with OpLog() as log:
        sampler.token_counts.sync((i, s.held()) for i, s in enumerate(seqs))
        batch = sampler.sample(logits, rows)
    assert not SYNCING_OPS & set(log.ops) and not reads
    assert {"aten.topk", "aten.sort", "aten.index_add_"} <= set(log.ops)  # the paths did run
    out = batch.to_host()
    assert reads == {"tolist": 1}
    assert len(out.token_ids) == sum(num_samples)



def test_a_decode_sync_costs_the_same_tensor_ops_at_any_batch():
    """One token per sequence: the counts take it in a fixed number of tensor ops, none per row."""
    def decode_ops(batch: int) -> list[str]:
        sampler = Sampler([EOS], 64)
        held = [Seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [1, 2], [i % 64]).held()
                for i in range(batch)]
        sampler.token_counts.sync(enumerate(held))
        for i, h in enumerate(held):
            h.token_ids.append((7 * i) % 64)
        with OpLog() as log:
            sampler.token_counts.sync(enumerate(held))
        for i, h in enumerate(held):
            assert_counts(sampler, i, Seq(h.sampling_params, h.token_ids[:2], h.token_ids[2:]))
        return log.ops

    ops = decode_ops(40)
    assert decode_ops(3) == ops
    # 14 today (22 when rows and token ids went to the device apart): each op may hand the GIL over.
    assert ops.count("aten.index_add_") == 1 and len(ops) <= 14

@pytest.mark.gpu
def test_a_step_does_not_sync_the_gpu():
    vocab = 512
    seqs, num_samples = mixed_batch(vocab)
    sampler = Sampler([EOS], vocab, "cuda")
    logits = torch.randn(len(seqs), vocab, device="cuda")
    rows = [SamplingRow(i, s.params, len(s.output), n) for i, (s, n) in enumerate(zip(seqs, num_samples))]
    sampler.token_counts.sync((i, s.held()) for i, s in enumerate(seqs))
    sampler.sample(logits, rows).to_host()  # warm up (the pinned host blocks)
    sampler.token_counts.free(range(len(seqs)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.token_counts.sync((i, s.held()) for i, s in enumerate(seqs))
        batch = sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = batch.to_host()
    cpu = Sampler([EOS], vocab)
    cpu.token_counts.sync((i, s.held()) for i, s in enumerate(seqs))
    expected = cpu(logits.cpu(), rows)
    seeded_or_greedy = [j for j, (s, n) in enumerate((s, n) for s, n in zip(seqs, num_samples) for _ in range(n))
                        if s.params.greedy or s.params.seed is not None]
    assert [out.token_ids[j] for j in seeded_or_greedy] == [expected.token_ids[j] for j in seeded_or_greedy]


# ----------------------------------------------------------------------------- the penalty counts


def expected_counts(seq: Seq, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output counts, penalty, seen) of one sequence, counted from scratch."""
    counts = torch.bincount(torch.tensor(seq.output, dtype=torch.int64), minlength=vocab).float()
    p = seq.params
    penalty = torch.tensor(p.frequency_penalty) * counts + torch.tensor(p.presence_penalty) * (counts > 0).float()
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[seq.prompt + seq.output] = True
    return counts, penalty, seen


def assert_counts(sampler: Sampler, seq_id: int, seq: Seq) -> None:
    counts = sampler.token_counts
    row = counts.row(seq_id)
    expected = expected_counts(seq, counts.vocab_size)
    for got, want in zip((counts.output_counts[row], counts.penalty[row], counts.seen[row]), expected):
        assert torch.equal(got, want)


def test_token_counts_grow_with_the_sequence_and_reuse_freed_rows():
    vocab = 20
    sampler = Sampler([EOS], vocab)
    counts = sampler.token_counts
    a = Seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [1, 2, 2], [3])
    b = Seq(SamplingParams(repetition_penalty=1.5), [4], [])
    plain = Seq(SamplingParams(), [5], [6])
    held = {0: a.held(), 1: b.held(), 2: plain.held()}
    counts.sync(held.items())
    assert set(counts.seqs) == {0, 1}  # no row for a sequence without penalties
    for token in (3, 7, 3):
        held[0].token_ids.append(token)
        a.output.append(token)
        counts.sync(held.items())
        assert_counts(sampler, 0, a)
        assert_counts(sampler, 1, b)
    assert counts.output_counts[counts.row(0), 3] == 3 and counts.penalty[counts.row(0), 3] == 0.5 * 3 + 0.25
    row_a = counts.row(0)
    counts.free([0, 2])
    # A new sequence takes the freed row, cleared of a's counts.
    c = Seq(SamplingParams(presence_penalty=1.0), [8], [9])
    counts.sync([(5, c.held())])
    assert counts.row(5) == row_a
    assert_counts(sampler, 5, c)
    # Growing past the rows allocated keeps every row's counts.
    more = {10 + i: Seq(SamplingParams(frequency_penalty=0.1 * i), [i], [i, i + 1]) for i in range(1, 12)}
    counts.sync((i, s.held()) for i, s in more.items())
    assert counts.output_counts.shape[0] >= 13
    for seq_id, seq in [(1, b), (5, c), *more.items()]:
        assert_counts(sampler, seq_id, seq)
    counts.reset()
    assert counts.seqs == {} and len(counts.free_rows) == counts.output_counts.shape[0]


def test_the_executor_keeps_the_counts_in_step_with_the_held_sequences(monkeypatch):
    """Through forks (n > 1), preemption by recompute and finished sequences: after every step
    finished, the sampler counts exactly the sequences the worker holds with penalties, from their
    tokens (with the next plan launched already, its tokens fed on the device counted there)."""
    from pagoda.offline import LLM

    llm = LLM(f"dummy:{TINY_LLAMA}", device="cpu", num_gpu_blocks=24, block_size=8)
    assert llm.config.async_scheduling
    executor = llm.executor
    finish, checked = executor.finish, []

    def checked_finish():
        result = finish()
        counts = executor.sampler.token_counts
        penalized = {i for i, h in executor.state.seqs.items() if h.sampling_params.frequency_penalty}
        assert set(counts.seqs) == penalized
        for seq_id in penalized:
            h = executor.state.seqs[seq_id]
            assert_counts(executor.sampler, seq_id,
                          Seq(h.sampling_params, h.token_ids[:h.num_prompt_tokens], h.token_ids[h.num_prompt_tokens:]))
        checked.append(len(penalized))
        return result

    monkeypatch.setattr(executor, "finish", checked_finish)
    penalized = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, ignore_eos=True,
                               frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.2)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[3 + i * 7 + j for j in range(10 + 10 * i)] for i in range(4)]
    llm.generate(prompts, [penalized, plain, penalized, plain], use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert max(checked) >= 4 and checked[-1] == 0


# ----------------------------------------------------------------------------- logit_bias and grammar masks


def test_logit_bias_adds_exactly_per_row_batched_with_unbiased_rows(sampler):
    logits = torch.stack([logits_of(1.0, 3.0)] * 5)
    out = sampler(logits, [
        row(temperature=0, logit_bias=[[0, 2.5]]),  # 3.5 > 3.0: token 0
        row(temperature=0, logit_bias=[[0, 1.5]]),  # 2.5 < 3.0: still token 1
        row(temperature=0),  # unbiased, between biased rows
        row(temperature=0, logit_bias=[[1, -100], [0, -100]]),  # both best gone: the first of the -10s
        row(temperature=0, logit_bias=[[7, 100], [VOCAB + 5, 100]]),  # -10 + 100; an id past the vocabulary: ignored
    ])
    assert out.token_ids == [0, 1, 1, 2, 7]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs == pytest.approx([raw[0].item(), raw[1].item(), raw[1].item(), raw[2].item(), raw[7].item()])


def test_logit_bias_applies_after_penalties_and_before_min_tokens(sampler):
    logits = torch.stack([logits_of(3.0, 2.0)] * 2)
    out = sampler(logits, [
        row(temperature=0, output=[0], presence_penalty=2.0, logit_bias=[[0, 0.5]]),  # 3 - 2 + 0.5 < 2: token 1
        row(temperature=0, min_tokens=1, logit_bias=[[EOS, 100]]),  # EOS stays masked before min_tokens
    ])
    assert out.token_ids == [1, 0]


def bitmask_of(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's packing: bit t % 32 of int32 word t // 32 set where token t is allowed."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for i, tokens in enumerate(allowed):
        for t in tokens:
            words[i, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize("constrained_rows", [[0, 2], [0, 1, 2]], ids=["some rows", "every row"])
def test_a_grammar_mask_makes_the_draws_pick_allowed_tokens(constrained_rows):
    from worker.grammar import TokenMask

    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    allowed = {0: {3, 7, 40}, 1: {99}, 2: {64}}
    mask = TokenMask(constrained_rows, bitmask_of([allowed[r] for r in constrained_rows], vocab))
    rows = [SamplingRow(0, SamplingParams(temperature=0, logprobs=1), 0),
            SamplingRow(1, SamplingParams(temperature=0), 0),
            SamplingRow(2, SamplingParams(temperature=1.0, best_of=3, n=1), 0, num_samples=3)]
    before = logits.clone()
    out = Sampler([EOS], vocab)(logits, rows, mask)
    assert torch.equal(logits, before)  # the runner's logits are not written
    best_of_0 = max(allowed[0], key=lambda t: logits[0, t].item())
    expected_1 = 99 if 1 in constrained_rows else logits[1].argmax().item()
    assert out.token_ids == [best_of_0, expected_1, 64, 64, 64]  # the 3 samples of row 2 share its mask
    raw = torch.log_softmax(logits, dim=-1)  # logprobs stay the unconstrained distribution's
    assert out.logprobs == pytest.approx([raw[0, best_of_0].item(), raw[1, expected_1].item()] + [raw[2, 64].item()] * 3)
    assert out.top_logprobs[0] == [[raw[0].argmax().item(), pytest.approx(raw[0].max().item())]]


def test_the_grammar_mask_equals_xgrammars_own():
    xgr = pytest.importorskip("xgrammar")
    from worker.grammar import TokenMask

    vocab = 1000
    torch.manual_seed(1)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(6, vocab)
    reference = logits.clone()
    reference[[1, 2, 4, 5]] = torch.where(
        ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :vocab],
        logits[[1, 2, 4, 5]], float("-inf"))
    sampler = Sampler([EOS], vocab)
    masked = sampler._apply_token_mask(logits, False, TokenMask([1, 2, 4, 5], bitmask))
    assert torch.equal(masked, reference)
    one = logits[[1, 2, 4, 5]].clone()
    xgr.apply_token_bitmask_inplace(one, bitmask)
    assert torch.equal(masked[[1, 2, 4, 5]], one)


def test_a_finished_grammar_wins_over_min_tokens():
    """Rows under min_tokens: one whose grammar allows only EOS ends (its stops are not masked, the
    row is never all -inf, top-p draws no NaN); one whose grammar allows EOS and 5 keeps EOS masked;
    an unconstrained one keeps min_tokens' mask."""
    from worker.grammar import TokenMask

    logits = logits_of(4.0, 1.0, 0.5, 0.2, 0.1, 0.3)[None].expand(4, -1).contiguous()
    mask = TokenMask([0, 1, 2], bitmask_of([{EOS}, {EOS}, {EOS, 5}], VOCAB))
    rows = [SamplingRow(0, SamplingParams(temperature=0, min_tokens=5), 1),
            SamplingRow(1, SamplingParams(temperature=1.0, top_p=0.5, min_tokens=5, seed=3), 1),
            SamplingRow(2, SamplingParams(temperature=0, min_tokens=5), 1),
            SamplingRow(3, SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[0]), 1)]
    out = Sampler([EOS], VOCAB)(logits, rows, mask)
    assert out.token_ids == [EOS, EOS, 5, 1]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs == pytest.approx([raw[EOS].item(), raw[EOS].item(), raw[5].item(), raw[1].item()])


@pytest.mark.gpu
def test_grammar_masks_and_logit_bias_on_the_gpu_draw_as_on_the_cpu():
    from worker.grammar import TokenMask

    vocab = 512
    torch.manual_seed(2)
    logits = torch.randn(4, vocab)
    rows = [SamplingRow(0, SamplingParams(temperature=0, logit_bias=[[5, 100]]), 0),
            SamplingRow(1, SamplingParams(temperature=0), 0),
            SamplingRow(2, SamplingParams(temperature=0.9, seed=3, logit_bias=[[9, -100]]), 0),
            SamplingRow(3, SamplingParams(temperature=0.9, seed=4, best_of=2), 0, num_samples=2)]
    mask = TokenMask([1, 2, 3], bitmask_of([{1, 300}, {9, 10, 11, 400}, {17, 18}], vocab))
    expected = Sampler([EOS], vocab)(logits, rows, mask)
    out = Sampler([EOS], vocab, "cuda")(logits.cuda(), rows, mask)
    assert out.token_ids == expected.token_ids and out.token_ids[0] == 5 and out.token_ids[2] in (10, 11, 400)
