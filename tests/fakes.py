"""Fakes shared by the tests: a worker's executor without a model or torch.

FakeExecutor keeps the sequences it holds with common/plan_state.py, as worker/executor.py does
(so a plan the worker would refuse raises ProtocolError here too), and samples a deterministic
token, so the scheduler runs its whole loop with no model. Unless told that requests fork
(`forks=True`), it also checks that no block is in two tables.
"""
from __future__ import annotations

from collections.abc import Callable

from common.plan_state import HeldSequence, PlanState
from common.protocol import SampledToken, StepPlan, StepResult

# token_fn(seq_id, token ids so far, number of prompt tokens) -> the next token
TokenFn = Callable[[int, list[int], int], int]


def token_for(seq_id: int, num_tokens: int) -> int:
    """The fake model's next token after `num_tokens` tokens; never EOS (2)."""
    return (seq_id * 7 + num_tokens) % 1000 + 3


def expected_output(seq_id: int, num_prompt_tokens: int, max_tokens: int) -> list[int]:
    return [token_for(seq_id, num_prompt_tokens + i) for i in range(max_tokens)]


class FakeExecutor:
    """Applies each plan's diffs and samples `token_fn`'s token for every sequence that computed
    its last token, `num_samples` times (logprob -0.25); keeps every plan in `plans`."""

    def __init__(self, block_size: int, token_fn: TokenFn | None = None, forks: bool = False) -> None:
        self.state = PlanState(block_size)
        self.forks = forks
        self.plans: list[StepPlan] = []
        self.token_fn = token_fn or (lambda seq_id, tokens, num_prompt: token_for(seq_id, len(tokens)))

    @property
    def seqs(self) -> dict[int, HeldSequence]:
        return self.state.seqs

    def reset(self) -> None:
        self.state.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        scheduled = self.state.apply(plan)
        if not self.forks:
            self.state.check_unshared()
        result = StepResult(plan.step, plan.epoch)
        for s in scheduled:
            for _ in range(s.num_samples):
                token = self.token_fn(s.seq_id, s.held.token_ids, s.held.num_prompt_tokens)
                result.sampled.append(SampledToken(s.seq_id, token, -0.25, [[token, -0.25]]))
        self.state.record_sampled(result.sampled)
        return result
