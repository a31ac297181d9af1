"""The gateway's side of structured output (gateway/structured.py): which request field asks for
what StructuredOutput, the 400s for two fields at once, a spec that is not one, beam search, and a
schema, pattern or grammar xgrammar rejects (checked with the worker's own compile rule on the
gateway's tokenizer, once per spec); logit_bias and the StructuredOutput on the wire to the worker.
The real stack's answers are tests/test_openai_api.py's ("api" section) and test_bad_input.py's."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from common.config import GatewayConfig
from common.protocol import GenerateRequest, StructuredOutput, decode, encode
from common.structured_output import InvalidStructuredOutput, compile_structured_output, json_schema_spec
from common.tokenizer import load_tokenizer
from gateway import structured
from gateway.app import Gateway
from gateway.models import ChatCompletionRequest, CompletionRequest, InvalidField, validate
from gateway.openai_api import APIError
from gateway.structured import StructuredOutputChecker, requested_structured_output, structured_output_of
from tests.grammar_errors import assert_relays

VOCAB_SIZE = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
# compact, in the schema's own key order (xgrammar emits the properties in it)
CANONICAL = ('{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
             '"required":["name","age"]}')


def chat(**fields) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields}, VOCAB_SIZE)


def completion(**fields) -> CompletionRequest:
    return validate(CompletionRequest, {"prompt": "hi", **fields}, VOCAB_SIZE)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def gateway(tokenizer):
    """The gateway's request path up to the queue (parse, tokenize, the structured output's check)."""
    return Gateway(GatewayConfig(), tokenizer)


# ----------------------------------------------------------------------------- which field asks for what


@pytest.mark.parametrize("request_, expected", [
    (chat(), None),
    (chat(response_format={"type": "text"}), None),
    (chat(response_format={"type": "json_object"}), ("response_format", StructuredOutput("json_object", ""))),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}),
     ("response_format", StructuredOutput("json_schema", CANONICAL))),
    (chat(guided_json=SCHEMA), ("guided_json", StructuredOutput("json_schema", CANONICAL))),
    (completion(guided_json=json.dumps(SCHEMA, indent=2)), ("guided_json", StructuredOutput("json_schema", CANONICAL))),
    (completion(guided_json={}), ("guided_json", StructuredOutput("json_schema", "{}"))),
    (completion(guided_regex=r"\d{3}-[a-z]+"), ("guided_regex", StructuredOutput("regex", r"\d{3}-[a-z]+"))),
    (completion(guided_choice=["yes", 'no "way"']),
     ("guided_choice", StructuredOutput("choice", '["yes","no \\"way\\""]'))),
    (chat(guided_grammar='root ::= "a" | "b"'), ("guided_grammar", StructuredOutput("grammar", 'root ::= "a" | "b"'))),
], ids=["none", "text", "json-object", "json-schema", "guided-json", "guided-json-text", "guided-json-empty",
        "guided-regex", "guided-choice", "guided-grammar"])
def test_the_field_that_asks_and_its_structured_output(request_, expected):
    assert requested_structured_output(request_) == expected
    assert structured_output_of(request_) == (None if expected is None else expected[1])


@pytest.mark.parametrize("request_, param, message", [
    (chat(response_format={"type": "json_object"}, guided_json=SCHEMA), "guided_json",
     "guided_json cannot be combined with response_format: a request follows one structured output"),
    (completion(guided_regex="a+", guided_choice=["a"], guided_grammar='root ::= "a"'), "guided_choice",
     "guided_choice cannot be combined with guided_regex: a request follows one structured output"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     'response_format: type "json_schema" needs json_schema.schema, the JSON schema the output must validate against'),
    (chat(response_format={"type": "json_schema"}), "response_format",
     'response_format: type "json_schema" needs json_schema.schema, the JSON schema the output must validate against'),
    (completion(guided_json="{'type': 'object'}"), "guided_json",
     "guided_json: the JSON schema is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    (completion(guided_json="[1, 2]"), "guided_json", "guided_json: a JSON schema must be a JSON object"),
], ids=["response-format-and-guided-json", "three-guided-fields", "json-schema-without-schema",
        "json-schema-without-json-schema", "guided-json-not-json", "guided-json-a-list"])
def test_what_is_not_one_structured_output_is_invalid(request_, param, message):
    with pytest.raises(InvalidField) as caught:
        requested_structured_output(request_)
    assert (caught.value.param, str(caught.value)) == (param, message)


# ----------------------------------------------------------------------------- the request path: 400s and params


def parse_error(gateway, kind: str, body: dict) -> tuple[int, str | None, str]:
    with pytest.raises(APIError) as caught:
        gateway._parse(kind, body)
    return caught.value.status, caught.value.param, caught.value.message


DANGLING_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


@pytest.mark.parametrize("kind, body, param, ours, library", [
    ("completion", {"guided_json": {"type": "foo"}}, "guided_json", "guided_json: invalid JSON schema",
     ("from_json_schema", '{"type":"foo"}')),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DANGLING_REF}}},
     "response_format", "response_format: invalid JSON schema", ("from_json_schema", json.dumps(DANGLING_REF))),
    ("completion", {"guided_regex": "(ab"}, "guided_regex", "guided_regex: invalid regular expression",
     ("from_regex", "(ab")),
    ("chat", {"guided_regex": "(?<=a)b"}, "guided_regex", "guided_regex: invalid regular expression",
     ("from_regex", "(?<=a)b")),
    ("completion", {"guided_grammar": "root ::= value"}, "guided_grammar", "guided_grammar: invalid grammar",
     ("from_ebnf", "root ::= value")),
], ids=["schema-type-foo", "json-schema-dangling-ref", "regex-unclosed", "regex-lookbehind", "grammar-undefined-rule"])
def test_what_the_worker_would_reject_is_a_400_naming_the_field(gateway, kind, body, param, ours, library):
    base = {"prompt": "hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
    status, named, message = parse_error(gateway, kind, {**base, **body})
    assert (status, named) == (400, param)
    assert_relays(message, ours, *library)


def test_beam_search_with_a_structured_output_is_a_400_naming_the_field(gateway):
    body = {"prompt": "hi", "guided_json": SCHEMA, "use_beam_search": True, "n": 2}
    assert parse_error(gateway, "completion", body) == (
        400, "guided_json",
        "guided_json is not supported with use_beam_search (beam search ranks beams by the model's own logprobs)")


def test_a_constrained_request_carries_its_structured_output_and_logit_bias_to_the_worker(gateway):
    parsed = gateway._parse("completion", {"prompt": "hi", "guided_choice": ["yes", "no"],
                                           "logit_bias": {"42": -100, "7": 5.5}})
    assert parsed.structured_param == "guided_choice"
    assert parsed.params.structured_output == StructuredOutput("choice", '["yes","no"]')
    assert parsed.params.logit_bias == [[42, -100.0], [7, 5.5]]
    # the scheduler and the worker get the params over msgpack (common/protocol.py)
    sent = decode(encode(GenerateRequest("r-0", parsed.prompts[0], parsed.params, "replies", 0.0)))
    assert sent.sampling_params.structured_output == StructuredOutput("choice", '["yes","no"]')
    assert sent.sampling_params.logit_bias == [[42, -100.0], [7, 5.5]]
    plain = gateway._parse("chat", {"messages": [{"role": "user", "content": "hi"}]})
    assert (plain.structured_param, plain.params.structured_output, plain.params.logit_bias) == (None, None, [])


# ----------------------------------------------------------------------------- the check: the worker's rule, once per spec

# Bad and good specs of every kind: the gateway's verdict (xgrammar's parse only) must be the
# worker's (its full compile against the tokenizer), word for word.
SPECS = [
    StructuredOutput("json_schema", '{"type":"foo"}'),
    StructuredOutput("json_schema", '{"minimum":"x","type":"integer"}'),
    StructuredOutput("json_schema", '{"properties":{"a":{"$ref":"#/nope"}},"type":"object"}'),
    StructuredOutput("json_schema", '{"type":"string","pattern":"(("}'),
    StructuredOutput("json_schema", '{"type":"integer","minimum":5,"maximum":1}'),
    StructuredOutput("json_schema", CANONICAL),
    StructuredOutput("json_schema", '{"format":"nope","type":"string"}'),  # an unknown format is ignored
    StructuredOutput("json_schema", '{"type":"string","maxLength":8}'),
    StructuredOutput("json_object", ""),
    StructuredOutput("regex", "a{2,1}"),
    StructuredOutput("regex", r"\p{L}+"),
    StructuredOutput("regex", r"[0-9]{3}-[a-z]+"),
    StructuredOutput("choice", '["a",""]'),
    StructuredOutput("choice", '["a","b c"]'),
    StructuredOutput("grammar", 'x ::= "a"'),
    StructuredOutput("grammar", 'root ::= "a" |'),
    StructuredOutput("grammar", 'root ::= "a" item*\nitem ::= [0-9]'),
]


def test_the_gateway_rejects_exactly_what_the_worker_rejects_in_the_same_words(tokenizer):
    from worker.grammar import GrammarState

    # the worker's own compiler: the model's vocabulary size and its end-of-sequence token
    worker = GrammarState(lambda: tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id]).compiler
    checker = StructuredOutputChecker()
    verdicts = []
    for spec in SPECS:
        try:
            compile_structured_output(worker, spec)
            verdicts.append(None)
        except InvalidStructuredOutput as exc:
            verdicts.append(str(exc))
        assert checker.error(spec) == verdicts[-1], spec
    assert [v is None for v in verdicts] == [False] * 5 + [True] * 4 + [False, False, True, False, True, False, False,
                                                                          True]


def test_each_spec_is_checked_once_and_the_oldest_verdict_is_forgotten(monkeypatch):
    compiled = []

    def counting(compiler, spec):
        compiled.append(spec.spec)
        return compile_structured_output(compiler, spec)

    monkeypatch.setattr(structured, "compile_structured_output", counting)
    checker = StructuredOutputChecker(verdicts_kept=2)
    bad, good, other = (StructuredOutput("regex", "(a"), StructuredOutput("regex", "a+"),
                        StructuredOutput("regex", "b+"))
    message = checker.error(bad)
    assert_relays(message, "invalid regular expression", "from_regex", "(a")
    assert [checker.error(good), checker.error(bad), checker.error(good)] == [None, message, None]
    assert compiled == ["(a", "a+"]
    checker.error(other)  # a third spec: the least recently used one, "(a", is forgotten
    assert [checker.error(good), checker.error(bad)] == [None, message]
    assert compiled == ["(a", "a+", "b+", "(a"]
    with pytest.raises(InvalidField) as caught:
        checker.check(bad, "guided_regex")
    assert (caught.value.param, str(caught.value)) == ("guided_regex", f"guided_regex: {message}")
    checker.check(None, None)  # nothing to check


# ----------------------------------------------------------------------------- the OpenAPI document


def test_the_openapi_document_describes_the_new_fields_and_answers():
    import jsonschema

    from gateway.openapi import openapi_document

    document = openapi_document("m", VOCAB_SIZE, 1 << 20)
    schemas = document["components"]["schemas"]
    for name, fields in [("CompletionRequest", ["echo", "logit_bias", "prompt_logprobs", "guided_json", "guided_regex",
                                                "guided_choice", "guided_grammar"]),
                         ("ChatCompletionRequest", ["logit_bias", "prompt_logprobs", "guided_json", "response_format",
                                                    "tools", "tool_choice", "parallel_tool_calls"])]:
        properties = schemas[name]["properties"]
        assert all(properties[f]["description"] for f in fields), name
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert "schema" in schemas["JSONSchemaFormat"]["properties"]  # the alias, as clients send it

    def valid(instance: dict, schema: str) -> None:
        jsonschema.validate(instance, {"$ref": f"#/components/schemas/{schema}", "components": document["components"]})

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    valid({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}, "logprobs": None,
            "finish_reason": "tool_calls", "prompt_logprobs": [None, {"5": {"logprob": -1.0, "rank": 2,
                                                                           "decoded_token": "x"}}]}]},
          "ChatCompletionResponse")
    valid({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [{
        "index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a"}}]}, "logprobs": None,
        "finish_reason": None}]}, "ChatCompletionChunk")
    valid({"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"b": -0.5}],
           "text_offset": [0, 1]}, "CompletionLogprobs")  # echo: the prompt's first token has no logprob
    with pytest.raises(jsonschema.ValidationError):
        valid({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "usage": {
            "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [{
                "index": 0, "text": "x", "logprobs": None, "finish_reason": "tool_calls"}]}, "CompletionResponse")


def nested_schema(objects: int, inner: dict | None = None) -> dict:
    """`objects` objects, one inside the other's property "a", around `inner`: 2 JSON levels each."""
    schema = inner or {"type": "string"}
    for _ in range(objects):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_json_schema_nested_past_64_levels_is_refused_before_any_conversion(gateway):
    checker = StructuredOutputChecker()
    assert checker.error(json_schema_spec(nested_schema(31))) is None  # 63 levels
    assert checker.error(json_schema_spec(nested_schema(31, {"enum": ["x"]}))) is None  # 64: a list is a level too
    assert checker.error(json_schema_spec({"anyOf": [nested_schema(31)]})) == \
        "the JSON schema is nested 65 levels deep, more than the 64 this server compiles"
    deep = nested_schema(400)  # xgrammar would take about a minute to convert it
    assert parse_error(gateway, "chat", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}}) == (
        400, "response_format",
        "response_format: the JSON schema is nested 801 levels deep, more than the 64 this server compiles")


