"""Where a thinking model's reasoning ends, for the sampler's masks (SamplingParams'
`reasoning_end_token_ids` and `thinking_token_budget`).

A sequence whose request names the tokens that end its thinking (the reasoning parser's `</think>`,
tokenized) reasons from its first output token until those tokens appear in a row. Meanwhile its
grammar (structured output, a required tool call) waits: the grammar's matcher consumes only the
tokens after the end, so the model thinks freely and then answers in the grammar, as vLLM and
SGLang do. With a budget, once the reasoning holds that many tokens the next draws are forced to
the end tokens (the rest of them, when the reasoning already ends in their first ones).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.protocol import SamplingParams


def gated(params: SamplingParams) -> bool:
    """Whether a sequence's draws are masked: a grammar, or a thinking budget to enforce."""
    return params.structured_output is not None or params.thinking_token_budget is not None


@dataclass(slots=True)
class ReasoningGate:
    end: tuple[int, ...]  # the token ids that end the reasoning, in order (at least one)
    budget: int | None  # reasoning tokens drawn freely; None: no limit
    num_tokens: int = 0  # reasoning tokens so far, the end tokens included
    matched: int = 0  # how many of `end`'s first tokens the reasoning now ends in
    open: bool = True  # still reasoning

    @staticmethod
    def of(params: SamplingParams) -> ReasoningGate | None:
        if not params.reasoning_end_token_ids:
            return None
        return ReasoningGate(tuple(params.reasoning_end_token_ids), params.thinking_token_budget)

    def copy(self) -> ReasoningGate:
        return ReasoningGate(self.end, self.budget, self.num_tokens, self.matched, self.open)

    def forced(self) -> int | None:
        """The token the next draw must be (the budget is spent), or None: a free draw."""
        if self.budget is not None and self.num_tokens >= self.budget:
            return self.end[self.matched]
        return None

    def consume(self, token_id: int) -> None:
        """One reasoning token (call only while `open`)."""
        self.num_tokens += 1
        if token_id == self.end[self.matched]:
            self.matched += 1
        else:
            self.matched = int(token_id == self.end[0])
        if self.matched == len(self.end):
            self.open = False
