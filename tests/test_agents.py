"""The Responses and Messages APIs on the real stack, through the official clients (openai,
anthropic, openai-agents), on one scripted model (tests/scripted.py) whose greedy output the last
word of the conversation picks: "weather" a Hermes call of get_weather, "sunny" (a tool's result)
the answer, "plain" a plain answer. A second gateway on the same Redis continues a conversation
the first one stored. The thinking scripts ("ponder", "forecast") are served by a third gateway,
in process, that parses the thinking (--reasoning-parser deepseek_r1): under it, a script without
`</think>` would be all thinking, so the other tests keep the stack's gateway."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

import scripted
from common.config import GatewayConfig
from common.redis_server import free_port
from gateway.app import create_app
from tests.stack import Gateway, Stack, serve_app

pytestmark = pytest.mark.slow
CALL = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]
SCRIPTS = {
    "weather": CALL,
    "sunny": ["It is", " sunny in Paris."],
    "plain": ["Plain", " answer."],
    # thinking, then the answer; the template's empty think block (thinking off) ends in this
    # "</think>" too, so it is answered "\n\nDone pondering."
    "ponder": ["<think>", "Let me", " think.", "</think>", "\n\nDone", " pondering."],
    # thinking opened by the template (DeepSeek R1's way), then the call (the chains merge)
    "forecast": ["Checking", " the forecast.", "</think>\n", *CALL],
}
SPECIAL = ("<tool_call>", "</tool_call>")
FLAGS = ("--tool-call-parser", "hermes")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
PARIS = {"city": "Paris"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted.build(tmp_path_factory.mktemp("agents"), SCRIPTS, special=SPECIAL)


@pytest.fixture(scope="module")
def stack(model_dir):
    stack = Stack("--model", str(model_dir), *FLAGS, "--max-model-len", "512", "--num-gpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def second(stack, model_dir):
    gateway = Gateway(stack.redis_url, "--model", str(model_dir), *FLAGS).wait_ready()
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def thinking_url(stack, model_dir):
    """A gateway on the stack's Redis, in process, with --reasoning-parser deepseek_r1."""
    port = free_port()
    config = GatewayConfig(redis_url=stack.redis_url, model=str(model_dir), port=port, tool_call_parser="hermes",
                           reasoning_parser="deepseek_r1")
    with serve_app(create_app(config), port):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(stack.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def thinking_oai(thinking_url):
    return openai.OpenAI(base_url=thinking_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def thinking_claude(thinking_url):
    return anthropic.Anthropic(base_url=thinking_url, api_key="none", max_retries=0)


def prompt_tokens(model_dir, messages: list[dict]) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids if isinstance(ids, list) else ids["input_ids"])


# ----------------------------------------------------------------------------- Responses

def test_responses_create_answers_text_with_exact_usage(oai, model, model_dir):
    response = oai.responses.create(model=model, input="Say plain", instructions="Be brief.")
    assert (response.status, response.output_text, response.model) == ("completed", "Plain answer.", model)
    assert response.id.startswith("resp_") and [item.type for item in response.output] == ["message"]
    count = prompt_tokens(model_dir, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Say plain"}])
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (count, 3, count + 3)  # with </s>
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_responses_cut_by_max_output_tokens_is_incomplete(oai, model):
    response = oai.responses.create(model=model, input="Say plain", max_output_tokens=1)
    assert (response.status, response.incomplete_details.reason, response.output_text) == (
        "incomplete", "max_output_tokens", "Plain")


def test_responses_stream_sends_the_events_in_order(oai, model):
    events = list(oai.responses.create(model=model, input="Say plain", stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Plain", " answer."]
    final = events[-1].response
    assert final.output_text == "Plain answer." and final.usage.output_tokens == 3
    with oai.responses.stream(model=model, input="Say plain") as stream:
        assert stream.get_final_response().output_text == "Plain answer."


def test_responses_function_call_then_its_output_on_another_gateway(oai, model, second):
    first = oai.responses.create(model=model, input="What is the weather", tools=[RESPONSES_TOOL])
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", PARIS, "completed")
    other = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
    answer = other.responses.create(model=model, previous_response_id=first.id, tools=[RESPONSES_TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert (answer.status, answer.output_text, answer.previous_response_id) == (
        "completed", "It is sunny in Paris.", first.id)
    assert other.responses.retrieve(first.id).model_dump() == first.model_dump()


def test_a_streamed_function_call(oai, model):
    events = list(oai.responses.create(model=model, input="What is the weather", tools=[RESPONSES_TOOL], stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    call = events[-1].response.output[0]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", PARIS)


def test_an_unknown_previous_response_is_a_404(stack, model):
    response = httpx.post(stack.url + "/v1/responses", json={"model": model, "input": "hi",
                                                            "previous_response_id": "resp_nope"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "previous_response_id",
                                                              "not_found")
    assert httpx.get(stack.url + "/v1/responses/resp_nope").status_code == 404


def test_an_agent_calls_its_function_tool_and_answers_with_the_result(stack, model):
    import agents

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=model, openai_client=client))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather"))
    assert (calls, result.final_output) == (["Paris"], "It is sunny in Paris.")


# ----------------------------------------------------------------------------- Messages

def tool_turn(claude, model, **fields):
    return claude.messages.create(model=model, max_tokens=64, tools=[ANTHROPIC_TOOL],
                                  messages=[{"role": "user", "content": "What is the weather"}], **fields)


def test_messages_tool_use_then_its_result_answered(claude, model):
    first = tool_turn(claude, model)
    (block,) = first.content
    assert (first.stop_reason, block.type, block.name, block.input) == ("tool_use", "tool_use", "get_weather", PARIS)
    assert block.id.startswith("toolu_") and first.id.startswith("msg_")
    answer = claude.messages.create(model=model, max_tokens=64, tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": "What is the weather"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}])
    assert (answer.stop_reason, [(b.type, b.text) for b in answer.content]) == (
        "end_turn", [("text", "It is sunny in Paris.")])


def without_id(message) -> dict:
    body = message.model_dump(exclude_none=True)
    assert body.pop("id").startswith("msg_")
    for block in body["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return body


@pytest.mark.parametrize("fields", [{}, {"tools": [ANTHROPIC_TOOL]}], ids=["text", "tool_use"])
def test_messages_stream_ends_in_the_whole_message(claude, model, fields):
    cue = "What is the weather" if fields else "Say plain"
    body = dict(model=model, max_tokens=64, messages=[{"role": "user", "content": cue}], **fields)
    whole = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert without_id(streamed) == without_id(whole)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]


def test_a_stop_sequence_is_reported(claude, model):
    message = claude.messages.create(model=model, max_tokens=64, stop_sequences=[" answer"],
                                     messages=[{"role": "user", "content": "Say plain"}])
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == (
        "stop_sequence", " answer", "Plain")


def test_count_tokens_is_the_prompt_as_the_message_uses_it(claude, model, model_dir):
    body = dict(model=model, system="Be brief.", messages=[{"role": "user", "content": "Say plain"}])
    count = claude.messages.count_tokens(**body).input_tokens
    assert count == prompt_tokens(model_dir, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Say plain"}])
    usage = claude.messages.create(max_tokens=8, **body).usage
    assert usage.input_tokens + usage.cache_read_input_tokens == count and usage.output_tokens == 3


# ----------------------------------------------------------------------------- thinking (deepseek_r1)

PONDER = ("Let me think.", "\n\nDone pondering.")  # the "ponder" script's thinking and answer
FORECAST = "Checking the forecast."


def response_without_ids(response) -> dict:
    body = response.model_dump()
    assert body.pop("id").startswith("resp_")
    body.pop("created_at")
    for item in body["output"]:
        item.pop("id")
    return body


def test_responses_reasoning_item_comes_before_the_message_with_exact_usage(thinking_oai, model):
    response = thinking_oai.responses.create(model=model, input="Now ponder")
    reasoning, message = response.output
    assert (reasoning.type, [part.text for part in reasoning.content], reasoning.summary) == (
        "reasoning", [PONDER[0]], [])
    assert (message.type, response.output_text) == ("message", PONDER[1])
    usage = response.usage  # "<think>", "Let me", " think.", "</think>" think; "\n\nDone", " pondering.", </s>
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (7, 4)


def test_responses_stream_sends_the_reasoning_then_the_message(thinking_oai, model):
    whole = thinking_oai.responses.create(model=model, input="Now ponder")
    events = list(thinking_oai.responses.create(model=model, input="Now ponder", stream=True))
    added = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", *added, *["response.reasoning_text.delta"] * 2,
        "response.reasoning_text.done", *done, *added, *["response.output_text.delta"] * 2,
        "response.output_text.done", *done, "response.completed"]
    assert [e.delta for e in events if e.type.endswith("text.delta")] == ["Let me", " think.", "\n\nDone",
                                                                           " pondering."]
    assert [e.output_index for e in events[2:-1]] == [0] * 7 + [1] * 7
    assert response_without_ids(events[-1].response) == response_without_ids(whole)


def test_responses_thinking_then_a_function_call(thinking_oai, model):
    response = thinking_oai.responses.create(model=model, input="What is the forecast", tools=[RESPONSES_TOOL])
    reasoning, call = response.output
    assert (reasoning.type, [part.text for part in reasoning.content]) == ("reasoning", [FORECAST])
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", PARIS)
    assert response.usage.output_tokens_details.reasoning_tokens == 3  # "Checking", " the forecast.", "</think>\n"


def block_summary(block) -> tuple:
    """A content block's type and what it holds."""
    if block.type == "thinking":
        return "thinking", block.thinking, block.signature
    if block.type == "text":
        return "text", block.text
    return block.type, block.name, block.input


@pytest.mark.parametrize("cue, tools, expected, deltas, stop_reason", [
    ("Now ponder", [], [("thinking", PONDER[0], ""), ("text", PONDER[1])], ["Let me", " think."], "end_turn"),
    ("What is the forecast", [ANTHROPIC_TOOL], [("thinking", FORECAST, ""), ("tool_use", "get_weather", PARIS)],
     ["Checking", " the forecast."], "tool_use"),
], ids=["text", "tool_use"])
def test_messages_thinking_block_comes_first_whole_and_streamed(thinking_claude, model, cue, tools, expected,
                                                                deltas, stop_reason):
    body = dict(model=model, max_tokens=64, messages=[{"role": "user", "content": cue}], tools=tools)
    whole = thinking_claude.messages.create(**body)
    assert ([block_summary(b) for b in whole.content], whole.stop_reason) == (expected, stop_reason)
    with thinking_claude.messages.stream(**body) as stream:
        got = [e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        streamed = stream.get_final_message()
    assert got == deltas and without_id(streamed) == without_id(whole)


@pytest.mark.parametrize("thinking, expected, output_tokens", [
    # "<think>" and "Let me", then the forced "</think>" goes on as the script's does
    ({"type": "enabled", "budget_tokens": 2}, [("thinking", "Let me", ""), ("text", PONDER[1])], 6),
    ({"type": "enabled", "budget_tokens": 64}, [("thinking", PONDER[0], ""), ("text", PONDER[1])], 7),
    ({"type": "disabled"}, [("text", PONDER[1])], 3),  # the template's empty think block: no thinking
], ids=["cut", "within", "disabled"])
def test_messages_thinking_budget_and_switch(thinking_claude, model, thinking, expected, output_tokens):
    body = dict(model=model, max_tokens=64, messages=[{"role": "user", "content": "Now ponder"}], thinking=thinking)
    message = thinking_claude.messages.create(**body)
    assert ([block_summary(b) for b in message.content], message.usage.output_tokens) == (expected, output_tokens)
    with thinking_claude.messages.stream(**body) as stream:
        assert without_id(stream.get_final_message()) == without_id(message)


def test_without_a_reasoning_parser_the_thinking_budget_is_ignored(claude, model):
    message = claude.messages.create(model=model, max_tokens=64, thinking={"type": "enabled", "budget_tokens": 1},
                                     messages=[{"role": "user", "content": "Say plain"}])
    assert [block_summary(b) for b in message.content] == [("text", "Plain answer.")]


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("path, body, status, error", [
    ("/v1/responses", {"input": 3}, 400, {"param": "input", "type": "invalid_request_error"}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400,
     {"param": "max_output_tokens", "type": "invalid_request_error"}),
    ("/v1/responses", {"input": "hi", "model": "gpt-nope"}, 404, {"param": "model", "type": "invalid_request_error"}),
    ("/v1/responses", {"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "f"}},
     400, {"param": "tool_choice", "type": "invalid_request_error"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, 400, {"type": "invalid_request_error"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "bot", "content": "hi"}]}, 400,
     {"type": "invalid_request_error"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [ANTHROPIC_TOOL],
                      "tool_choice": {"type": "tool", "name": "nope"}}, 400, {"type": "invalid_request_error"}),
    ("/v1/messages", {"max_tokens": 4, "model": "claude-nope", "messages": [{"role": "user", "content": "hi"}]}, 404,
     {"type": "not_found_error"}),
    ("/v1/messages/count_tokens", {"messages": "hi"}, 400, {"type": "invalid_request_error"}),
], ids=lambda v: None)
def test_malformed_bodies_get_each_apis_error_and_leak_no_block(stack, path, body, status, error):
    response = httpx.post(stack.url + path, json=body)
    assert response.status_code == status, response.text
    got = response.json()
    if path.startswith("/v1/messages"):
        assert got["type"] == "error" and list(got["error"]) == ["type", "message"]
        assert got["error"]["type"] == error["type"] and got["error"]["message"]
    else:
        assert list(got["error"]) == ["message", "type", "param", "code"]
        assert {key: got["error"][key] for key in error} == error
    metrics = stack.wait_drained(10)
    assert metrics["pagoda:kv_cache_usage_perc"] == 0 and metrics["pagoda:num_requests_running"] == 0
