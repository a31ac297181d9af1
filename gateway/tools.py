"""Tool calls on /v1/chat/completions: what `tools` and `tool_choice` ask of the prompt and of the
sampler, how a conversation's calls and results reach the chat template, and how the output
becomes OpenAI's `tool_calls`.

    tool_choice  the template gets  the output                                     parsed by
    "none"       no tools           text                                           nothing
    "auto"       the tools          text and/or calls in the template's format     PARSERS[--tool-call-parser]
    "required"   the tools          [{"name", "parameters"}, ...] under a grammar  RequiredParser
    named        the tools          that function's arguments under a grammar      NamedParser

A parser (gateway/tool_parsers.py) scans the output so far (`scan(text, final)`): how much of it
is content for sure, the calls complete so far and the call being generated. The whole body
(`ToolCallStream.message`) and the streamed deltas (`ToolCallStream.feed`) both come from it, so
the deltas of a stream add up to the body.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from common.config import TOOL_CALL_PARSERS
from common.protocol import StructuredOutput
from common.structured_output import json_schema_spec
from gateway.models import ChatCompletionRequest, ChatMessage, ImagePart, InvalidField, TextPart, Tool
from gateway.structured import requested_structured_output
from gateway.tool_parsers import (
    HERMES_END, HERMES_START, PARSERS, Call, NamedParser, RequiredParser, Scan, ToolParser, load_json,
)

NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function declared without parameters
FORMAT_MISSING = (
    'tool_choice "auto" (the default with tools) needs a chat template with a tool-call format, and the '
    'served one has none: pass tool_choice "required" or {"type": "function", "function": {"name": ...}} '
    "(the call is then constrained by a grammar, with any model), or serve a template that has one "
    "(--chat-template FILE, --tool-call-parser)")
AUTO_TOOL_CHOICE_NEEDS_A_FORMAT = (
    "--enable-auto-tool-choice needs a tool-call format, and the chat template teaches none that --tool-call-parser "
    f"auto recognizes: pass --tool-call-parser {'|'.join(p for p in TOOL_CALL_PARSERS if p != 'auto')}, or a "
    "--chat-template FILE that has one")


# ----------------------------------------------------------------------------- the request

@dataclass(slots=True)
class ToolCalling:
    """What a chat request's tools ask: the tools for the template, the grammar, the parser."""

    tools: list[dict] | None = None  # OpenAI's tool objects, for apply_chat_template(tools=...)
    structured_output: StructuredOutput | None = None
    parser: ToolParser | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1


