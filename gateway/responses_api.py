"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) as a translation to and from
the chat path (gateway/agents.py).

    request                                        chat body
    instructions                                   a system message first
    input: "text"                                  a user message
    input: [{"type": "message", role, content}]    messages (developer as system; text parts joined)
    input: [{"type": "function_call", ...}]        the assistant message's tool_calls
    input: [{"type": "function_call_output"}]      tool messages
    input: [{"type": "reasoning"}]                 left out
    tools: [{"type": "function", "name", ...}]     tools: [{"type": "function", "function": {...}}]
    tool_choice {"type": "function", "name"}       {"type": "function", "function": {"name"}}
    max_output_tokens                              max_completion_tokens
    text.format                                    response_format
    reasoning.effort                               chat_template_kwargs {"reasoning_effort"}

The answer's output items: a `reasoning` item (the chat message's reasoning_content), a `message`
with one `output_text`, a `function_call` per tool call. `store` (default true) keeps the
conversation (the input items, the previous responses' included, and the output items) in Redis
under `pagoda:response:<id>` for --responses-ttl seconds, so that any gateway of the deployment
continues it from `previous_response_id`.
"""
from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, AsyncIterator

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.agents import (
    CALL, REASONING, TEXT, Block, BlockStream, Turn, cached_tokens, chat_content, joined_text, need, new_id, reasoning_tokens,
    renamed, serve, sse_event, stream_blocks,
)
from gateway.openai_api import APIError, error_response
from gateway.serving import EngineError

if TYPE_CHECKING:
    from gateway.app import Gateway, Run

RESPONSE_KEY = "pagoda:response:"
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# chat fields a Responses request may also set, as vLLM's Responses API takes them
SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "parallel_tool_calls", "user")
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "stream_options": "stream"}
ITEM_PREFIX = {REASONING: "rs_", TEXT: "msg_", CALL: "fc_"}


async def create(gateway: Gateway, request: Request) -> Response:
    return await serve(gateway, request, Responses(gateway))


async def retrieve(gateway: Gateway, request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response, while it is kept (the caller checked the API key)."""
    return JSONResponse((await load(gateway, request.path_params["response_id"], "response_id"))["response"])


async def load(gateway: Gateway, response_id: str, param: str) -> dict:
    """The stored {"response", "items"}; 404 when it is unknown or has expired."""
    try:
        raw = await gateway.engine.redis.get(RESPONSE_KEY + response_id)
    except (redis.RedisError, OSError) as exc:
        raise APIError(503, f"Redis is unreachable ({exc}); stored responses cannot be read", "server_error",
                       code="service_unavailable") from None
    if raw is None:
        raise APIError(404, f"no response {response_id!r}: it is unknown, was not stored (store: false), or has "
                            f"expired (kept {gateway.config.responses_ttl_s} s)", param=param, code="not_found")
    return json.loads(raw)


class Responses:
    """One POST /v1/responses (a Translation)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.body: dict = {}
        self.items: list[dict] = []  # the conversation's items: the previous response's, then this input's
        self.created_at = int(time.time())

    async def chat_body(self, body: dict) -> dict:
        self.body = body
        previous = body.get("previous_response_id")
        need(previous is None or isinstance(previous, str), "previous_response_id must be a string",
             "previous_response_id")
        before = (await load(self.gateway, previous, "previous_response_id"))["items"] if previous else []
        self.items = before + input_items(body.get("input"))
        return chat_request(body, self.items)

    async def answer(self, turn: Turn, run: Run) -> dict:
        ids = [new_id(ITEM_PREFIX[b.kind]) for b in turn.blocks]
        return await self._finish(run, response_object(self._started(run), turn, ids))

    async def events(self, chunks: AsyncIterator[dict], run: Run):
        stream, blocks = EventStream(), BlockStream()
        try:
            response = self._started(run)
            yield stream.event("response.created", response=response)
            yield stream.event("response.in_progress", response=response)
            async with contextlib.aclosing(stream_blocks(chunks, blocks)) as events:
                async for what, index, block, piece in events:
                    for event in stream.on(what, index, block, piece):
                        yield event
            response = await self._finish(run, response_object(response, blocks.turn(), stream.ids))
            yield stream.event(f"response.{response['status']}", response=response)
        except (EngineError, APIError) as exc:
            yield stream.event("error", code=exc.code, message=str(exc), param=None)

    def error(self, exc: APIError) -> Response:
        return error_response(renamed(exc, CHAT_PARAMS))

    def _started(self, run: Run) -> dict:
        return started_response(run.shape.id.removeprefix("chatcmpl-"), self.created_at, run.shape.model, self.body)

    async def _finish(self, run: Run, response: dict) -> dict:
        """Store the conversation (store: true) under the response's id."""
        if self.body.get("store", True) is not False:
            stored = {"response": response, "items": self.items + response["output"]}
            try:
                await self.gateway.engine.redis.set(RESPONSE_KEY + response["id"], json.dumps(stored),
                                                    ex=self.gateway.config.responses_ttl_s)
            except (redis.RedisError, OSError) as exc:
                raise APIError(503, f"Redis is unreachable ({exc}); the response could not be stored (store: "
                                    "true)", "server_error", code="service_unavailable") from None
        return response


# ----------------------------------------------------------------------------- request to chat

def input_items(value) -> list[dict]:
    """`input` as a list of items, each checked (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    need(isinstance(value, list), "input must be a string or a list of items", "input")
    items = []
    for i, item in enumerate(value):
        need(isinstance(item, dict), f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            need(item.get("role") in ROLES, f"input[{i}].role must be one of {', '.join(ROLES)}, got "
                                            f"{item.get('role')!r}", "input")
            chat_content(item.get("content"), f"input[{i}].content", TEXT_PARTS, "input", _input_image)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                need(isinstance(item.get(key), str), f"input[{i}].{key} must be a string", "input")
        elif kind == "function_call_output":
            need(isinstance(item.get("call_id"), str), f"input[{i}].call_id must be a string", "input")
            joined_text(item.get("output"), f"input[{i}].output", TEXT_PARTS, "input")
        else:
            need(kind == "reasoning", f"input[{i}].type {kind!r} is not supported: message, function_call, "
                                      "function_call_output and reasoning are", "input")
        items.append({**item, "type": kind})
    need(any(item["type"] != "reasoning" for item in items), "input must not be empty", "input")
    return items


def _input_image(part: dict) -> str | None:
    """An `input_image` part's URL (a data: or http(s) URL; docs/vision.md)."""
    url = part.get("image_url")
    return url if part.get("type") == "input_image" and isinstance(url, str) else None


def chat_messages(items: list[dict]) -> list[dict]:
    """Items as chat messages: a function_call joins the assistant message before it (or starts
    one); reasoning items are left out."""
    messages, names = [], {}
    for item in items:
        if item["type"] == "message":
            content = chat_content(item["content"], "input", TEXT_PARTS, "input", _input_image)
            messages.append({"role": item["role"], "content": content})
        elif item["type"] == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif item["type"] == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": joined_text(item["output"], "input", TEXT_PARTS, "input")}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages


def chat_request(body: dict, items: list[dict]) -> dict:
    """The chat-completions body for a Responses request whose conversation is `items`."""
    instructions = body.get("instructions")
    need(instructions is None or isinstance(instructions, str), "instructions must be a string", "instructions")
    chat = {key: body[key] for key in SAMPLING if key in body}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + chat_messages(items)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    need(not body.get("background"), "background is not supported", "background")
    chat.update(_chat_tools(body.get("tools"), body.get("tool_choice")))
    if (response_format := _response_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    need(reasoning is None or isinstance(reasoning, dict), "reasoning must be an object", "reasoning")
    if reasoning and reasoning.get("effort") is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": reasoning["effort"]}
    return chat


def _chat_tools(tools, tool_choice) -> dict:
    """Function tools in chat's nested shape; tool_choice "auto" or "none" without tools is left out."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    if tools is None or tools == []:
        return {} if tool_choice in (None, "auto", "none") else {"tool_choice": tool_choice}
    need(isinstance(tools, list), "tools must be a list", "tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        need(isinstance(tool, dict) and tool.get("type") == "function",
             f"tools[{i}] must be a function tool ({{\"type\": \"function\", \"name\", \"parameters\"}}); other "
             "tool types are not supported", "tools")
        chat_tools.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}})
    return {"tools": chat_tools} | ({} if tool_choice is None else {"tool_choice": tool_choice})


def _response_format(text) -> dict | None:
    need(text is None or isinstance(text, dict), "text must be an object", "text")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    need(isinstance(fmt, dict), "text.format must be an object", "text.format")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {
        key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}}


# ----------------------------------------------------------------------------- chat to response

def started_response(uid: str, created_at: int, model: str, body: dict) -> dict:
    """The response object before its output: status in_progress."""
    return {
        "id": "resp_" + uid, "object": "response", "created_at": created_at, "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
        "store": body.get("store", True) is not False, "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
        "usage": None, "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


def response_object(started: dict, turn: Turn, ids: list[str]) -> dict:
    """The finished response: `turn`'s blocks as output items (ids: one per block)."""
    incomplete = turn.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    return {**started, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": [output_item(block, item_id, status) for block, item_id in zip(turn.blocks, ids)],
            "usage": response_usage(turn.usage)}


def output_item(block: Block, item_id: str, status: str = "completed") -> dict:
    if block.kind == REASONING:
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": block.text}] if block.text else []}
    if block.kind == TEXT:
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [_output_text(block.text)] if block.text else []}
    return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
            "arguments": block.text, "status": status}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_usage(usage: dict) -> dict:
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": cached_tokens(usage), "cache_write_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(usage)},
            "total_tokens": usage.get("total_tokens", 0)}


