"""The Responses and Messages APIs' translations (gateway/responses_api.py, gateway/messages_api.py):
request bodies to chat bodies, chat bodies and chunks (reasoning_content included) to each API's
objects and events, each checked against the official SDKs' types."""
from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway import messages_api, responses_api
from gateway.agents import BlockStream, turn_of
from gateway.openai_api import APIError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PARIS = '{"city": "Paris"}'
USAGE = {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
         "prompt_tokens_details": {"cached_tokens": 16}, "completion_tokens_details": {"reasoning_tokens": 4}}
# a chat answer with every block: reasoning, text, a call
CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
MESSAGE = {"role": "assistant", "reasoning_content": "Think.", "content": "Let me look.", "tool_calls": [CALL]}
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": MESSAGE, "logprobs": None, "finish_reason": "tool_calls"}], "usage": USAGE}


def chunk(delta: dict | None = None, finish_reason: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices,
            "usage": usage}


# the same answer streamed, as the chat path sends it
CHUNKS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Thi"}), chunk({"reasoning_content": "nk."}),
    chunk({"content": "Let me"}), chunk({"content": " look."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": PARIS}}]}, "tool_calls"),
    chunk(None, usage=USAGE),
]


# ----------------------------------------------------------------------------- Responses: the request

def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    body = {"model": "m", "input": "Hi there", "instructions": "Be brief.", "max_output_tokens": 5,
            "temperature": 0, "stream": True}
    assert responses_api.chat_request(body, responses_api.input_items(body["input"])) == {
        "model": "m", "temperature": 0, "max_completion_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]}


def test_items_become_messages_calls_join_the_assistant_message_and_outputs_are_tool_messages():
    items = responses_api.input_items([
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": PARIS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert responses_api.chat_messages(items) == [
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}]


def test_tools_tool_choice_text_format_and_reasoning_translate_to_chat():
    body = {"input": "x", "tools": [{"type": "function", "name": "get_weather", "description": "d",
                                     "parameters": WEATHER, "strict": True}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}}}
    chat = responses_api.chat_request(body, responses_api.input_items("x"))
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                               "parameters": WEATHER, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert "tool_choice" not in responses_api.chat_request({"input": "x", "tool_choice": "auto"}, [])


@pytest.mark.parametrize("body, param, text", [
    ({"input": 3}, "input", "input must be a string or a list of items"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be one of"),
    ({"input": [{"type": "input_image"}]}, "input", "input[0].type 'input_image' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input",
     "input[0].content[0] must be a text part"),  # an image by URL is one (docs/vision.md), a file id not
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "input[0].arguments must be a"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "tools[0] must be a function tool"),
    ({"input": "x", "instructions": 1}, "instructions", "instructions must be a string"),
])
def test_a_malformed_responses_body_is_a_400_naming_its_field(body, param, text):
    with pytest.raises(APIError) as caught:
        responses_api.chat_request(body, responses_api.input_items(body["input"]))
    assert (caught.value.status, caught.value.param) == (400, param) and caught.value.message.startswith(text)


# ----------------------------------------------------------------------------- Responses: the answer

def started() -> dict:
    return responses_api.started_response("1", 1, "m", {"input": "x"})


def test_a_chat_answer_is_a_reasoning_item_a_message_and_a_function_call():
    response = responses_api.response_object(started(), turn_of(CHAT), ["rs_1", "msg_1", "fc_1"])
    assert response["output"] == [
        {"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Think."}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"id": "fc_1", "type": "function_call", "call_id": "call_abc", "name": "get_weather", "arguments": PARIS,
         "status": "completed"}]
    assert response["usage"] == {
        "input_tokens": 20, "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 29}
    assert (response["id"], response["status"], response["incomplete_details"]) == ("resp_1", "completed", None)
    parsed = Response.model_validate(response)
    assert parsed.output_text == "Let me look."


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    chat = {**CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Plain"},
                                 "finish_reason": "length"}]}
    response = responses_api.response_object(started(), turn_of(chat), ["msg_1"])
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert response["output"][0]["status"] == "incomplete"
    Response.model_validate(response)


