"""Tool-call parsers: how a model's output becomes calls. A parser scans the output so far
(`scan(text, final)`) and says how much of it is content for sure, the calls complete so far and
the call being generated; gateway/tools.py's ToolCallStream turns scans into the whole message
and into streamed deltas.

    --tool-call-parser  a call in the output                                          streamed
    hermes              <tool_call>{"name": ..., "arguments": {...}}</tool_call>       when it closes
    llama3_json         {"name": ..., "parameters": {...}}, after <|python_tag|> or    when it closes
                        not, several separated by ';'; the output is calls or content
    qwen3_coder         <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...  the name, then each
                        </function></tool_call>, one line per tag                       parameter as it closes
    mistral             [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or        when it closes
                        [TOOL_CALLS]NAME[ARGS]{...} once per call
    pythonic            [f(a=1), g(b="x")], the whole output (inside <|python_start|>   at the end
                        ... <|python_end|> or not)
    openai              gpt-oss's harmony: a message <|start|>assistant<|channel|>      when its body ends
                        commentary to=functions.NAME ...<|message|>{...}, after the
                        reasoning parser (openai_gptoss) took the analysis

What every free-output format shares: text before the first call is the content (text after the
calls is dropped); a call whose function is not among the request's tools is no call, and is
left out as a block that is no call is; an output with no call left is all content. At the end
(`final`), a call whose closing tags are missing counts when the rest of it is whole. Arguments
are not checked against the tool's schema (vLLM's rule): a call is a call even if they fail it.
"""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from common.config import TOOL_CALL_PARSERS
from gateway import harmony

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's: what follows is a call
QWEN_FUNCTION, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAMETER, QWEN_PARAMETER_END = "<parameter=", "</parameter>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's wrapping of pythonic calls
PYTHONIC_EXAMPLE = "[func_name1(params_name1=params_value1"  # the format's description in Llama 3.2/4's templates

Tools = Mapping[str, dict]  # a request's functions: name -> the JSON schema of its arguments (an object's)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True)
class Scan:
    content_end: int  # text[:content_end] is content for sure (after a final scan: the content)
    calls: list[Call]  # the calls complete so far, in order; a later scan of a longer text starts with them
    # the call being generated, after `calls`: its name and the start of its arguments' JSON text
    # (a later scan's arguments for it start with these); never after a final scan
    partial: Call | None = None


class ToolParser(Protocol):
    tags: tuple[str, ...]  # the format's markers: they must stay in the text

    def scan(self, text: str, final: bool) -> Scan: ...


# ----------------------------------------------------------------------------- shared pieces

