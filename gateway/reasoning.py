"""Reasoning output on /v1/chat/completions (--reasoning-parser): the model's thinking split from
its answer, as `message.reasoning_content` and `message.reasoning` (vLLM's older and newer names)
beside `content`, streamed as `delta.reasoning_content` and `delta.reasoning`.

    parser        the output                           no end tag in the output
    deepseek_r1   [<think>] reasoning </think> answer  all reasoning (the template opened the block)
    qwen3         [<think>] reasoning </think> answer  all reasoning, unless chat_template_kwargs
                  (or reasoning <tool_call><function=   says enable_thinking: false (then all answer)
                  ...: the call is the answer)
    openai_gptoss harmony (gpt-oss, gateway/harmony.py):  what the analysis messages said, each
                  the analysis channel's messages, then   on its own line (the answer: none)
                  a final message (its body is the
                  answer) or a tool call's (the answer
                  from its header on, for the tool parser)

Before the first end tag everything is reasoning, whether or not the output opened the block
(its first opening tag is dropped); after it, everything is the answer. A prompt that already
closed the block (the template's "thinking off": it ends with `</think>`) makes the whole output
the answer, as vLLM's serving layer does with `is_reasoning_end` on the prompt.

A parser scans the output so far (`scan(text, final)`), as the tool parsers do: the reasoning sure
so far (holding back an end of the text that could still become a tag) and where the answer
starts. The whole message (`ReasoningStream.split`) and the streamed deltas (`feed`) both come
from it, so the deltas add up to the message however the tags are cut into tokens.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.config import REASONING_PARSERS
from gateway import harmony


@dataclass(frozen=True, slots=True)
class ReasoningScan:
    reasoning: str  # the reasoning sure so far, tags left out (after a final scan: all of it)
    answer_start: int | None  # text[answer_start:] is the answer; None while the model still thinks


class ReasoningParser(Protocol):
    tags: tuple[str, ...]  # the format's markers: they must stay in the text the parser sees
    end: str  # the tag that ends the thinking: the worker's thinking budget forces its tokens

    def thinking(self, prompt_tail: str, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the output starts in reasoning, from the prompt's last text and the template's kwargs."""

    def scan(self, text: str, final: bool) -> ReasoningScan: ...


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class ThinkParser:
    """`<think>reasoning</think>answer`, the opening tag optional. `switch`: a chat template kwarg
    that, false, turns thinking off (Qwen3's enable_thinking). `implicit_end`: (tag, what follows
    it): that tag, followed after whitespace by that text, also ends the thinking and starts the
    answer (Qwen3.5's `<tool_call>` then `<function=`, a call made without closing the thinking)."""

    start: str = "<think>"
    end: str = "</think>"
    switch: str | None = None
    implicit_end: tuple[str, str] | None = None

    @property
    def tags(self) -> tuple[str, ...]:
        return (self.start, self.end)

    def thinking(self, prompt_tail: str, template_kwargs: Mapping[str, Any]) -> bool:
        if self.switch is not None and template_kwargs.get(self.switch) is False:
            return False
        return not prompt_tail.rstrip().endswith(self.end)

    def scan(self, text: str, final: bool) -> ReasoningScan:
        end = text.find(self.end)
        before_end = text if end < 0 else text[:end]
        implicit, pending = self._implicit(before_end, final or end >= 0)
        if implicit is not None:
            return ReasoningScan(self._without_start(text[:implicit]), implicit)
        if end >= 0:
            return ReasoningScan(self._without_start(text[:end]), end + len(self.end))
        if final:
            return ReasoningScan(self._without_start(text), None)
        held = max(_partial_suffix(text, tag) for tag in self._held_tags(text))
        sure = min(len(text) - held, len(text) if pending is None else pending)
        return ReasoningScan(self._without_start(text[:sure]), None)

    def _held_tags(self, text: str) -> list[str]:
        """The tags a partial end of the text may still become."""
        tags = [self.end] + ([] if self.start in text else [self.start])
        return tags + ([self.implicit_end[0]] if self.implicit_end else [])

    def _implicit(self, text: str, final: bool) -> tuple[int | None, int | None]:
        """(where an implicit end starts the answer, or None; where one may still come, or None)."""
        if self.implicit_end is None:
            return None, None
        tag, follows = self.implicit_end
        at = text.find(tag)
        while at >= 0:
            after = text[at + len(tag):].lstrip()
            if after.startswith(follows):
                return at, None
            if not final and follows.startswith(after):
                return None, at
            at = text.find(tag, at + 1)
        return None, None

    def _without_start(self, reasoning: str) -> str:
        return reasoning.replace(self.start, "", 1)


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    """gpt-oss's harmony messages (gateway/harmony.py). `end`: the tokens the thinking budget
    forces (and the structured-output gate waits for) close the analysis and open the final message."""

    tags = harmony.TAGS
    end = harmony.END + harmony.START + "assistant" + harmony.CHANNEL + "final" + harmony.MESSAGE

    def thinking(self, prompt_tail: str, template_kwargs: Mapping[str, Any]) -> bool:
        return True  # every gpt-oss turn opens with a channel: one that is not analysis is the answer

    def scan(self, text: str, final: bool) -> ReasoningScan:
        is_harmony = harmony.is_harmony(text)
        if is_harmony is False or (is_harmony is None and final):
            return ReasoningScan("", 0)
        if is_harmony is None:
            return ReasoningScan("", None)
        reasoning = []
        for message in harmony.messages(text):
            if message.channel != "analysis" or message.recipient is not None:  # (a call from any channel)
                final_body = message.channel == "final" and message.recipient is None
                return ReasoningScan("\n".join(reasoning), message.body_start if final_body else message.header_start)
            body = text[message.body_start:message.body_end]
            if not message.closed and not final:  # hold back what could still be a tag
                body = body[:len(body) - max(_partial_suffix(body, tag) for tag in harmony.BODY_ENDS)]
            reasoning.append(body)
        return ReasoningScan("\n".join(reasoning), None)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ThinkParser(),
    "qwen3": ThinkParser(switch="enable_thinking", implicit_end=("<tool_call>", "<function")),
    "openai_gptoss": HarmonyParser(),
}
assert set(PARSERS) == set(REASONING_PARSERS)


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """--reasoning-parser NAME (None: reasoning is not parsed)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return PARSERS[name]


@dataclass(slots=True)
class ReasoningStream:
    """One choice's output as reasoning and answer: whole (`split`) or as deltas (`feed`), and
    the tokens spent thinking (`num_tokens`).

        text                            fed so far (released)
        reasoning[:reasoning_sent]      sent as reasoning deltas
        text[answer_start:][:answer_sent]  sent on as the answer
    """

    parser: ReasoningParser
    thinking: bool  # the output starts in reasoning (ReasoningParser.thinking)
    text: str = ""
    reasoning_sent: int = 0
    answer_sent: int = 0
    token_ends: list[int] = field(default_factory=list)  # per token, the length of the output's text after it

    def _scan(self, text: str, final: bool) -> ReasoningScan:
        return self.parser.scan(text, final) if self.thinking else ReasoningScan("", 0)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output as (reasoning, or None when there is none; the answer's text)."""
        scan = self._scan(text, True)
        answer = "" if scan.answer_start is None else text[scan.answer_start:]
        return scan.reasoning or None, answer

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """The reasoning and the answer text that `delta`, the output's next released text, adds
        (`final`: its last)."""
        self.text += delta
        scan = self._scan(self.text, final)
        reasoning, self.reasoning_sent = scan.reasoning[self.reasoning_sent:], len(scan.reasoning)
        if scan.answer_start is None:
            return reasoning, ""
        answer = self.text[scan.answer_start + self.answer_sent:]
        self.answer_sent += len(answer)
        return reasoning, answer

    def observe(self, text: str) -> None:
        """After each token: `text`, the output so far."""
        self.token_ends.append(len(text))

    def num_tokens(self, text: str) -> int:
        """reasoning_tokens of the whole output `text`: the tokens up to the one whose text reaches
        the answer (the one that completes `</think>`); all of them when thinking never ends; none
        when the prompt turned thinking off."""
        if not self.thinking:
            return 0
        start = self._scan(text, True).answer_start
        if start is None:
            return len(self.token_ends)
        return min(bisect_left(self.token_ends, start) + 1, len(self.token_ends))


def reasoning_tokens(outputs: list[tuple[ReasoningStream | None, str]]) -> dict | None:
    """usage.completion_tokens_details of the choices' (reasoning stream, text); None when they do
    not parse reasoning."""
    if not outputs or outputs[0][0] is None:
        return None
    return {"reasoning_tokens": sum(stream.num_tokens(text) for stream, text in outputs)}
