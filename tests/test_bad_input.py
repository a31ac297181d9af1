"""Malformed requests against the real stack (`pagoda up`): each is answered with its exact status
and OpenAI error object, none is a 5xx, and afterwards the server still serves and holds no KV block.
Then schemathesis fuzzes the stack from its own /openapi.json.

The stack runs with a 64-token context, so that the context-length edges are cheap to reach and
no request generates many tokens on the CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gateway.app import ROUTES
from pagoda.bench.stack import parse_samples
from tests.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 1 << 20  # the gateway's default --max-body-bytes (`pagoda up` does not change it)
TOKEN = 504  # any id in the vocabulary
ROOT = Path(__file__).resolve().parent.parent

C, CHAT = "/v1/completions", "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
NO_ARGUMENTS_TOOL = [{"type": "function", "function": {"name": "get_time"}}]
GET_TIME = {"type": "function", "function": {"name": "get_time"}}
INVALID = "invalid_request_error"
CTX = "context_length_exceeded"


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


def without(body: dict, name: str) -> dict:
    return {k: v for k, v in body.items() if k != name}


def nested(opening: str, closing: str, depth: int) -> bytes:
    return (opening * depth + closing * depth).encode()


@dataclass
class Bad:
    """One malformed request and the exact error it must get."""

    id: str
    path: str
    status: int
    param: str | None = None
    code: str | None = None
    body: object = None  # sent as JSON
    raw: bytes | None = None  # sent as is, with `headers`
    chunked: bool = False  # send `raw` in pieces, without a Content-Length
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json"})
    method: str = "POST"
    type: str = INVALID

    def send(self, http: httpx.Client) -> httpx.Response:
        if self.raw is not None:
            content = (self.raw[i:i + 65536] for i in range(0, len(self.raw), 65536)) if self.chunked else self.raw
            return http.request(self.method, self.path, content=content, headers=self.headers)
        if self.body is not None:
            return http.request(self.method, self.path, json=self.body)
        return http.request(self.method, self.path)


BIG_BODY = json.dumps(completion(prompt="a" * MAX_BODY_BYTES)).encode()  # valid, one byte per "a", over the limit


CASES = [
    # --- completions: the prompt
    Bad("prompt-missing", C, 400, "prompt", body=without(completion(), "prompt")),
    Bad("prompt-null", C, 400, "prompt", body=completion(prompt=None)),
    Bad("prompt-empty-string", C, 400, "prompt", body=completion(prompt="")),
    Bad("prompt-empty-list", C, 400, "prompt", body=completion(prompt=[])),
    Bad("prompt-a-number", C, 400, "prompt", body=completion(prompt=42)),
    Bad("prompt-an-object", C, 400, "prompt", body=completion(prompt={"text": "hi"})),
    Bad("prompt-strings-and-ints", C, 400, "prompt", body=completion(prompt=["hi", 3])),
    Bad("prompt-an-empty-token-list", C, 400, "prompt", body=completion(prompt=[[]])),
    Bad("prompt-an-empty-string-among-strings", C, 400, "prompt", body=completion(prompt=["hi", ""])),
    Bad("token-id-negative", C, 400, "prompt", body=completion(prompt=[TOKEN, -1])),
    Bad("token-id-equal-to-vocab-size", C, 400, "prompt", body=completion(prompt=[VOCAB_SIZE])),
    Bad("token-id-past-int32", C, 400, "prompt", body=completion(prompt=[[TOKEN], [2**31]])),
    Bad("token-id-a-float", C, 400, "prompt", body=completion(prompt=[TOKEN, 1.5])),
    Bad("token-id-a-bool", C, 400, "prompt", body=completion(prompt=[True])),
    Bad("token-id-a-string", C, 400, "prompt", body=completion(prompt=[[TOKEN, "7"]])),
    # --- completions: sampling fields out of range or of the wrong type
    Bad("temperature-negative", C, 400, "temperature", body=completion(temperature=-0.5)),
    Bad("temperature-a-string", C, 400, "temperature", body=completion(temperature="0.5")),
    Bad("temperature-overflows-to-inf", C, 400, "temperature",
        raw=b'{"prompt": "hi", "max_tokens": 1, "temperature": 1e400}'),
    Bad("temperature-an-int-beyond-float", C, 400, "temperature",  # was a 500 (OverflowError)
        raw=b'{"prompt": "hi", "max_tokens": 1, "temperature": 1' + b"0" * 400 + b"}"),
    Bad("top-p-zero", C, 400, "top_p", body=completion(top_p=0)),
    Bad("top-p-above-one", C, 400, "top_p", body=completion(top_p=1.01)),
    Bad("top-k-below-minus-one", C, 400, "top_k", body=completion(top_k=-2)),
    Bad("min-p-above-one", C, 400, "min_p", body=completion(min_p=1.5)),
    Bad("n-zero", C, 400, "n", body=completion(n=0)),
    Bad("n-above-128", C, 400, "n", body=completion(n=129)),
    Bad("n-not-an-integer", C, 400, "n", body=completion(n=2.5)),
    Bad("n-times-prompts-above-128", C, 400, "n", body=completion(n=2, prompt=["hi"] * 65)),
    Bad("best-of-below-n", C, 400, "best_of", body=completion(n=2, best_of=1)),
    Bad("max-tokens-zero", C, 400, "max_tokens", body=completion(max_tokens=0)),
    Bad("max-tokens-negative", C, 400, "max_tokens", body=completion(max_tokens=-1)),
    Bad("max-tokens-a-string", C, 400, "max_tokens", body=completion(max_tokens="1")),
    Bad("max-tokens-above-2-24", C, 400, "max_tokens", body=completion(max_tokens=2**24 + 1)),
    Bad("max-tokens-bad-beside-max-completion-tokens", C, 400, "max_tokens",
        body=completion(max_tokens="many", max_completion_tokens=1)),
    Bad("max-completion-tokens-zero", C, 400, "max_completion_tokens", body=completion(max_completion_tokens=0)),
    Bad("min-tokens-above-max-tokens", C, 400, "min_tokens", body=completion(min_tokens=5)),
    Bad("logprobs-above-5", C, 400, "logprobs", body=completion(logprobs=6)),
    Bad("logprobs-negative", C, 400, "logprobs", body=completion(logprobs=-1)),
    Bad("logprobs-a-bool", C, 400, "logprobs", body=completion(logprobs=True)),
    Bad("presence-penalty-above-2", C, 400, "presence_penalty", body=completion(presence_penalty=2.01)),
    Bad("frequency-penalty-below-minus-2", C, 400, "frequency_penalty", body=completion(frequency_penalty=-2.5)),
    Bad("repetition-penalty-zero", C, 400, "repetition_penalty", body=completion(repetition_penalty=0)),
    Bad("seed-beyond-64-bits", C, 400, "seed", body=completion(seed=2**63)),
    Bad("stream-a-string", C, 400, "stream", body=completion(stream="yes")),
    Bad("stream-options-without-stream", C, 400, "stream_options",
        body=completion(stream_options={"include_usage": True})),
    Bad("stream-with-beam-search", C, 400, "stream", body=completion(stream=True, use_beam_search=True, n=2)),
    Bad("stop-17-strings", C, 400, "stop", body=completion(stop=[f"s{i}" for i in range(17)])),
    Bad("stop-not-strings", C, 400, "stop", body=completion(stop=[1])),
    Bad("stop-empty-string", C, 400, "stop", body=completion(stop="")),
    Bad("stop-string-too-long", C, 400, "stop", body=completion(stop="x" * 257)),
    Bad("stop-token-id-negative", C, 400, "stop_token_ids", body=completion(stop_token_ids=[-1])),
    Bad("stop-token-ids-a-number", C, 400, "stop_token_ids", body=completion(stop_token_ids=0)),
    Bad("echo-a-string", C, 400, "echo", body=completion(echo="yes")),
    Bad("suffix-unsupported", C, 400, "suffix", body=completion(suffix="!")),
    Bad("logit-bias-key-not-a-token-id", C, 400, "logit_bias", body=completion(logit_bias={"a": 1})),
    Bad("logit-bias-above-100", C, 400, "logit_bias", body=completion(logit_bias={"5": 100.5})),
    Bad("logit-bias-outside-the-vocabulary", C, 400, "logit_bias", body=completion(logit_bias={"49152": 1})),
    Bad("logit-bias-301-entries", C, 400, "logit_bias", body=completion(logit_bias={str(i): 1 for i in range(301)})),
    Bad("prompt-logprobs-above-20", C, 400, "prompt_logprobs", body=completion(prompt_logprobs=21)),
    Bad("guided-choice-empty", C, 400, "guided_choice", body=completion(guided_choice=[])),
    # structured output: two at once names the second; what xgrammar rejects is a 400 before queueing
    Bad("guided-regex-and-guided-choice", C, 400, "guided_choice",
        body=completion(guided_regex="a", guided_choice=["a"])),
    Bad("guided-json-unsupported-type", C, 400, "guided_json", body=completion(guided_json={"type": "foo"})),
    Bad("guided-json-not-json", C, 400, "guided_json", body=completion(guided_json="{")),
    Bad("guided-regex-unclosed", C, 400, "guided_regex", body=completion(guided_regex="(ab")),
    Bad("guided-grammar-undefined-rule", C, 400, "guided_grammar", body=completion(guided_grammar="root ::= x")),
    Bad("beam-search-with-guided-json", C, 400, "guided_json",
        body=completion(use_beam_search=True, n=2, guided_json={"type": "object"})),
    Bad("beam-search-with-logit-bias", C, 400, "logit_bias",
        body=completion(use_beam_search=True, n=2, logit_bias={"5": 1})),
    Bad("user-a-number", C, 400, "user", body=completion(user=5)),
    Bad("length-penalty-without-beam-search", C, 400, "length_penalty", body=completion(length_penalty=2)),
    # both used to kill the scheduler (division by zero, overflow in its beam step)
    Bad("length-penalty-very-negative", C, 400, "length_penalty",
        body=completion(use_beam_search=True, n=2, max_tokens=3, length_penalty=-1000)),
    Bad("length-penalty-very-large", C, 400, "length_penalty",
        body=completion(use_beam_search=True, n=2, max_tokens=3, length_penalty=1000)),
    Bad("beam-width-above-32", C, 400, "n", body=completion(use_beam_search=True, n=33)),
    Bad("unknown-model", C, 404, "model", "model_not_found", body=completion(model="gpt-4")),
    # --- completions: the context length (64 tokens)
    Bad("prompt-over-the-context", C, 400, "prompt", CTX, body=completion(prompt=[TOKEN] * MAX_MODEL_LEN)),
    Bad("prompt-plus-max-tokens-one-over", C, 400, "prompt", CTX,
        body=completion(prompt=[TOKEN] * (MAX_MODEL_LEN - 1), max_tokens=2)),
    Bad("text-prompt-plus-default-max-tokens-over", C, 400, "prompt", CTX,
        body=without(completion(prompt="hi " * 100), "max_tokens")),
    # --- chat
    Bad("messages-missing", CHAT, 400, "messages", body=without(chat(), "messages")),
    Bad("messages-empty", CHAT, 400, "messages", body=chat(messages=[])),
    Bad("messages-a-string", CHAT, 400, "messages", body=chat(messages="hi")),
    Bad("message-not-an-object", CHAT, 400, "messages[0].role", body=chat(messages=["hi"])),
    Bad("role-unknown", CHAT, 400, "messages[0].role", body=chat(messages=[{"role": "wizard", "content": "hi"}])),
    Bad("role-missing", CHAT, 400, "messages[0].role", body=chat(messages=[{"content": "hi"}])),
    Bad("role-a-list", CHAT, 400, "messages[0].role",  # was a 500 (unhashable)
        body=chat(messages=[{"role": ["user"], "content": "hi"}])),
    Bad("content-missing", CHAT, 400, "messages[0].content", body=chat(messages=[{"role": "user"}])),
    Bad("content-a-number", CHAT, 400, "messages[0].content", body=chat(messages=[{"role": "user", "content": 5}])),
    Bad("content-an-image-part-to-a-text-model", CHAT, 400, "messages", "model_not_multimodal",
        body=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    Bad("second-message-content-an-object", CHAT, 400, "messages[1].content",
        body=chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": {}}])),
    Bad("chat-logprobs-a-string", CHAT, 400, "logprobs", body=chat(logprobs="true")),
    Bad("top-logprobs-above-20", CHAT, 400, "top_logprobs", body=chat(logprobs=True, top_logprobs=21)),
    Bad("top-logprobs-without-logprobs", CHAT, 400, "top_logprobs", body=chat(top_logprobs=2)),
    Bad("response-format-unknown-type", CHAT, 400, "response_format", body=chat(response_format={"type": "yaml"})),
    Bad("response-format-and-guided-json", CHAT, 400, "guided_json",
        body=chat(response_format={"type": "json_object"}, guided_json={"type": "object"})),
    Bad("response-format-json-schema-without-schema", CHAT, 400, "response_format",
        body=chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
    Bad("response-format-schema-xgrammar-rejects", CHAT, 400, "response_format",
        body=chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}})),
    Bad("tool-without-function", CHAT, 400, "tools", body=chat(tools=[{"type": "function"}])),
    # --- tools: tool_choice's rules (the default model's template has no tool-call format)
    Bad("tool-choice-without-tools", CHAT, 400, "tool_choice", body=chat(tool_choice="none")),
    Bad("tools-auto-without-a-tool-format", CHAT, 400, "tool_choice", body=chat(tools=TOOLS)),
    Bad("tool-choice-unknown-function", CHAT, 400, "tool_choice",
        body=chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_news"}})),
    Bad("tools-twice-the-same-function", CHAT, 400, "tools", body=chat(tools=TOOLS * 2, tool_choice="required")),
    Bad("tool-choice-required-and-response-format", CHAT, 400, "response_format",
        body=chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})),
    Bad("tool-parameters-the-grammar-library-rejects", CHAT, 400, "tools", body=chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}])),
    Bad("tool-choice-named-and-beam-search", CHAT, 400, "use_beam_search",
        body=chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  use_beam_search=True, n=2, temperature=0)),
    Bad("chat-max-tokens-zero", CHAT, 400, "max_tokens", body=chat(max_tokens=0)),
    Bad("chat-max-completion-tokens-negative", CHAT, 400, "max_completion_tokens",
        body=chat(max_completion_tokens=-1)),
    Bad("chat-temperature-negative", CHAT, 400, "temperature", body=chat(temperature=-1)),
    Bad("chat-over-the-context", CHAT, 400, "messages", CTX,
        body=chat(messages=[{"role": "user", "content": "hi " * 100}])),
    Bad("chat-unknown-model", CHAT, 404, "model", "model_not_found", body=chat(model="nope")),
    # --- the body itself
    Bad("invalid-utf8", C, 400, raw=b'{"prompt": "\xff\xfe hi", "max_tokens": 1}'),
    Bad("not-json", C, 400, raw=b"hello"),
    Bad("truncated-json", C, 400, raw=b'{"prompt": "hi"'),
    Bad("json-nan", C, 400, raw=b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}'),
    Bad("json-array", C, 400, raw=b"[1, 2]"),
    Bad("json-string", CHAT, 400, raw=b'"hi"'),
    Bad("empty-body", C, 400, raw=b""),
    Bad("100000-nested-lists", C, 400, raw=nested("[", "]", 100_000)),  # was a 500 (RecursionError)
    Bad("100000-nested-objects", CHAT, 400, raw=nested('{"a":', "}", 100_000)),
    Bad("content-type-text-plain", C, 400, raw=json.dumps(completion()).encode(),
        headers={"Content-Type": "text/plain"}),
    Bad("content-type-form", CHAT, 400, raw=json.dumps(chat()).encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"}),
    Bad("content-type-missing", C, 400, raw=json.dumps(completion()).encode(), headers={}),
    Bad("body-over-the-limit", C, 413, code="request_too_large", raw=BIG_BODY),
    # without a Content-Length the gateway can only count as it reads
    Bad("chunked-body-over-the-limit", CHAT, 413, code="request_too_large", raw=BIG_BODY, chunked=True),
    # --- routes and methods
    Bad("get-completions", C, 405, method="GET"),
    Bad("put-chat-completions", CHAT, 405, method="PUT", body=chat()),
    Bad("post-models", "/v1/models", 405, body={}),
    Bad("delete-health", "/health", 405, method="DELETE"),
    Bad("unknown-route", "/v1/nope", 404, method="GET"),
    Bad("legacy-engines-route", "/v1/engines/x/completions", 404, body=completion()),
    # --- logit_bias keys name each token once; max_tokens 0 is for completions only
    Bad("logit-bias-key-with-a-leading-zero", C, 400, "logit_bias", body=completion(logit_bias={"01": 1})),
    Bad("logit-bias-one-token-under-two-keys", CHAT, 400, "logit_bias", body=chat(logit_bias={"1": 50, "01": 50})),
    Bad("chat-max-tokens-0-with-prompt-logprobs", CHAT, 400, "max_tokens", body=chat(max_tokens=0, prompt_logprobs=1)),
    Bad("chat-max-completion-tokens-0", CHAT, 400, "max_completion_tokens",
        body=without(chat(max_completion_tokens=0, prompt_logprobs=0), "max_tokens")),
    # --- structured output: the 64 KiB limit on every spec's compact text
    Bad("guided-json-object-over-64-kib", C, 400, "guided_json",
        body=completion(guided_json={"enum": ["x" * 1000] * 66})),
    Bad("tools-parameters-over-64-kib", CHAT, 400, "tools", body=chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            "a": {"enum": ["x" * 1000] * 17}}}}} for i in range(4)])),
]


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--max-model-len", str(MAX_MODEL_LEN)).wait_ready()
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        # the 503s /health gave while the model loaded (Stack.wait_ready polls it); no other 5xx may follow
        stack.startup_errors = server_errors(client)
        assert set(stack.startup_errors) <= {("/health", "503")}, stack.startup_errors
        yield client


def test_the_table_is_large_and_its_ids_unique():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_malformed_request_gets_its_exact_error(http, case):
    response = case.send(http)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert (error["type"], error["param"], error["code"]) == (case.type, case.param, case.code)
    if case.status == 405:
        assert response.headers["allow"]


@pytest.mark.parametrize("prompt_len", [MAX_MODEL_LEN - 1, MAX_MODEL_LEN - 2], ids=["exactly-at", "one-under"])
def test_a_prompt_that_fits_the_context_is_served(http, prompt_len):
    response = http.post(C, json=completion(prompt=[TOKEN] * prompt_len, max_tokens=1, ignore_eos=True))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # earlier prompts of TOKEN share its blocks
    assert usage == {"prompt_tokens": prompt_len, "completion_tokens": 1, "total_tokens": prompt_len + 1}
    assert cached % 16 == 0 and cached <= prompt_len - 1


def test_chat_without_max_tokens_fills_the_context_exactly(http):
    # 32 words render to 62 tokens with SmolLM2's template (and its default system prompt): 2 to generate
    words = " ".join(["hi"] * 32)
    response = http.post(CHAT, json=without(chat(messages=[{"role": "user", "content": words}], ignore_eos=True),
                                            "max_tokens"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] <= 4  # keep this test cheap


def test_after_the_table_the_server_serves_and_holds_no_kv_block(stack, http):
    response = http.post(C, json=completion(prompt="The capital of France is", max_tokens=2, temperature=0))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    metrics = stack.wait_drained(10)
    assert metrics["pagoda:kv_cache_usage_perc"] == 0
    assert metrics["pagoda:num_requests_running"] == 0
    assert metrics["pagoda:num_requests_waiting"] == 0
    assert server_errors(http) == stack.startup_errors


def served(http: httpx.Client) -> dict[tuple[str, str], float]:
    """The gateway's own count of its answers, by (route, status)."""
    counts = {(labels["route"], labels["status"]): value
              for name, labels, value in parse_samples(http.get("/metrics").text) if name == "pagoda:http_requests_total"}
    assert counts, "no pagoda:http_requests_total sample"  # /health answered before this: never empty
    return counts


