"""What the tool-call tests share: a choice's output as the whole message and as the deltas a
client joins (gateway/tools.py's ToolCallStream over a parser)."""
from __future__ import annotations

from gateway.tools import ToolCallStream


def message(parser, text: str, reason: str = "stop", max_calls: int | None = None) -> tuple[dict, str]:
    """The whole message (call ids left out) and the finish_reason."""
    stream = ToolCallStream(parser, max_calls)
    body = stream.message(text)
    for call in body.get("tool_calls", []):
        assert call.pop("id").startswith("call_") and len(call["function"]) == 2
    return body, stream.finish_reason(text, reason)


def call(name: str, arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def feed(parser, pieces: list[str], max_calls: int | None = None) -> list[dict]:
    """The deltas for each released piece (the last one final), each call id checked and left out."""
    stream = ToolCallStream(parser, max_calls)
    out = []
    for i, piece in enumerate(pieces):
        deltas = stream.feed(piece, i == len(pieces) - 1)
        for delta in deltas:
            for entry in delta.get("tool_calls", []):
                if "id" in entry:
                    assert entry.pop("id") == stream.ids[entry["index"]]
        out.append(deltas)
    return out


def concatenated(deltas: list[list[dict]]) -> tuple[str | None, list[dict]]:
    """What a client makes of the deltas: the content, and each call's name and arguments joined."""
    content, calls = None, {}
    for delta in (d for step in deltas for d in step):
        if "content" in delta:
            content = (content or "") + delta["content"]
        for entry in delta.get("tool_calls", []):
            joined = calls.setdefault(entry["index"], {"type": "function", "function": {"name": "", "arguments": ""}})
            joined["function"]["name"] += entry["function"].get("name", "")
            joined["function"]["arguments"] += entry["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]
