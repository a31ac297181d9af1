"""Compiling a request's StructuredOutput into a grammar, the one rule the gateway (which checks a
request before queueing it) and the worker (which constrains its tokens) share, so the gateway
rejects exactly what the worker could not serve.

The caller makes the xgrammar GrammarCompiler (with its tokenizer's TokenizerInfo): common/ may not
import xgrammar, which imports torch (tests/test_layering.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

from common.protocol import StructuredOutput

# xgrammar's C++ errors begin with "[hh:mm:ss] /project/cpp/file.cc:line: "; a client needs the rest
_CPP_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
# the catch-all "Check failed: (cond) is false: " prefix says nothing to a client either
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_JSON_OBJECT_SCHEMA = '{"type":"object"}'
# JSON without free whitespace: the output is as valid and a small model cannot loop on blank lines
ANY_WHITESPACE = False
# An integer the schema leaves unbounded is held to int64's range (what JSON parsers round-trip): the
# grammar then ends its digits after 19, where a small model could otherwise write digits for ever
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InvalidStructuredOutput(ValueError):
    """A schema, pattern, choice list or grammar that the grammar library rejects."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def json_schema_spec(schema: dict | str) -> StructuredOutput:
    """A json_schema StructuredOutput in canonical text (no spaces): equal schemas share one compiled
    grammar in the worker's cache. Keys keep their order: the output's properties come in the order
    the schema declares them, as OpenAI's do. Text that is not JSON raises InvalidStructuredOutput."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidStructuredOutput("json_schema", f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidStructuredOutput("json_schema", "a JSON schema must be a JSON object")
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


def choice_spec(choices: list[str]) -> StructuredOutput:
    """A choice StructuredOutput: the output is exactly one of `choices`."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidStructuredOutput("choice", "choices must be a non-empty list of strings")
    return StructuredOutput("choice", json.dumps(list(choices), separators=(",", ":")))


def choice_grammar(spec: str) -> str:
    """The EBNF grammar of a choice spec: root ::= "a" | "b" (JSON string escapes are EBNF's)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        raise InvalidStructuredOutput("choice", "a choice spec must be a JSON list of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidStructuredOutput("choice", "choices must be a non-empty list of strings")
    if any(c == "" for c in choices):
        raise InvalidStructuredOutput("choice", "a choice may not be the empty string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_structured_output(compiler: Any, spec: StructuredOutput) -> Any:
    """Compile `spec` with `compiler` (an xgrammar GrammarCompiler) into an xgrammar CompiledGrammar.
    Raises InvalidStructuredOutput, whose message names what is wrong, when xgrammar rejects it."""
    kind = spec.kind
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(bounded_integers(spec.spec), any_whitespace=ANY_WHITESPACE)
        if kind == "json_object":
            return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=ANY_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(spec.spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.spec))
        if kind == "grammar":
            return compiler.compile_grammar(spec.spec)
    except InvalidStructuredOutput:
        raise
    except (RuntimeError, ValueError, TypeError) as e:  # xgr.InvalidJSONError is a ValueError
        raise InvalidStructuredOutput(kind, f"invalid {_NOUN[kind]}: {_library_message(e)}") from None
    raise InvalidStructuredOutput(kind, f"unknown structured output kind {kind!r}")


def bounded_integers(schema_text: str) -> str:
    """The schema with INT64_MIN / INT64_MAX as the bounds of every integer subschema that has none
    (text that is not JSON is returned as it is, for the library to reject)."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    _bound_integers(schema)
    return json.dumps(schema, separators=(",", ":"))


def _bound_integers(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _bound_integers(item)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "integer" or isinstance(kind, list) and "integer" in kind:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = INT64_MIN
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = INT64_MAX
    for value in node.values():
        _bound_integers(value)


_NOUN = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}


def _library_message(e: BaseException) -> str:
    text = str(e).strip()
    text = _CPP_LOCATION.sub("", text)
    text = _CHECK_FAILED.sub("", text)
    return text.splitlines()[0].strip() if text else type(e).__name__
