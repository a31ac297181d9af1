"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) as a translation to
and from the chat path (gateway/agents.py).

    request                                         chat body
    system (a string or text blocks)                a system message first
    messages[i] content: text blocks                the message's content, joined
    assistant tool_use {id, name, input}            the assistant message's tool_calls
    user tool_result {tool_use_id, content}         a tool message (is_error: its content after "Error: ")
    thinking / redacted_thinking blocks             left out
    tools [{name, description, input_schema}]       function tools
    tool_choice auto | any | tool | none            "auto" | "required" | that function | "none"
    max_tokens (required), stop_sequences           max_completion_tokens, stop
    thinking {"type": "enabled" | "adaptive"}       chat_template_kwargs {"enable_thinking": true}
    thinking.budget_tokens (type "enabled")         thinking_token_budget (under --reasoning-parser)
    thinking {"type": "disabled"}                   chat_template_kwargs {"enable_thinking": false}

The answer's content blocks: `thinking` (the chat message's reasoning_content; signature ""),
`text`, a `tool_use` per tool call. Errors are Anthropic's {"type": "error", "error": {"type",
"message"}}. usage.input_tokens counts the prompt tokens not read from the prefix cache,
cache_read_input_tokens those that were (their sum is count_tokens' input_tokens).
"""
from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.agents import (
    CALL, REASONING, TEXT, Block, BlockStream, Turn, cached_tokens, joined_text, need, renamed, serve, sse_event,
    stream_blocks,
)
from gateway.openai_api import APIError
from gateway.serving import EngineError

if TYPE_CHECKING:
    from gateway.app import Gateway, Run

SAMPLING = ("model", "temperature", "top_p", "top_k")
CHAT_PARAMS = {"messages": "messages", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
               "stream_options": "stream", "thinking_token_budget": "thinking.budget_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


async def create(gateway: Gateway, request: Request) -> Response:
    return await serve(gateway, request, Messages(gateway.encoder.reasoning_parser is not None))


async def count_tokens(gateway: Gateway, request: Request) -> Response:
    """{"input_tokens": N}: the prompt's tokens, as POST /v1/messages would render them."""
    try:
        chat = chat_request(await gateway.read_json(request), need_max_tokens=False)
        chat.pop("stream", None)
        chat.pop("stream_options", None)
        if chat.get("tools") and chat.get("tool_choice", "auto") == "auto" and gateway.encoder.tool_call_format is None:
            chat["tool_choice"] = "required"  # the same prompt as "auto", which needs a format to parse calls
        return JSONResponse({"input_tokens": len(await gateway.tokenize_chat(chat))})
    except APIError as exc:
        return Messages().error(exc)


class Messages:
    """One POST /v1/messages (a Translation). `reasoning`: the server parses the thinking
    (--reasoning-parser), so a thinking budget can be enforced."""

    def __init__(self, reasoning: bool = False) -> None:
        self.reasoning = reasoning

    async def chat_body(self, body: dict) -> dict:
        return chat_request(body, reasoning=self.reasoning)

    async def answer(self, turn: Turn, run: Run) -> dict:
        return message_object(message_id(run), run.shape.model, turn)

    async def events(self, chunks: AsyncIterator[dict], run: Run):
        blocks = BlockStream()
        try:
            started = {**message_object(message_id(run), run.shape.model, Turn([], None, {})),
                       "usage": {"input_tokens": len(run.parsed.prompts[0]), "output_tokens": 0,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
            yield sse_event("message_start", {"type": "message_start", "message": started})
            async with contextlib.aclosing(stream_blocks(chunks, blocks)) as events:
                async for what, index, block, piece in events:
                    for name, obj in block_events(what, index, block, piece):
                        yield sse_event(name, obj)
            turn = blocks.turn(run.choices[0].stop_string)
            stop_reason, stop_sequence = stop_of(turn)
            yield sse_event("message_delta", {"type": "message_delta", "usage": message_usage(turn.usage),
                                              "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
            yield sse_event("message_stop", {"type": "message_stop"})
        except (EngineError, APIError) as exc:
            yield sse_event("error", error_body(exc.status, str(exc)))

    def error(self, exc: APIError) -> Response:
        exc = renamed(exc, CHAT_PARAMS)
        named = exc.param and exc.status == 400 and not exc.message.startswith(exc.param)
        message = f"{exc.param}: {exc.message}" if named else exc.message
        return JSONResponse(error_body(exc.status, message), status_code=exc.status, headers=exc.headers)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def message_id(run: Run) -> str:
    return "msg_" + run.shape.id.removeprefix("chatcmpl-")


# ----------------------------------------------------------------------------- request to chat

def chat_request(body: dict, need_max_tokens: bool = True, reasoning: bool = False) -> dict:
    """The chat-completions body for a Messages request (`reasoning`: as Messages')."""
    max_tokens = body.get("max_tokens")
    need(max_tokens is not None or not need_max_tokens, "max_tokens: Field required", "max_tokens")
    messages = body.get("messages")
    need(isinstance(messages, list) and messages, "messages must be a non-empty list", "messages")
    chat = {key: body[key] for key in SAMPLING if key in body}
    system = body.get("system")
    system_text = joined_text(system, "system", ("text",), "system") if system else ""
    chat["messages"] = [{"role": "system", "content": system_text}] if system_text else []
    for i, message in enumerate(messages):
        chat["messages"] += chat_messages(message, f"messages[{i}]")
    if max_tokens is not None:
        chat["max_completion_tokens"] = max_tokens
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}
    chat.update(_chat_tools(body.get("tools"), body.get("tool_choice")))
    chat.update(_chat_thinking(body.get("thinking"), reasoning))
    return chat


def _chat_thinking(thinking, reasoning: bool) -> dict:
    """`thinking` as chat fields: "enabled" or "adaptive" turns the template's thinking on (Qwen3's
    enable_thinking), "disabled" off; "enabled"'s budget_tokens is the chat's thinking_token_budget
    when the server parses the thinking (`reasoning`), and is ignored otherwise, as nothing could
    tell the thinking's tokens apart. Other types are left to the template's default."""
    need(thinking is None or isinstance(thinking, dict), "thinking must be an object", "thinking")
    kind = (thinking or {}).get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        return {}
    chat = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and budget is not None:
        need(type(budget) is int and budget >= 0, f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
             "thinking.budget_tokens")
        if reasoning:
            chat["thinking_token_budget"] = budget
    return chat


def chat_messages(message, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool_result blocks each a tool message, its
    text one user message after them; an assistant's text and tool_use blocks one message."""
    need(isinstance(message, dict) and message.get("role") in ("user", "assistant"),
         f"{where}.role must be 'user' or 'assistant'", "messages")
    content, role = message.get("content"), message["role"]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    need(isinstance(content, list), f"{where}.content must be a string or a list of blocks", "messages")
    texts, calls, results, parts = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(joined_text([block], at, ("text",), "messages"))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            need(kind in ("thinking", "redacted_thinking") and role == "assistant",
                 f"{at}.type {kind!r} is not supported in a {role} message: text, tool_use (assistant), "
                 "tool_result (user), image (user) and thinking (assistant, left out) are", "messages")
    if role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts)} | ({"tool_calls": calls} if calls else {})]
    if len(parts) > len(texts):  # images: the parts in order (docs/vision.md)
        return [*results, {"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _image_url(source, at: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, or its url."""
    need(isinstance(source, dict), f"{at}.source must be an object", "messages")
    if source.get("type") == "base64":
        need(isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str),
             f"{at}.source needs a media_type and data", "messages")
        return f"data:{source['media_type']};base64,{source['data']}"
    need(source.get("type") == "url" and isinstance(source.get("url"), str),
         f"{at}.source.type must be 'base64' or 'url'", "messages")
    return source["url"]


def _tool_call(block: dict, at: str) -> dict:
    need(isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
         and isinstance(block.get("input"), dict), f"{at} must have a string id and name and an object input",
         "messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict, at: str) -> dict:
    need(isinstance(block.get("tool_use_id"), str), f"{at}.tool_use_id must be a string", "messages")
    text = joined_text(block.get("content", ""), f"{at}.content", ("text",), "messages")
    return {"role": "tool", "tool_call_id": block["tool_use_id"],
            "content": f"Error: {text}" if block.get("is_error") else text}


def _chat_tools(tools, tool_choice) -> dict:
    chat = {}
    if tools:
        need(isinstance(tools, list), "tools must be a list", "tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            need(isinstance(tool, dict) and tool.get("type", "custom") in ("custom", None),
                 f"tools[{i}] must be a client tool {{name, description, input_schema}}; server tools are not "
                 "supported", "tools")
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            chat["tools"].append({"type": "function", "function": function})
    if tool_choice is not None:
        need(isinstance(tool_choice, dict) and tool_choice.get("type") in (*TOOL_CHOICES, "tool"),
             "tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
        kind = tool_choice["type"]
        if tools or kind not in ("auto", "none"):
            chat["tool_choice"] = TOOL_CHOICES.get(kind) or {"type": "function",
                                                            "function": {"name": tool_choice.get("name")}}
        if tool_choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat


# ----------------------------------------------------------------------------- chat to message

def message_object(msg_id: str, model: str, turn: Turn) -> dict:
    stop_reason, stop_sequence = stop_of(turn)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [content_block(block) for block in turn.blocks], "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": message_usage(turn.usage)}


def content_block(block: Block, started: bool = False) -> dict:
    """A block as Anthropic's content block (`started`: as content_block_start opens it)."""
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "" if started else block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": "" if started else block.text}
    arguments = _loads(block.text) if not started else {}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(turn: Turn) -> tuple[str | None, str | None]:
    """stop_reason and stop_sequence."""
    if turn.finish_reason is None:
        return None, None
    if turn.finish_reason == "stop" and turn.stop_string is not None:
        return "stop_sequence", turn.stop_string
    return STOP_REASONS.get(turn.finish_reason, "end_turn"), None


def message_usage(usage: dict) -> dict:
    cached = cached_tokens(usage)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "output_tokens": usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


_DELTAS = {REASONING: ("thinking_delta", "thinking"), TEXT: ("text_delta", "text"), CALL: ("input_json_delta",
                                                                                          "partial_json")}


def block_events(what: str, index: int, block: Block, piece: str) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of one of BlockStream's events."""
    if what == "start":
        return [("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": content_block(block, started=True)})]
    if what == "delta":
        kind, key = _DELTAS[block.kind]
        return [("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": kind, key: piece}})]
    signature = [("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "signature_delta", "signature": ""}})]
    return (signature if block.kind == REASONING else []) + [
        ("content_block_stop", {"type": "content_block_stop", "index": index})]
