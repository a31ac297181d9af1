"""A request's structured output: which field asks for one (response_format, vLLM's guided_json /
guided_regex / guided_choice / guided_grammar), the StructuredOutput the worker constrains the
tokens with, and the gateway's check that turns what the worker would reject into a 400 before the
request is queued.

The check is the worker's own rule (common/structured_output.py's compile_structured_output) run
with a GrammarCompiler on the gateway's tokenizer, so the gateway rejects exactly what the worker
could not compile; each distinct spec is compiled once and only its verdict is kept.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from common.protocol import StructuredOutput
from common.structured_output import InvalidStructuredOutput, choice_spec, compile_structured_output, json_schema_spec
from gateway.models import InvalidField, SamplingRequest

# The request fields that ask for a structured output, in the order a conflict is reported in: with
# two of them, the error names the later one.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
VERDICTS_KEPT = 4096  # distinct specs whose verdict a gateway remembers


def requested_structured_output(request: SamplingRequest) -> tuple[str, StructuredOutput] | None:
    """The field that asks for a structured output and what it asks for; None when none does
    (response_format {"type": "text"} asks for none). Two fields at once, or a spec that is not one
    (a guided_json that is not JSON, a json_schema without its schema), raise InvalidField."""
    given = [(name, value) for name in STRUCTURED_FIELDS
             if (value := getattr(request, name, None)) is not None
             and not (name == "response_format" and value.type == "text")]
    if not given:
        return None
    if len(given) > 1:
        (first, _), (second, _) = given[:2]
        raise InvalidField(f"{second} cannot be combined with {first}: a request follows one structured output",
                           second)
    name, value = given[0]
    try:
        return name, _spec(name, value)
    except InvalidStructuredOutput as exc:
        raise InvalidField(f"{name}: {exc}", name) from None


def structured_output_of(request: SamplingRequest) -> StructuredOutput | None:
    """The StructuredOutput a request asks for (requested_structured_output without the field)."""
    requested = requested_structured_output(request)
    return None if requested is None else requested[1]


def _spec(name: str, value) -> StructuredOutput:
    if name == "response_format":
        if value.type == "json_object":
            return StructuredOutput("json_object", "")
        if value.json_schema is None or value.json_schema.schema_ is None:
            raise InvalidStructuredOutput("json_schema", 'type "json_schema" needs json_schema.schema, the JSON '
                                                         "schema the output must validate against")
        return json_schema_spec(value.json_schema.schema_)
    if name == "guided_json":
        return json_schema_spec(value)
    if name == "guided_regex":
        return StructuredOutput("regex", value)
    if name == "guided_choice":
        return choice_spec(list(value))
    return StructuredOutput("grammar", value)


class StructuredOutputChecker:
    """Compiles a StructuredOutput as the worker will (on the same tokenizer) and remembers the
    verdict per (kind, spec). The GrammarCompiler is built on first use: a gateway that never sees
    a constrained request never loads xgrammar. Thread-safe (parsing runs in worker threads)."""

    def __init__(self, tokenizer, verdicts_kept: int = VERDICTS_KEPT) -> None:
        self._tokenizer = tokenizer
        self._compiler = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._kept = verdicts_kept

    def error(self, spec: StructuredOutput) -> str | None:
        """What the grammar library says is wrong with `spec`; None when it compiles."""
        key = (spec.kind, spec.spec)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            compiler = self._compiler = self._compiler or _grammar_compiler(self._tokenizer)
        try:
            compile_structured_output(compiler, spec)
            verdict = None
        except InvalidStructuredOutput as exc:
            verdict = str(exc)
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > self._kept:
                self._verdicts.popitem(last=False)
        return verdict

    def check(self, spec: StructuredOutput | None, param: str | None) -> None:
        """Raise InvalidField naming `param` when the worker could not compile `spec`."""
        if spec is not None and (error := self.error(spec)) is not None:
            raise InvalidField(f"{param}: {error}" if param else error, param)


def _grammar_compiler(tokenizer):
    import xgrammar as xgr  # imports torch: only a gateway that serves a constrained request pays for it

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    # the verdicts are kept here, not the compiled grammars (the worker holds those)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