def tool_calling(request: ChatCompletionRequest, format: str | None) -> ToolCalling:
    """tools and tool_choice (OpenAI's rules between them) -> ToolCalling; InvalidField for a 400.
    `format`: the served template's tool-call format (tool_call_format)."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is not None and not tools:
        raise InvalidField("tool_choice is only allowed when tools are given", "tool_choice")
    if not tools or choice == "none":
        return ToolCalling()
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InvalidField(f"tools declares the function {twice!r} more than once", "tools")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    max_calls = 1 if request.parallel_tool_calls is False else None
    if choice in (None, "auto"):
        if format is None:
            raise InvalidField(FORMAT_MISSING, "tool_choice")
        return ToolCalling(rendered, None, PARSERS[format]({t.function.name: parameters(t) for t in tools}), max_calls)
    _check_no_other_grammar(request)
    if choice == "required":
        schema = required_schema(tools, max_calls)
        return ToolCalling(rendered, json_schema_spec(schema), RequiredParser(), max_calls)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise InvalidField(f"tool_choice names the function {choice.function.name!r}, which is not among tools "
                           f"({', '.join(names)})", "tool_choice")
    return ToolCalling(rendered, json_schema_spec(parameters(tool)), NamedParser(tool.function.name), 1)


def _check_no_other_grammar(request: ChatCompletionRequest) -> None:
    """A required or named tool_choice is a grammar already: another one beside it is a 400."""
    shown = _show_choice(request.tool_choice)
    try:
        requested = requested_structured_output(request)
    except InvalidField as exc:  # two of them, or one that is no spec: one too many either way
        requested = (exc.param, None)
    if requested is not None:
        raise InvalidField(f"{requested[0]} cannot be combined with tool_choice {shown}: the output is the call's "
                           "JSON", requested[0])
    if request.use_beam_search:
        raise InvalidField(f"tool_choice {shown} is not supported with use_beam_search", "use_beam_search")


def _show_choice(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def parameters(tool: Tool) -> dict:
    """The schema of a tool's arguments: always an object's (a schema without "type", {} included,
    would let a string or a number through)."""
    params = tool.function.parameters
    if params is None:
        return NO_ARGUMENTS
    return params if "type" in params else {"type": "object", **params}


def required_schema(tools: list[Tool], max_calls: int | None) -> dict:
    """vLLM's form: an array of calls, each {"name": one tool's name, "parameters": its schema}.
    References resolve from the root: each tool's $defs / definitions move to the root's under
    "<tool>.<name>", and parameters that refer into themselves ("#", "#/properties/...") move to
    "#/$defs/<tool>" (xgrammar's pointers cannot step into anyOf's list), the references following."""
    calls, lifted = [], {}
    for tool in tools:
        name, params = tool.function.name, dict(parameters(tool))
        into_itself = any(not ref.startswith(_DEF_PREFIXES) for ref in _local_refs(params))
        defs = {container: params.pop(container) for container in REF_CONTAINERS
                if isinstance(params.get(container), dict)}
        at = f"#/$defs/{name}"
        for container, named in defs.items():
            for def_name, schema in named.items():
                lifted.setdefault(container, {})[f"{name}.{def_name}"] = _moved_refs(schema, name, at)
        params = _moved_refs(params, name, at)
        if into_itself:
            lifted.setdefault("$defs", {})[name], params = params, {"$ref": at}
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema | lifted


REF_CONTAINERS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s name (2020-12's, draft 7's)
_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", *REF_CONTAINERS)  # name -> schema
_DEF_PREFIXES = tuple(f"#/{container}/" for container in REF_CONTAINERS)


def _moved_refs(node: Any, tool: str, at: str) -> Any:
    """`node` (part of `tool`'s parameters) with its local "$ref"s pointing where the parts went:
    "#/$defs/X..." to the root's "#/$defs/<tool>.X...", any other "#..." ("#" itself included) to
    the parameters' new place `at`."""
    if isinstance(node, list):
        return [_moved_refs(item, tool, at) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _moved_ref(value, tool, at)
        elif key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # a property may be named "default"
            out[key] = {name: _moved_refs(schema, tool, at) for name, schema in value.items()}
        else:
            out[key] = _moved_refs(value, tool, at)
    return out


def _local_refs(node: Any):
    """Every local "$ref" in the schema `node`, its definitions' included."""
    if isinstance(node, list):
        for item in node:
            yield from _local_refs(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                yield value
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for schema in value.values():
                    yield from _local_refs(schema)
            elif key not in _VALUES:
                yield from _local_refs(value)


def _moved_ref(ref: str, tool: str, at: str) -> str:
    for prefix in _DEF_PREFIXES:
        if ref.startswith(prefix):
            return f"{prefix}{tool}.{ref[len(prefix):]}"
    return at + ref[1:]


# ----------------------------------------------------------------------------- the conversation

def chat_messages(messages: list[ChatMessage], renders_tool_calls: bool) -> list[dict]:
    """Messages as transformers' chat templates take them: developer as system, content parts
    joined, an assistant's tool_calls with their arguments as objects, a tool result's
    tool_call_id (and name). For a template that does not render tool_calls, the calls become Hermes text
    in the assistant's content, so that a conversation with calls renders on any model."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": "system" if m.role == "developer" else m.role, "content": _content(m.content)}
        if m.role == "tool":
            for key in ("tool_call_id", "name"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
        if m.role == "assistant" and m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                     for c in m.tool_calls]
            if renders_tool_calls:
                message["tool_calls"] = calls
            else:
                message["content"] = hermes_text(message["content"], calls)
        out.append(message)
    return out


def renders_tool_calls(template: str) -> bool:
    return "tool_calls" in template


def hermes_text(content: str, calls: list[dict]) -> str:
    """An assistant's content and calls as Hermes text: `<tool_call>\n{"name", "arguments"}\n</tool_call>` each."""
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
              for c in calls]
    return "\n".join(([content] if content else []) + [f"{HERMES_START}\n{b}\n{HERMES_END}" for b in blocks])


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:  # an assistant message without content
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _content(content: str | list[TextPart | ImagePart] | None) -> str | list[dict]:
    """Text parts joined; with images, the parts in order, as multimodal chat templates take them
    (an image as `{"type": "image", "url": ...}`, loaded by gateway/multimodal.py)."""
    if isinstance(content, list) and any(isinstance(part, ImagePart) for part in content):
        return [{"type": "image", "url": part.image_url.url} if isinstance(part, ImagePart)
                else {"type": "text", "text": part.text} for part in content]
    return _text(content)


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) for m in messages)


