"""What the Responses API (gateway/responses_api.py) and the Messages API (gateway/messages_api.py)
share. Both are translations: a request body becomes a chat-completions body, which runs through
the chat path (parse, admit, submit, generate: Gateway.start, whole, chunks), and the chat body or
its chunks become the API's answer. So every check, sampling feature, parser and metric of the
chat path holds for them unchanged.

A chat choice, whole or streamed, is read here as a list of blocks, in the order both APIs give
them: the reasoning, the text, then each tool call.

    chat message                      block
    reasoning_content                 Block(REASONING, text)
    content                           Block(TEXT, text)
    tool_calls[i]                     Block(CALL, arguments, call_id, name)

Streamed, one block is open at a time: a delta of another kind (or a new call) closes it.
"""
from __future__ import annotations

import contextlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.openai_api import APIError, bad_request
from gateway.serving import EngineError

if TYPE_CHECKING:
    from gateway.app import Gateway, Run

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass(slots=True)
class Block:
    kind: str  # REASONING | TEXT | CALL
    text: str = ""  # the reasoning or the text; a call's arguments (JSON text)
    call_id: str = ""
    name: str = ""


@dataclass(slots=True)
class Turn:
    """A chat choice as blocks, how it ended and the chat usage."""

    blocks: list[Block]
    finish_reason: str | None
    usage: dict
    stop_string: str | None = None  # the stop string that ended it (ChoiceState.stop_string)


def turn_of(chat: dict, stop_string: str | None = None) -> Turn:
    """A whole chat body's first choice as a Turn."""
    choice = chat["choices"][0]
    message = choice["message"]
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(Block(REASONING, message["reasoning_content"]))
    if message.get("content"):
        blocks.append(Block(TEXT, message["content"]))
    for call in message.get("tool_calls") or []:
        blocks.append(Block(CALL, call["function"]["arguments"], call["id"], call["function"]["name"]))
    return Turn(blocks, choice["finish_reason"], chat["usage"], stop_string)


class BlockStream:
    """Chat chunks (dicts) to the blocks' events, each (what, index, block, piece):

        ("start", i, block, "")      block i opens (a call with its id and name)
        ("delta", i, block, piece)   piece is appended to block i's text
        ("stop", i, block, "")       block i is whole

    `turn()` is what the chunks made, as turn_of makes it of a whole body."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def feed(self, chunk: dict) -> list[tuple]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._text(REASONING, delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(TEXT, delta["content"])
            for entry in delta.get("tool_calls") or []:
                if "id" in entry:
                    events += self._start(Block(CALL, "", entry["id"], entry["function"]["name"]))
                if arguments := entry.get("function", {}).get("arguments"):
                    events += self._delta(arguments)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def close(self) -> list[tuple]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", len(self.blocks) - 1, block, "")]

    def turn(self, stop_string: str | None = None) -> Turn:
        return Turn(self.blocks, self.finish_reason, self.usage or {}, stop_string)

    def _text(self, kind: str, piece: str) -> list[tuple]:
        events = [] if self.open is not None and self.open.kind == kind else self._start(Block(kind))
        return events + self._delta(piece)

    def _start(self, block: Block) -> list[tuple]:
        events = self.close()
        self.open = block
        self.blocks.append(block)
        return events + [("start", len(self.blocks) - 1, block, "")]

    def _delta(self, piece: str) -> list[tuple]:
        self.open.text += piece
        return [("delta", len(self.blocks) - 1, self.open, piece)]


# ----------------------------------------------------------------------------- the route

class Translation(Protocol):
    """One request of an API: its body to a chat body, and the chat answer back."""

    async def chat_body(self, body: dict) -> dict: ...

    async def answer(self, turn: Turn, run: Run) -> dict: ...

    def events(self, chunks: AsyncIterator[dict], run: Run) -> AsyncIterator[str]: ...

    def error(self, exc: APIError) -> Response: ...


async def serve(gateway: Gateway, request: Request, api: Translation) -> Response:
    """Read, translate, run through the chat path and translate back, whole or streamed; every
    error in the API's own shape (api.error)."""
    try:
        body = await gateway.read_json(request)
        run = await gateway.start(request, "chat", await api.chat_body(body))
        if run.parsed.stream:
            return event_stream(api.events(gateway.chunks(run), run), run.generation)
        chat = await gateway.whole(request, run)
        if chat is None:
            return Response(status_code=499)  # the client left
        return JSONResponse(await api.answer(turn_of(chat, run.choices[0].stop_string), run))
    except ClientDisconnect:  # left while sending the body: nothing was submitted
        return Response(status_code=499)
    except EngineError as exc:
        return api.error(engine_api_error(exc))
    except APIError as exc:
        return api.error(exc)


def engine_api_error(exc: EngineError) -> APIError:
    headers = {"Retry-After": "5"} if exc.status == 503 else None
    return APIError(exc.status, str(exc), "server_error", code=exc.code, headers=headers)


def event_stream(events: AsyncIterator[str], generation) -> StreamingResponse:
    """An SSE response of `events`, its generation closed also when the client leaves before the
    stream's first step."""
    async def close() -> None:
        generation.close()

    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_blocks(chunks: AsyncIterator[dict], blocks: BlockStream):
    """Each of the chunks' block events, the last block's stop after the last chunk; the chunks are
    closed however the stream ends."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            for event in blocks.feed(chunk):
                yield event
    for event in blocks.close():
        yield event


# ----------------------------------------------------------------------------- small shared pieces

def sse_event(name: str, obj: dict) -> str:
    """A Server-Sent Event with its `event:` line, as both APIs send them."""
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """A chat path's error about a chat field, naming the API's field instead (`names`: chat field
    to the API's; every messages[...] param becomes names["messages"])."""
    param, message = exc.param, exc.message
    if param is not None:
        ours = names["messages"] if param.startswith("messages") else names.get(param, param)
        chat_name = "messages" if param.startswith("messages") else param
        if ours != chat_name and re.match(re.escape(chat_name) + r"\b", message):  # "stop must be..."
            message = ours + message[len(chat_name):]
        param = ours
    return APIError(exc.status, message, exc.type, param, exc.code, exc.headers)


def need(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise bad_request(message, param)


def joined_text(content, where: str, types: tuple[str, ...], param: str) -> str:
    """A string, or a list of text parts (each {"type": one of `types`, "text": str}) joined with
    newlines; else a 400 about `where` (a path in the body) naming `param`."""
    if isinstance(content, str):
        return content
    need(isinstance(content, list), f"{where} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        need(isinstance(part, dict) and part.get("type") in types and isinstance(part.get("text"), str),
             f"{where}[{j}] must be a text part ({' or '.join(types)} with a string text); only text is "
             f"supported, got {_show(part)}", param)
        texts.append(part["text"])
    return "\n".join(texts)


def chat_content(content, where: str, types: tuple[str, ...], param: str,
                 image_url: Callable[[dict], str | None]) -> str | list[dict]:
    """`joined_text`, except that a part `image_url` gives a URL for is an image: then the content
    is the chat API's parts, in order (a text part each, an `image_url` part each)."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and image_url(p) is not None for p in content)):
        return joined_text(content, where, types, param)
    parts = []
    for j, part in enumerate(content):
        url = image_url(part) if isinstance(part, dict) else None
        parts.append({"type": "image_url", "image_url": {"url": url}} if url is not None
                     else {"type": "text", "text": joined_text([part], f"{where}[{j}]", types, param)})
    return parts


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 64 else text[:61] + "..."


def reasoning_tokens(usage: dict) -> int:
    return (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