def responses_events(chunks: list[dict]) -> tuple[list[dict], dict]:
    """The Responses events (without created/completed) for the chunks, and the final response."""
    stream, blocks = responses_api.EventStream(), BlockStream()
    raw = [e for c in chunks for what in blocks.feed(c) for e in stream.on(*what)]
    raw += [e for what in blocks.close() for e in stream.on(*what)]
    events = []
    for text in raw:
        name, data = text.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        TypeAdapter(ResponseStreamEvent).validate_python(event)
        events.append(event)
    return events, responses_api.response_object(started(), blocks.turn(), stream.ids)


def test_the_stream_opens_streams_and_closes_each_item_in_order():
    events, response = responses_events(CHUNKS)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events] == [0] * 7 + [1] * 7 + [2] * 4
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["Thi", "nk.", "Let me", " look.", PARIS]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == response["output"]  # the items as the final response has them, ids included
    whole = responses_api.response_object(started(), turn_of(CHAT), [item["id"] for item in done])
    assert response == whole


# ----------------------------------------------------------------------------- Messages: the request

def test_a_messages_body_translates_to_chat():
    body = {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4, "metadata": {"user_id": "u"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                    {"type": "text", "text": "Thanks."}]}]}
    assert messages_api.chat_request(body) == {
        "model": "m", "temperature": 0.5, "top_k": 4, "max_completion_tokens": 64, "stop": ["END"],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                    "description": "d"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": True},
        "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
            {"role": "user", "content": "Thanks."}]}


@pytest.mark.parametrize("thinking, reasoning, expected", [
    ({"type": "enabled", "budget_tokens": 2}, True,
     {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 2}),
    # without a reasoning parser nothing tells the thinking's tokens apart: the budget is ignored
    ({"type": "enabled", "budget_tokens": 2}, False, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "enabled"}, True, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "adaptive"}, True, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "disabled"}, True, {"chat_template_kwargs": {"enable_thinking": False}}),
    ({"type": "between_tools"}, True, {}),
    (None, True, {}),
], ids=["budget", "budget-no-parser", "enabled", "adaptive", "disabled", "other", "absent"])
def test_thinking_maps_to_the_template_switch_and_the_thinking_budget(thinking, reasoning, expected):
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    if thinking is not None:
        body["thinking"] = thinking
    chat = messages_api.chat_request(body, reasoning=reasoning)
    assert {key: chat[key] for key in ("chat_template_kwargs", "thinking_token_budget") if key in chat} == expected


def test_a_named_tool_choice_is_that_function():
    chat = messages_api.chat_request({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                      "tool_choice": {"type": "tool", "name": "f"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("body, param, text", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens: Field required"),
    ({"max_tokens": 1, "messages": []}, "messages", "messages must be a non-empty list"),
    ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, "messages", "messages[0].role must be"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages",
     "messages[0].content[0].source must be an object"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     "messages", "messages[0].content[0].source.type must be 'base64' or 'url'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "u"}}]}]}, "messages",
     "messages[1].content[0].type 'image' is not supported in a assistant message"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, "messages",
     "messages[0].content[0].type 'tool_use' is not supported in a user message"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}},
     "tool_choice", "tool_choice must be"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124"}]},
     "tools", "tools[0] must be a client tool"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": "on"}, "thinking",
     "thinking must be an object"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens",
     "thinking.budget_tokens must be an integer >= 0"),
])
def test_a_malformed_messages_body_is_a_400_naming_its_field(body, param, text):
    with pytest.raises(APIError) as caught:
        messages_api.chat_request(body)
    assert (caught.value.status, caught.value.param) == (400, param) and caught.value.message.startswith(text)
    response = messages_api.Messages().error(caught.value)
    assert response.status_code == 400
    # each message names its field first, once
    assert json.loads(response.body) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                    "message": caught.value.message}}