class EventStream:
    """The Responses stream's events for the blocks' events, numbered by `sequence_number`."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.ids: list[str] = []  # each output item's id

    def event(self, type: str, **fields) -> str:
        obj = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return sse_event(type, obj)

    def on(self, what: str, index: int, block: Block, piece: str) -> list[str]:
        if what == "start":
            self.ids.append(new_id(ITEM_PREFIX[block.kind]))
        at = {"item_id": self.ids[index], "output_index": index}
        if what == "start":
            started = output_item(Block(block.kind, "", block.call_id, block.name), self.ids[index], "in_progress")
            out = [self.event("response.output_item.added", output_index=index, item=started)]
            if block.kind != CALL:
                out.append(self.event("response.content_part.added", **at, content_index=0, part=_part(block.kind)))
            return out
        if what == "delta":
            if block.kind == CALL:
                return [self.event("response.function_call_arguments.delta", **at, delta=piece)]
            extra = {"logprobs": []} if block.kind == TEXT else {}
            return [self.event(f"response.{_TEXT_EVENT[block.kind]}.delta", **at, content_index=0, delta=piece,
                               **extra)]
        return self._done(at, index, block)

    def _done(self, at: dict, index: int, block: Block) -> list[str]:
        item = output_item(block, self.ids[index])
        if block.kind == CALL:
            return [self.event("response.function_call_arguments.done", **at, name=block.name, arguments=block.text),
                    self.event("response.output_item.done", output_index=index, item=item)]
        extra = {"logprobs": []} if block.kind == TEXT else {}
        return [self.event(f"response.{_TEXT_EVENT[block.kind]}.done", **at, content_index=0, text=block.text, **extra),
                self.event("response.content_part.done", **at, content_index=0, part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]


_TEXT_EVENT = {TEXT: "output_text", REASONING: "reasoning_text"}


def _part(kind: str) -> dict:
    return _output_text("") if kind == TEXT else {"type": "reasoning_text", "text": ""}