def load_json(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(obj: Any, keys: tuple[str, ...]) -> Call | None:
    """{"name": str, <one of keys>: {...}} -> a Call; anything else is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(arguments, dict):
        return None
    return Call(obj["name"], _dumps(arguments))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _known(tools: Tools | None, name: str) -> bool:
    """Whether `name` is a function the request declares (None: a parser built without tools)."""
    return tools is None or name in tools


def _calls_of(tools: Tools | None, calls: list[Call | None]) -> list[Call]:
    """The calls, those that are none or name an unknown function left out."""
    return [c for c in calls if c is not None and _known(tools, c.name)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _first(text: str, tags: tuple[str, ...], at: int) -> tuple[int, bool]:
    """Where the first of `tags` at or after `at` starts, and whether there is one (else len(text))."""
    found = [i for i in (text.find(tag, at) for tag in tags) if i >= 0]
    return (min(found), True) if found else (len(text), False)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


CallsAt = Callable[[str, int, bool], tuple[list[Call], "Call | None"]]


def _content_then_calls(text: str, final: bool, starts: tuple[str, ...], calls_at: CallsAt) -> Scan:
    """The shape of the tagged formats: content, then from the first of `starts` on the calls
    (`calls_at(text, start, final)`: the calls and the call being generated). Before a tag shows,
    the text that could begin one (and the whitespace before it) is held back."""
    start, found = _first(text, starts, 0)
    if not found:
        if final:
            return Scan(len(text), [])
        held = max(_partial_suffix(text, tag) for tag in starts)
        return Scan(len(text[:len(text) - held].rstrip()), [])
    calls, partial = calls_at(text, start, final)
    if final and not calls:
        return Scan(len(text), [])
    return Scan(len(text[:start].rstrip()), calls, partial)


# ----------------------------------------------------------------------------- JSON formats

@dataclass(frozen=True, slots=True)
class HermesParser:
    """Hermes (SmolLM2-1.7B, Qwen 2.5): one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    block per call. A block that is not a call is left out; at the end, an unclosed last block
    counts if its JSON is whole."""

    tools: Tools | None = None
    tags = (HERMES_START, HERMES_END)
    _block = re.compile(re.escape(HERMES_START) + r"(.*?)" + re.escape(HERMES_END), re.DOTALL)

    def scan(self, text: str, final: bool) -> Scan:
        return _content_then_calls(text, final, (HERMES_START,), self._calls)

    def _calls(self, text: str, start: int, final: bool) -> tuple[list[Call], None]:
        blocks, tail = [], start
        for match in self._block.finditer(text, start):
            blocks.append(match.group(1))
            tail = match.end()
        if final and (last := text.find(HERMES_START, tail)) >= 0:
            blocks.append(text[last + len(HERMES_START):])
        return _calls_of(self.tools, [_call(load_json(b), ("arguments", "parameters")) for b in blocks]), None


@dataclass(frozen=True, slots=True)
class Llama3JsonParser:
    """Llama 3.1's JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`; several separated by ';'), or it is all content."""

    tools: Tools | None = None
    tags = ()  # <|python_tag|> may be left out of the text: the JSON alone says it is a call

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG):].lstrip()
        if not final and (not body or not tagged and PYTHON_TAG.startswith(body)):  # too early to tell
            return Scan(0, [])
        if not body.startswith("{"):
            return Scan(len(text), [])
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                break  # not complete yet, or not JSON
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        calls = _calls_of(self.tools, calls)
        if final and not calls:
            return Scan(len(text), [])
        return Scan(0, calls)


@dataclass(frozen=True, slots=True)
class MistralParser:
    """Mistral's calls after `[TOOL_CALLS]` (a special token, kept in the text): a JSON array of
    {"name", "arguments"} (Mistral 7B v0.3's templates), or `NAME[ARGS]{...}` (newer tokenizers;
    `[CALL_ID]ID` between them, or no `[ARGS]`, also read), one `[TOOL_CALLS]` per call. A call
    counts once its JSON closes, so a missing `]` at the end loses nothing."""

    tools: Tools | None = None
    tags = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)
    _named = re.compile(r"([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?\s*")

    def scan(self, text: str, final: bool) -> Scan:
        return _content_then_calls(text, final, (MISTRAL_CALLS,), self._calls)

    def _calls(self, text: str, start: int, final: bool) -> tuple[list[Call], None]:
        calls: list[Call] = []
        at: int | None = start
        while at is not None and text.startswith(MISTRAL_CALLS, at):
            at = _skip_space(text, at + len(MISTRAL_CALLS))
            found, at = self._array(text, at) if text.startswith("[", at) else self._named_call(text, at)
            calls += found
        return _calls_of(self.tools, calls), None

    @staticmethod
    def _array(text: str, at: int) -> tuple[list[Call], int | None]:
        """The calls of the array at `at`, and where the text after it starts (None: it has not closed)."""
        calls, decoder = [], json.JSONDecoder()
        while True:
            at = _skip_space(text, at + 1)  # past '[' or ','
            try:
                obj, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return calls, None
            if (call := _call(obj, ("arguments",))) is None:
                return calls, None
            calls.append(call)
            at = _skip_space(text, at)
            if text.startswith("]", at):
                return calls, _skip_space(text, at + 1)
            if not text.startswith(",", at):
                return calls, None

    def _named_call(self, text: str, at: int) -> tuple[list[Call], int | None]:
        match = self._named.match(text, at)
        if match is None:
            return [], None
        try:
            arguments, end = json.JSONDecoder().raw_decode(text, match.end())
        except (ValueError, RecursionError):
            return [], None
        if not isinstance(arguments, dict):
            return [], None
        return [Call(match.group(1), _dumps(arguments))], _skip_space(text, end)