@pytest.mark.parametrize("param, message, api, expected", [
    ("max_completion_tokens", "max_completion_tokens must be an integer", "messages", "max_tokens must be an integer"),
    ("stop", "stop must be a string or a list", "messages", "stop_sequences must be a string or a list"),
    ("max_completion_tokens", "max_completion_tokens must be an integer", "responses",
     "max_output_tokens must be an integer"),
    ("temperature", "temperature must be >= 0", "messages", "temperature must be >= 0"),
    ("stop", "stopping early is not allowed", "messages", "stop_sequences: stopping early is not allowed"),
])
def test_a_chat_error_names_the_apis_field_in_its_message_too(param, message, api, expected):
    error = APIError(400, message, "invalid_request_error", param)
    if api == "messages":
        body = json.loads(messages_api.Messages().error(error).body)["error"]
    else:
        body = json.loads(responses_api.Responses(None).error(error).body)["error"]
    assert body["message"] == expected


def test_a_named_tool_choice_without_tools_is_chats_error_about_tools():
    chat = responses_api.chat_request({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, [])
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}} and "tools" not in chat


@pytest.mark.parametrize("status, kind", [(401, "authentication_error"), (404, "not_found_error"),
                                          (429, "rate_limit_error"), (503, "overloaded_error"), (500, "api_error")])
def test_errors_are_anthropics_types(status, kind):
    response = messages_api.Messages().error(APIError(status, "no"))
    assert (response.status_code, json.loads(response.body)) == (status, {"type": "error", "error": {
        "type": kind, "message": "no"}})


# ----------------------------------------------------------------------------- Messages: the answer

def test_a_chat_answer_is_a_thinking_a_text_and_a_tool_use_block():
    message = messages_api.message_object("msg_1", "m", turn_of(CHAT))
    assert message == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Think.", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 9, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 16}}
    Message.model_validate(message)


@pytest.mark.parametrize("finish_reason, stop_string, expected", [
    ("stop", None, ("end_turn", None)), ("stop", "END", ("stop_sequence", "END")),
    ("length", None, ("max_tokens", None)), ("tool_calls", None, ("tool_use", None))])
def test_stop_reasons(finish_reason, stop_string, expected):
    chat = {**CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                 "finish_reason": finish_reason}]}
    assert messages_api.stop_of(turn_of(chat, stop_string)) == expected


def test_the_stream_accumulates_in_the_sdk_to_the_whole_message():
    blocks = BlockStream()
    pairs = [p for c in CHUNKS for what in blocks.feed(c) for p in messages_api.block_events(*what)]
    pairs += [p for what in blocks.close() for p in messages_api.block_events(*what)]
    assert [(name, data.get("index"), data.get("delta", {}).get("type")) for name, data in pairs] == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None)]
    whole = messages_api.message_object("msg_1", "m", turn_of(CHAT))
    start = {"type": "message_start", "message": {**messages_api.message_object("msg_1", "m", BlockStream().turn()),
                                                  "usage": {"input_tokens": 20, "output_tokens": 0}}}
    stop_reason, stop_sequence = messages_api.stop_of(blocks.turn())
    end = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
           "usage": messages_api.message_usage(blocks.turn().usage)}
    snapshot, json_bufs = None, {}
    adapter = TypeAdapter(RawMessageStreamEvent)
    for data in [start, *(data for _, data in pairs), end, {"type": "message_stop"}]:
        snapshot = accumulate_event(event=adapter.validate_python(data), current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot.model_dump(exclude_none=True) == Message.model_validate(whole).model_dump(exclude_none=True)


def test_count_tokens_counts_tools_on_a_model_without_a_tool_call_format():
    """Claude Code counts a prompt with its tools and no tool_choice: the count needs no format to
    parse calls with (the default model's template has none), only the template's rendering."""
    from starlette.testclient import TestClient

    from common.config import GatewayConfig
    from common.tokenizer import load_tokenizer
    from gateway.app import create_app

    tokenizer = load_tokenizer("default")
    client = TestClient(create_app(GatewayConfig(), tokenizer=tokenizer))  # no lifespan: Redis is not needed
    tool = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}
    response = client.post("/v1/messages/count_tokens", json=body)
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                    "parameters": WEATHER}}]
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=chat_tools,
                                             add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert response.status_code == 200 and response.json() == {"input_tokens": len(expected)}