def _arguments(text: str) -> dict | str:
    """A call's arguments as an object, as templates take them; text that is not the JSON of one (a
    model can make such a call, and its client sends it back) stays text."""
    arguments = load_json(text)
    return arguments if isinstance(arguments, dict) else text


# ----------------------------------------------------------------------------- the output

def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call(call: Call, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(slots=True)
class ToolCallStream:
    """One choice's output as OpenAI's chat message (`message`) or as deltas (`feed`):

        text[:content_sent]   sent as content (only before the first call: content never follows one)
        ids                   the calls started: each sent its header (id, name), all but the
                              last their whole arguments, the last arguments[:arguments_sent]
    """

    parser: ToolParser
    max_calls: int | None = None
    text: str = ""
    content_sent: int = 0
    arguments_sent: int = 0
    ids: list[str] = field(default_factory=list)

    def message(self, text: str) -> dict:
        """The whole output as the chat message."""
        scan = self._scan(text, True)
        if not scan.calls:
            return {"role": "assistant", "content": text}
        content = text[:scan.content_end] or None
        return {"role": "assistant", "content": content,
                "tool_calls": [tool_call(c, new_call_id()) for c in scan.calls]}

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """"tool_calls" when the output (stopped or cut) holds calls; else the scheduler's reason."""
        if reason in ("stop", "length") and self._scan(text, True).calls:
            return "tool_calls"
        return reason

    def feed(self, delta: str, final: bool) -> list[dict]:
        """The chat deltas for `delta`, the output's next released text (`final`: its last)."""
        self.text += delta
        scan = self._scan(self.text, final)
        out = []
        if not self.ids and scan.content_end > self.content_sent:
            out.append({"content": self.text[self.content_sent:scan.content_end]})
            self.content_sent = scan.content_end
        calls = scan.calls + ([scan.partial] if scan.partial is not None else [])
        for index in range(max(len(self.ids) - 1, 0), len(calls)):
            out += self._call_deltas(index, calls[index])
        return out

    def _call_deltas(self, index: int, call: Call) -> list[dict]:
        """A call's header when it is new, then the part of its arguments not sent yet."""
        out = []
        if index == len(self.ids):
            self.ids.append(new_call_id())
            self.arguments_sent = 0
            out.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        if len(call.arguments) > self.arguments_sent:
            arguments, self.arguments_sent = call.arguments[self.arguments_sent:], len(call.arguments)
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        return out

    def _scan(self, text: str, final: bool) -> Scan:
        scan = self.parser.scan(text, final)
        if self.max_calls is not None:
            scan.calls = scan.calls[:self.max_calls]
            if len(scan.calls) >= self.max_calls:
                scan.partial = None
        return scan