def server_errors(http: httpx.Client) -> dict[tuple[str, str], float]:
    return {key: count for key, count in served(http).items() if key[1].startswith("5")}


def test_openapi_document_describes_every_route(http):
    response = http.get("/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == set(ROUTES)
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["model"]["enum"] == [MODEL, None]
    assert request["prompt"]["anyOf"][2]["items"]["maximum"] == VOCAB_SIZE - 1


STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("path, body", [
    (C, completion(n=2, max_tokens=2, logprobs=2)),
    (C, completion(n=2, max_tokens=2, logprobs=2, **STREAMED)),
    (C, completion(prompt=[[TOKEN], [TOKEN, TOKEN]], max_tokens=2, stop=["\n"], **STREAMED)),
    (C, completion(n=2, best_of=3, max_tokens=2)),
    (C, completion(temperature=-1)),
    (CHAT, chat(n=2, max_tokens=2, logprobs=True, top_logprobs=2)),
    (CHAT, chat(n=2, max_tokens=2, logprobs=True, top_logprobs=2, **STREAMED)),
    (CHAT, chat(messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": "hi"}, {"role": "assistant"}], max_tokens=2, stream=True)),
    (CHAT, chat(model="nope")),
    # a named function without parameters: its call's arguments are `{}`, one or two tokens
    (CHAT, chat(tools=NO_ARGUMENTS_TOOL, tool_choice=GET_TIME, max_tokens=4)),
    (CHAT, chat(tools=NO_ARGUMENTS_TOOL, tool_choice=GET_TIME, max_tokens=4, **STREAMED)),
], ids=["completion", "completion-stream", "completion-two-prompts-stream", "completion-best-of",
        "completion-400", "chat", "chat-stream", "chat-parts-stream", "chat-404", "chat-named-function",
        "chat-named-function-stream"])
def test_real_answers_match_the_documented_schemas(stack, path, body):
    """Each answer, whole or each streamed event, against /openapi.json (schemathesis validates it)."""
    import schemathesis  # the test extra
    operation = schemathesis.openapi.from_url(stack.url + "/openapi.json")[path]["POST"]
    case = operation.Case(body=body)
    response = case.call(timeout=120)
    expected = "text/event-stream" if body.get("stream") else "application/json"
    assert response.headers["content-type"][0].startswith(expected), response.text
    case.validate_response(response)  # raises on a status, content type, header or body the document denies


# The CI run: the fuzzing phase only, 25 examples per operation, a fixed seed, and the hook that
# caps max_tokens at 2 (tests/schemathesis_hooks.py). scripts/fuzz.sh runs every phase, without the hook.
SCHEMATHESIS_CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_schema_conformance,response_headers_conformance,negative_data_rejection,"
                       "unsupported_method")


def test_schemathesis_finds_no_server_error_or_schema_violation(stack, http, tmp_path):
    before = served(http)
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", stack.url + "/openapi.json",
        "--checks", SCHEMATHESIS_CHECKS, "--phases", "fuzzing", "--max-examples", "25", "--seed", "1",
        "--workers", "1", "--request-timeout", "60", "--generation-database", "none", "--no-color",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(ROOT / "tests" / "schemathesis_hooks.py")}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", proc.stdout).groups())
    assert generated == passed >= 50, proc.stdout[-3000:]
    assert server_errors(http) == stack.startup_errors
    after = served(http)
    for path in (C, CHAT):  # the fuzzer reached the model on both endpoints, and the validation too
        assert after.get((path, "200"), 0) > before.get((path, "200"), 0), (path, after)
        assert after.get((path, "400"), 0) > before.get((path, "400"), 0), (path, after)
