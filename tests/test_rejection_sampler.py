"""worker/rejection_sampler.py: emitted tokens keep the target's distribution whatever the draft
(chi-square over thousands of draws on a small vocabulary, a draft that disagrees often, a target
with and without top-p's zeros), and greedy accepts exactly the argmax's run."""
from __future__ import annotations

import torch

from worker.rejection_sampler import rejection_sample

DRAWS = 40_000
# chi-square critical values at 1e-4 by degrees of freedom: a seeded test, far from flaky
CRITICAL = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert not torch.any(torch.bincount(samples, minlength=len(probs))[~support]), "a token of probability 0"
    observed = torch.bincount(samples, minlength=len(probs))[support].double()
    expected = probs[support].double() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


def check_distribution(target: torch.Tensor, draft: torch.Tensor, seed: int) -> None:
    """target [k+1, V], draft [k, V]: the first emitted token ~ p_1; the second, where there is one, ~ p_2."""
    gen = torch.Generator().manual_seed(seed)
    k, vocab = draft.shape
    drafts = torch.stack([torch.multinomial(draft[i], DRAWS, replacement=True, generator=gen) for i in range(k)], 1)
    tokens, emitted = rejection_sample(target.expand(DRAWS, -1, -1), draft.expand(DRAWS, -1, -1), drafts, gen)
    assert torch.all((1 <= emitted) & (emitted <= k + 1))
    assert torch.all(tokens.gather(1, (emitted - 1)[:, None]) >= 0) and torch.all(
        (tokens >= 0).sum(1) == emitted)
    assert chi_square(tokens[:, 0], target[0]) < CRITICAL[int((target[0] > 0).sum()) - 1]
    second = tokens[emitted >= 2, 1]
    assert len(second) > DRAWS // 10  # the draft is accepted often enough to test
    assert chi_square(second, target[1]) < CRITICAL[int((target[1] > 0).sum()) - 1]


def test_emitted_tokens_keep_the_target_distribution_under_a_draft_that_disagrees():
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.4, 0.3, 0.2, 0.05, 0.05], [0.2] * 5])
    draft = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.05, 0.05, 0.1, 0.3, 0.5]])
    check_distribution(target, draft, seed=0)


def test_a_top_p_target_with_zeros_and_an_ngram_draft_one_hot():
    """Top-p left the target 4 tokens (one at zero); the n-gram draft is one-hot at a token the
    target gives 0.25, and at one it gives nothing."""
    target = torch.tensor([[0.25, 0.25, 0.5, 0.0, 0.0], [0.1, 0.0, 0.3, 0.3, 0.3], [0.2] * 5])
    draft = torch.zeros(2, 5)
    draft[0, 1] = draft[1, 3] = 1.0
    check_distribution(target, draft, seed=1)


def test_greedy_accepts_exactly_the_run_of_argmaxes_and_then_emits_the_argmax():
    argmax = torch.tensor([[2, 0, 1, 3]])  # the target's choice at each of k+1 = 4 positions
    target = torch.nn.functional.one_hot(argmax, 5).double().expand(3, -1, -1)
    drafts = torch.tensor([[2, 0, 1], [2, 4, 1], [0, 0, 1]])
    draft = torch.nn.functional.one_hot(drafts, 5).double()
    tokens, emitted = rejection_sample(target, draft, drafts, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [[2, 0, 1, 3], [2, 0, -1, -1], [2, -1, -1, -1]]
    assert emitted.tolist() == [4, 2, 1]