# ----------------------------------------------------------------------------- Qwen3-Coder's XML

_FUNCTION_ENDS = (QWEN_FUNCTION_END, HERMES_END, QWEN_FUNCTION, HERMES_START)  # a function's body ends at one
_PARAMETER_ENDS = (QWEN_PARAMETER_END, QWEN_PARAMETER)  # a value ends at one, or where its body does


@dataclass(frozen=True, slots=True)
class Qwen3CoderParser:
    """Qwen3-Coder's XML calls, each tag on its own line:

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value loses one newline at each end and takes the type its property declares in the tool's
    schema: "string" (or no type) keeps the text, any other is the text's JSON (the text itself
    when it is not JSON). A call streams: its name once `<function=NAME>` closes, then each
    parameter once its value closes. A value without `</parameter>` ends at the next parameter or
    at the end of its function, a function without `</function>` at the next call; at the end of
    the output, everything left open closes. `<function=` without `<tool_call>` is read too."""

    tools: Tools | None = None
    tags = (HERMES_START, HERMES_END)  # Qwen's tokenizers have them as tokens

    def scan(self, text: str, final: bool) -> Scan:
        return _content_then_calls(text, final, (HERMES_START, QWEN_FUNCTION), self._calls)

    def _calls(self, text: str, start: int, final: bool) -> tuple[list[Call], Call | None]:
        calls, at = [], start
        while (at := text.find(QWEN_FUNCTION, at)) >= 0:
            name_end = text.find(">", at)
            if name_end < 0:
                break  # the name is still being written (or was cut off)
            name = text[at + len(QWEN_FUNCTION):name_end].strip()
            end, closed = _first(text, _FUNCTION_ENDS, name_end + 1)
            pieces = self._parameters(name, text[name_end + 1:end], closed or final)
            if _known(self.tools, name):
                if not (closed or final):
                    return calls, Call(name, ("{" + ", ".join(pieces)) if pieces else "")
                calls.append(Call(name, "{" + ", ".join(pieces) + "}"))
            at = end
        return calls, None

    def _parameters(self, name: str, body: str, whole: bool) -> list[str]:
        """The `"key": value` JSON of each parameter in a function's `body` whose value has closed
        (`whole`: the body has, and so has its last value)."""
        schema = (self.tools or {}).get(name) or {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        pieces, at = [], 0
        while (at := body.find(QWEN_PARAMETER, at)) >= 0:
            key_end = body.find(">", at)
            if key_end < 0:
                break
            end, closed = _first(body, _PARAMETER_ENDS, key_end + 1)
            if not (closed or whole):
                break
            key = body[at + len(QWEN_PARAMETER):key_end].strip()
            value = _typed(_one_newline_off(body[key_end + 1:end]), properties.get(key))
            pieces.append(f"{_dumps(key)}: {_dumps(value)}")
            at = end
        return pieces


def _one_newline_off(value: str) -> str:
    """A value as the template writes it, "\\n" + value + "\\n", back to the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its schema declares (see Qwen3CoderParser)."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if not types or "string" in types:
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


# ----------------------------------------------------------------------------- pythonic

@dataclass(frozen=True, slots=True)
class PythonicParser:
    """Llama 3.2/4's pythonic calls: the whole output is a Python list of calls with keyword
    arguments whose values are literals, `[get_weather(city="Paris"), get_time()]` (Llama 4 may
    wrap it in <|python_start|> ... <|python_end|>); anything else is content. The list is read
    with `ast` (never evaluated), so the calls come when the output ends. Text that starts as a
    list is held until then; other text streams at once."""

    tools: Tools | None = None
    tags = ()  # the list alone says it is calls

    def scan(self, text: str, final: bool) -> Scan:
        body = _unwrapped(text)
        if not final:
            maybe = not body or body.startswith("[") or PYTHON_START.startswith(body)
            return Scan(0 if maybe else len(text), [])
        calls = _python_calls(body)
        calls = _calls_of(self.tools, calls) if calls is not None else []
        return Scan(0, calls) if calls else Scan(len(text), [])


def _unwrapped(text: str) -> str:
    body = text.strip()
    body = body[len(PYTHON_START):] if body.startswith(PYTHON_START) else body
    body = body[:-len(PYTHON_END)] if body.endswith(PYTHON_END) else body
    return body.strip()


def _python_calls(body: str) -> list[Call] | None:
    """The calls of a Python list of calls (its closing ']' may be missing); None when `body` is
    anything else."""
    if not body.startswith("["):
        return None
    tree = _python_expression(body)
    if tree is None and not body.endswith("]"):
        tree = _python_expression(body + "]")
    if not isinstance(tree, ast.List):
        return None
    calls = [_python_call(node) for node in tree.elts]
    return None if None in calls else calls


def _python_expression(text: str) -> ast.expr | None:
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _python_call(node: ast.expr) -> Call | None:
    """`name(key=literal, ...)` -> a Call; positional arguments, **kwargs, or a value that is no
    literal of JSON (a set, bytes, a variable, another call) make it none."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return Call(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


# ----------------------------------------------------------------------------- harmony

@dataclass(frozen=True, slots=True)
class HarmonyToolParser:
    """gpt-oss (gateway/harmony.py): content, then from the first harmony header on, messages; each
    addressed `to=functions.NAME` is a call of NAME with its body's JSON object as arguments, once
    its body ends (<|call|> is EOS: at the end of the output). The answer reaches it after
    --reasoning-parser openai_gptoss took the analysis messages out."""

    tools: Tools | None = None
    tags = harmony.TAGS

    def scan(self, text: str, final: bool) -> Scan:
        return _content_then_calls(text, final, harmony.HEADERS, self._calls)

    def _calls(self, text: str, start: int, final: bool) -> tuple[list[Call], None]:
        calls: list[Call | None] = []
        for message in harmony.messages(text, start):
            if message.recipient is not None and (message.closed or final):
                arguments = load_json(text[message.body_start:message.body_end])
                calls.append(Call(message.recipient, _dumps(arguments)) if isinstance(arguments, dict) else None)
        return _calls_of(self.tools, calls), None


# ----------------------------------------------------------------------------- the grammar's

@dataclass(frozen=True, slots=True)
class RequiredParser:
    """tool_choice "required": the grammar makes the output a JSON array of {"name", "parameters"}."""

    tags = ()

    def scan(self, text: str, final: bool) -> Scan:
        items = load_json(text) if text.rstrip().endswith("]") else None
        calls = [_call(item, ("parameters",)) for item in items] if isinstance(items, list) else []
        if calls and None not in calls:
            return Scan(0, calls)
        return Scan(len(text) if final else 0, [])


@dataclass(frozen=True, slots=True)
class NamedParser:
    """A named function: the grammar makes the output that function's arguments, which stream as
    they are generated. Cut off (finish_reason "length"), the output is not a call."""

    name: str
    tags = ()

    def scan(self, text: str, final: bool) -> Scan:
        if not final:
            return Scan(0, [], Call(self.name, text))
        if isinstance(load_json(text), dict):
            return Scan(0, [Call(self.name, text)])
        return Scan(len(text), [])


# ----------------------------------------------------------------------------- choosing one

PARSERS: dict[str, Callable[[Tools], ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
    "mistral": MistralParser, "pythonic": PythonicParser, "openai": HarmonyToolParser,
}


def detect_tool_call_format(template: str) -> str | None:
    """The tool-call format a chat template teaches its model, from the template's text (Qwen3-Coder's
    also names <tool_call>, so it is asked first)."""
    if QWEN_FUNCTION in template and QWEN_PARAMETER in template:
        return "qwen3_coder"
    if harmony.CHANNEL in template and "to=functions." in template:
        return "openai"
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    if PYTHONIC_EXAMPLE in template:
        return "pythonic"
    if PYTHON_TAG in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None


def tool_call_format(tool_call_parser: str, template: str) -> str | None:
    """--tool-call-parser: "auto" detects the format from the template (None: it has none)."""
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    return detect_tool_call_format(template) if tool_call_parser == "auto" else tool_call_parser
