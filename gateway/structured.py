"""A request's structured output: which field asks for one (response_format, vLLM's guided_json /
guided_regex / guided_choice / guided_grammar), the StructuredOutput the worker constrains the
tokens with, and the gateway's check that turns what the worker would reject into a 400 before the
request is queued.

The check is the worker's own rule (common/structured_output.py's compile_structured_output) run
first with a "compiler" that stops at xgrammar's parse of the spec into a Grammar: every spec xgrammar
rejects fails there, with the words the worker's compile would give (tests/test_structured_api.py
checks both on bad and good specs of every kind), and the parse takes well under a millisecond.
A spec that parses is then compiled for real against the gateway's tokenizer (its token masks: the
worker's compile) on a small thread pool, within GRAMMAR_COMPILE_BUDGET_S: the worker compiles inside
its step, so a spec that takes longer (hundreds of required properties take about a second, thousands
of optional ones far longer) would stall every sequence; it is refused instead. Each distinct spec is checked
once and only its verdict is kept. Beyond the worker's rule, a spec's text is at most
MAX_GRAMMAR_CHARS and a JSON schema at most MAX_SCHEMA_DEPTH levels deep (its conversion alone takes
seconds).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from common.protocol import StructuredOutput
from common.structured_output import InvalidStructuredOutput, choice_spec, compile_structured_output, json_schema_spec
from gateway.models import MAX_GRAMMAR_CHARS, InvalidField, SamplingRequest
from gateway.without_torch import let_torch_in

log = logging.getLogger(__name__)

# The request fields that ask for a structured output, in the order a conflict is reported in: with
# two of them, the error names the later one.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
VERDICTS_KEPT = 4096  # distinct specs whose verdict a gateway remembers
# JSON levels (objects and lists) of a JSON schema, about half as many levels of nested objects:
# xgrammar's conversion of a schema grows with the cube of its depth (100 objects deep take 0.5 s
# here, 200 take 3 s, in the gateway and again in the worker's step), so deeper ones are refused
MAX_SCHEMA_DEPTH = 64
# the longest a spec may take to compile into a token mask (the worker does it inside its step, once
# per distinct spec); at most COMPILE_THREADS compiles run at once, each on a thread (xgrammar
# releases the GIL). One past the budget cannot be stopped: it runs on, and an exit waits for it
# (xgrammar aborts the process when it exits during a compile)
GRAMMAR_COMPILE_BUDGET_S = 5.0
COMPILE_THREADS = 2
NOUNS = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}


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
    except RecursionError:  # a schema within the body's own nesting limit, too deep to write out again
        raise InvalidField(f"{name}: the JSON schema is nested too deeply", name) from None


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
    """Checks a StructuredOutput by the worker's rule and remembers the verdict per (kind, spec).
    With a `tokenizer` (the served model's; `vocab_size` the model's), a spec that parses is also
    compiled into a token mask within GRAMMAR_COMPILE_BUDGET_S; without one only the parse runs.
    xgrammar is imported on first use: a gateway that never sees a constrained request never loads
    it. Thread-safe (checks run in worker threads)."""

    def __init__(self, tokenizer: Any = None, vocab_size: int | None = None,
                 verdicts_kept: int = VERDICTS_KEPT) -> None:
        self._parser: GrammarParser | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._kept = verdicts_kept
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None  # xgr.GrammarCompiler, made on the first spec that parses
        self._slots = threading.BoundedSemaphore(COMPILE_THREADS)  # compiles at once
        self._compiling: dict[tuple[str, str], _Compile] = {}  # one compile per spec, its checks wait on it

    def error(self, spec: StructuredOutput) -> str | None:
        """What is wrong with `spec` (the grammar library's words, or too long, too deep, too slow to
        compile); None when the worker can compile it in time."""
        key = (spec.kind, spec.spec)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            parser = self._parser = self._parser or GrammarParser()
        verdict = _too_long(spec) or _too_deep(spec)
        if verdict is None:
            try:
                compile_structured_output(parser, spec)
            except InvalidStructuredOutput as exc:
                verdict = str(exc)
        if verdict is None and self._tokenizer is not None:
            verdict = self._compile_error(spec)
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > self._kept:
                self._verdicts.popitem(last=False)
        return verdict

    def check(self, spec: StructuredOutput | None, param: str | None) -> None:
        """Raise InvalidField naming `param` when the worker could not compile `spec`."""
        if spec is not None and (error := self.error(spec)) is not None:
            raise InvalidField(f"{param}: {error}" if param else error, param)

    def _compile_error(self, spec: StructuredOutput) -> str | None:
        """The real compile's verdict: None, the library's words, or over the budget (counted from
        the compile's start: a check queued behind COMPILE_THREADS others waits its turn). A compile
        past the budget runs on to its end on its own thread, and is dropped."""
        key = (spec.kind, spec.spec)
        with self._lock:
            if self._compiler is None:
                self._compiler = _grammar_compiler(self._tokenizer, self._vocab_size)
            if self._compiler is False:  # a tokenizer xgrammar cannot read: the parse's verdict stands
                return None
            job = self._compiling.get(key)
            if job is None:
                job = self._compiling[key] = _Compile()
                threading.Thread(target=self._compile, args=(key, job, spec), name="grammar-compile").start()
        job.started.wait()
        budget = GRAMMAR_COMPILE_BUDGET_S
        # over the budget whether it is still running or took longer (a budget of 0 refuses every spec)
        if not job.done.wait(max(0.0, job.start + budget - time.monotonic())) or job.seconds > budget:
            return (f"the {NOUNS[spec.kind]} takes more than {budget:g} s to compile into a token mask: lower its "
                    "maxLength/maxItems/repetition bounds or simplify it")
        return job.error

    def _compile(self, key: tuple[str, str], job: _Compile, spec: StructuredOutput) -> None:
        with self._slots:
            job.start = time.monotonic()
            job.started.set()
            try:
                compile_structured_output(self._compiler, spec)  # dropped: the worker compiles its own
            except InvalidStructuredOutput as exc:
                job.error = str(exc)
            finally:
                job.seconds = time.monotonic() - job.start
                with self._lock:
                    self._compiling.pop(key, None)
                job.done.set()


@dataclass(slots=True)
class _Compile:
    started: threading.Event = field(default_factory=threading.Event)  # a thread began the compile
    start: float = 0.0  # time.monotonic() then
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0  # the compile's, once done
    error: str | None = None  # the library's words, when it rejects the spec


def _grammar_compiler(tokenizer: Any, vocab_size: int | None) -> Any:
    """The worker's kind of GrammarCompiler for `tokenizer`, or False when xgrammar cannot read it."""
    let_torch_in()
    import xgrammar as xgr

    eos = getattr(tokenizer, "eos_token_id", None)
    try:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=[eos] if isinstance(eos, int) else None)
    except Exception as exc:  # a tokenizer without a vocabulary xgrammar knows (a test's fake)
        log.warning("structured output is checked without the compile budget: %s", exc)
        return False
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _too_long(spec: StructuredOutput) -> str | None:
    if len(spec.spec) <= MAX_GRAMMAR_CHARS:
        return None
    return (f"the {NOUNS.get(spec.kind, spec.kind)} is {len(spec.spec)} characters long written compactly, more than "
            f"the {MAX_GRAMMAR_CHARS} this server compiles")


def _too_deep(spec: StructuredOutput) -> str | None:
    if spec.kind != "json_schema":
        return None
    try:
        level = [json.loads(spec.spec)]
    except ValueError:
        return None  # compile_structured_output says what is wrong with it
    depth = 0
    while level := [node for node in level if isinstance(node, (dict, list))]:
        depth += 1
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)]
    if depth > MAX_SCHEMA_DEPTH:
        return f"the JSON schema is nested {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} this server compiles"
    return None


class GrammarParser:
    """The part of an xgrammar GrammarCompiler that compile_structured_output calls, up to the
    Grammar: the same parse and conversion (and errors) as GrammarCompiler.compile_*, without the
    tokenizer-dependent compile that follows it."""

    def __init__(self) -> None:
        let_torch_in()
        import xgrammar as xgr  # imports torch: only a gateway that serves a constrained request pays for it

        self._grammar = xgr.Grammar

    def compile_json_schema(self, schema: str, **options):
        return self._grammar.from_json_schema(schema, **options)

    def compile_regex(self, regex: str):
        return self._grammar.from_regex(regex)

    def compile_grammar(self, ebnf: str, **options):
        return self._grammar.from_ebnf(ebnf, **options)
