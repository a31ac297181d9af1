"""[openai-api] through the real stack: one `pagoda up` (the default model on CPU) for scoring (echo,
prompt logprobs), logit_bias, structured output and tool calls over HTTP, and the real clients
(lm-evaluation-harness, the openai SDK)."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


# ----------------------------------------------------------------------------- scoring: echo, prompt_logprobs, max_tokens 0
# (helper "scoring")


# ----------------------------------------------------------------------------- structured output, logit_bias, tools over HTTP
# (helper "api")

C, CHAT = "/v1/completions", "/v1/chat/completions"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, **body) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_response_format_json_schema_answers_json_that_validates(http):
    import jsonschema  # the test extra

    body = post(http, CHAT, messages=[{"role": "user", "content": "Describe a person: name and age."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                max_tokens=40, temperature=0)
    choice = body["choices"][0]
    person = json.loads(choice["message"]["content"])
    jsonschema.validate(person, PERSON)
    assert list(person) == ["name", "age"] and choice["finish_reason"] == "stop"


def test_completions_guided_choice_and_guided_regex_follow_the_constraint(http):
    choices = ["Paris", "London", "Berlin", "a city"]
    body = post(http, C, prompt="The capital of France is", guided_choice=choices, max_tokens=8, n=2, seed=1,
                temperature=1.0)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    for choice in body["choices"]:
        assert choice["text"] in choices and choice["finish_reason"] == "stop", choice
    body = post(http, C, prompt="Call me at", guided_regex=r" [0-9]{3}-[0-9]{4}", max_tokens=12, temperature=0.7,
                seed=3)
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", body["choices"][0]["text"]), body


def test_a_constrained_stream_concatenates_to_valid_json(http):
    import jsonschema

    text, finish = "", None
    with http.stream("POST", CHAT, json={
            "messages": [{"role": "user", "content": "Give me a person as JSON."}], "guided_json": PERSON,
            "max_tokens": 40, "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    finish = chunks[-1]["choices"][0]["finish_reason"]
    text = "".join(pieces)
    assert sum(1 for p in pieces if p) >= 3, pieces  # it streamed: several pieces, not one at the end
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == "stop"


def test_logit_bias_of_100_forces_its_token_and_minus_100_bans_one(http):
    from gateway.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    forced, = tokenizer.encode(" banana")
    body = post(http, C, prompt="The capital of France is", max_tokens=3, temperature=1.0, seed=0, logprobs=1,
                logit_bias={str(forced): 100})
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([forced])] * 3
    # the logprobs reported are the model's own, before the bias: the forced token is not its likeliest
    assert all(lp < -1.0 for lp in logprobs["token_logprobs"]), logprobs
    greedy = post(http, C, prompt="The capital of France is", max_tokens=1, temperature=0)["choices"][0]["text"]
    banned, = tokenizer.encode(greedy)
    other = post(http, C, prompt="The capital of France is", max_tokens=1, temperature=0,
                 logit_bias={str(banned): -100})["choices"][0]["text"]
    assert other != greedy and tokenizer.encode(other) != [banned]


# -- tools
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def tools_request(**fields) -> dict:
    return {"messages": ASK, "tools": TOOLS, "max_tokens": 40, "temperature": 0, **fields}


def check_call(call: dict) -> None:
    """An OpenAI tool call whose arguments validate against its function's parameters."""
    import jsonschema

    assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function", call
    schema = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema[call["function"]["name"]])


def streamed_calls(http: httpx.Client, body: dict) -> tuple[list[dict], str]:
    """The tool_calls deltas of a stream joined per index, and the last finish_reason."""
    with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    calls: dict[int, dict] = {}
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    for entry in (e for c in chunks for e in c["delta"].get("tool_calls", [])):
        if "id" in entry:  # a call's first delta: its id, type and name
            assert entry["index"] not in calls and entry["function"]["arguments"] == ""
            calls[entry["index"]] = {"id": entry["id"], "type": entry["type"], "function": dict(entry["function"])}
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    assert all(c["delta"].get("content") in (None, "") for c in chunks)
    return [calls[i] for i in sorted(calls)], chunks[-1]["finish_reason"]


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def test_tool_choice_required_answers_valid_calls_whole_and_streamed(http):
    body = tools_request(tool_choice="required", parallel_tool_calls=False)
    choice = post(http, CHAT, **body)["choices"][0]
    message = choice["message"]
    assert (message["role"], message["content"], choice["finish_reason"]) == ("assistant", None, "tool_calls")
    assert len(message["tool_calls"]) == 1  # parallel_tool_calls false: maxItems 1
    check_call(message["tool_calls"][0])
    calls, finish = streamed_calls(http, body)
    assert without_ids(calls) == without_ids(message["tool_calls"]) and finish == "tool_calls"


def test_a_named_function_answers_its_arguments_streamed_as_generated(http):
    body = tools_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = post(http, CHAT, **body)["choices"][0]
    call, = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "tool_calls"
    check_call(call)
    calls, finish = streamed_calls(http, body)
    assert without_ids(calls) == without_ids([call]) and finish == "tool_calls"


def test_tool_choice_auto_on_the_default_model_says_its_template_has_no_tool_format(http):
    response = http.post(CHAT, json=tools_request(tool_choice="auto"))
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": 'tool_choice "auto" (the default with tools) needs a chat template with a tool-call format, and '
                   'the served one has none: pass tool_choice "required" or {"type": "function", "function": '
                   '{"name": ...}} (the call is then constrained by a grammar, with any model), or serve a template '
                   "that has one (--chat-template FILE, --tool-call-parser)",
        "type": "invalid_request_error", "param": "tool_choice", "code": None}


def test_a_tool_result_goes_back_to_the_model_and_it_answers(http):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "15 degrees, sunny"}]
    choice = post(http, CHAT, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                  temperature=0)["choices"][0]
    assert choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")


# ----------------------------------------------------------------------------- real clients: lm-evaluation-harness, the openai SDK
# (helper "clients")