def test_a_schema_too_deep_to_write_out_is_invalid_not_an_error():
    deep: dict = {}
    for _ in range(5000):  # past Python's recursion limit (a body that parses can come close to it)
        deep = {"not": deep}
    request = CompletionRequest.model_construct(prompt="hi", guided_json=deep)
    with pytest.raises(InvalidField) as caught:
        requested_structured_output(request)
    assert (caught.value.param, str(caught.value)) == ("guided_json", "guided_json: the JSON schema is nested too deeply")


# ----------------------------------------------------------------------------- the limits: size and compile time

BIG_ENUM = {"enum": ["x" * 1000] * 66}  # 66,208 characters written compactly, over 64 KiB


@pytest.mark.parametrize("kind, body, param, message", [
    ("completion", {"guided_json": BIG_ENUM}, "guided_json",
     "guided_json: the JSON schema is 66208 characters long written compactly, more than the 65536 this server "
     "compiles"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_ENUM}}},
     "response_format", "response_format: the JSON schema is 66208 characters long written compactly, more than "
                        "the 65536 this server compiles"),
    ("completion", {"guided_choice": ["y" * 300] * 220}, "guided_choice",
     "guided_choice: the choice list is 66661 characters long written compactly, more than the 65536 this server "
     "compiles"),
    ("chat", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            "a": {"enum": ["x" * 1000] * 17}}}}} for i in range(4)]}, "tools",
     "tools: the JSON schema is 68849 characters long written compactly, more than the 65536 this server compiles"),
], ids=["guided-json-object", "response-format-schema", "guided-choice", "tools-parameters"])
def test_a_spec_over_64_kib_written_compactly_is_a_400_naming_the_field(gateway, kind, body, param, message):
    base = {"prompt": "hi"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_error(gateway, kind, {**base, **body}) == (400, param, message)


def over_budget(param: str | None, noun: str, budget: str) -> str:
    return (f"{param + ': ' if param else ''}the {noun} takes more than {budget} s to compile into a token mask: "
            "lower its maxLength/maxItems/repetition bounds or simplify it")


def test_a_budget_no_compile_meets_refuses_the_spec_and_the_verdict_is_kept(gateway, monkeypatch):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "string", "maxLength": 60}}}}
    refused = (400, "response_format", over_budget("response_format", "JSON schema", "0"))
    monkeypatch.setattr(structured, "GRAMMAR_COMPILE_BUDGET_S", 0.0)
    assert parse_error(gateway, "chat", body) == refused
    monkeypatch.setattr(structured, "GRAMMAR_COMPILE_BUDGET_S", 600.0)
    assert parse_error(gateway, "chat", body) == refused  # kept: the spec is not compiled again
    fast = gateway._parse("chat", {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "maxLength": 4}}}})  # a new spec, compiled within the budget
    assert fast.params.structured_output == StructuredOutput("json_schema", '{"type":"string","maxLength":4}')


