"""gpt-oss's harmony format, as its output reads once decoded with the format's special tokens
kept: the messages, their channels and recipients. gateway/reasoning.py's `HarmonyParser`
(--reasoning-parser openai_gptoss) and gateway/tool_parsers.py's `HarmonyToolParser`
(--tool-call-parser openai; vLLM's names for both) read it.

The model writes messages, each a header then a body:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER                   (then <|return|>: EOS)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}
                                                                          (then <|call|>: EOS)

(the chat template ends the prompt with `<|start|>assistant`, so the first header has no start;
a header may name its recipient before the channel, `<|start|>assistant to=functions.NAME<|channel|>...`).
The reasoning is the analysis messages' bodies, one a line; the answer starts at the first message
of another channel, or with a recipient (a call, from any channel): after the final message's
header (its body is the content), or at a tool call's header, which the tool parser reads. An
output with no harmony header at all is the answer. Served with --tool-call-parser openai (named,
or detected from the template), the reasoning parser comes too (gateway/tokenizer.py).

The `openai-harmony` package is the field's renderer and parser of this format, over the token ids
of gpt-oss's own vocabulary (o200k_harmony, which it downloads on first use); reading the decoded
text instead, as the other parsers here do, works on any tokenizer that names the tags (the test
models' too) and with no download.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
TAGS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
BODY_ENDS = (END, CALL, RETURN, START)  # a body ends at one (or at the end of the output)
HEADERS = (START, CHANNEL)  # a message's header begins with one
_RECIPIENT = re.compile(r"\bto=functions\.([\w.\-]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True, slots=True)
class Message:
    header_start: int
    header: str  # between the message's first tag and <|message|>
    body_start: int
    body_end: int  # where its body ends (its end tag, or the text's end)
    closed: bool  # a tag ends the body

    @property
    def channel(self) -> str | None:
        match = _CHANNEL.search(self.header)
        return match[1] if match else None

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header)
        return match[1] if match else None


def messages(text: str, at: int = 0) -> list[Message]:
    """The messages from `at` on whose headers are whole (a header still being written is not one)."""
    out: list[Message] = []
    while True:
        start = _skip_tags(text, at)
        body = text.find(MESSAGE, start)
        if body < 0:
            return out
        body_start = body + len(MESSAGE)
        ends = [i for i in (text.find(tag, body_start) for tag in BODY_ENDS) if i >= 0]
        body_end = min(ends) if ends else len(text)
        out.append(Message(start, text[start:body], body_start, body_end, bool(ends)))
        if not ends:
            return out
        at = body_end


def _skip_tags(text: str, at: int) -> int:
    """Past whitespace and the end tags between two messages."""
    while True:
        stripped = len(text) - len(text[at:].lstrip())
        for tag in (END, CALL, RETURN):
            if text.startswith(tag, stripped):
                at = stripped + len(tag)
                break
        else:
            return stripped


def is_harmony(text: str) -> bool | None:
    """Whether the output is harmony (it starts with a header), False if it is plain text, None
    while its start could still become a header's tag."""
    head = text.lstrip()
    if head.startswith(HEADERS):
        return True
    if not head or any(tag.startswith(head) for tag in HEADERS):
        return None
    return False