def test_a_compile_still_running_at_the_budget_is_refused_without_waiting_for_it(tokenizer, monkeypatch):
    release, compiled = threading.Event(), []

    def held(compiler, spec):  # the real parse; the tokenizer's compile held until released
        if not isinstance(compiler, structured.GrammarParser):
            assert release.wait(60)
            compiled.append(spec.spec)
        return compile_structured_output(compiler, spec)

    monkeypatch.setattr(structured, "compile_structured_output", held)
    monkeypatch.setattr(structured, "GRAMMAR_COMPILE_BUDGET_S", 0.1)
    checker = StructuredOutputChecker(tokenizer, VOCAB_SIZE)
    spec = StructuredOutput("regex", "[0-9]+")
    assert checker.error(spec) == over_budget(None, "regular expression", "0.1")
    assert compiled == []  # answered while the compile was still held
    release.set()
    assert checker.error(spec) == over_budget(None, "regular expression", "0.1")  # the verdict kept


def test_a_compile_that_finished_but_took_longer_than_the_budget_is_refused(tokenizer, monkeypatch):
    for thread in threading.enumerate():  # the earlier tests' compiles, run on past their budget
        if thread.name == "grammar-compile":
            thread.join()
    compile_clock = []

    def clock():  # the compile thread's: 0 at its start, 10 s at its end; the waiting check's stays at 0
        if threading.current_thread().name != "grammar-compile":
            return 0.0
        compile_clock.append(0.0 if not compile_clock else 10.0)
        return compile_clock[-1]

    monkeypatch.setattr(structured, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(structured, "GRAMMAR_COMPILE_BUDGET_S", 1.0)
    checker = StructuredOutputChecker(tokenizer, VOCAB_SIZE)
    assert checker.error(StructuredOutput("regex", "[a-z]+")) == over_budget(None, "regular expression", "1")
    assert compile_clock == [0.0, 10.0]  # done within the wait: refused for the time it took


def test_a_large_schema_is_refused_under_a_small_budget_by_the_real_compile(tokenizer, monkeypatch):
    # 300 required integer properties: about a second to compile against the default model's 49,152
    # tokens (xgrammar 0.2.8 and 0.2.9 alike), twenty times the budget
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)},
              "required": [f"p{i}" for i in range(300)]}
    monkeypatch.setattr(structured, "GRAMMAR_COMPILE_BUDGET_S", 0.05)
    checker = StructuredOutputChecker(tokenizer, VOCAB_SIZE)
    assert checker.error(json_schema_spec(schema)) == over_budget(None, "JSON schema", "0.05")
