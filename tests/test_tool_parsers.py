"""The model-native tool-call formats beside Hermes and Llama 3.1's JSON (gateway/tool_parsers.py):
Qwen3-Coder's XML, Mistral's [TOOL_CALLS] and the pythonic list, each on exact outputs and as
streamed deltas; a function the request does not declare staying text in every format; the
format detected from each template; and --enable-auto-tool-choice."""
from __future__ import annotations

import json

import pytest

from common.config import ConfigError, GatewayConfig
from common.tokenizer import load_tokenizer
from gateway.app import Gateway
from gateway.openai_api import parse_chat
from gateway.tokenizer import PromptEncoder
from gateway.tool_parsers import (
    HermesParser, Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser, detect_tool_call_format,
)
from gateway.tools import AUTO_TOOL_CHOICE_NEEDS_A_FORMAT, NO_ARGUMENTS
from tests.tool_calls import call, feed, message

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "hourly": {"type": "boolean"}, "limit": {"type": ["integer", "null"]}, "tags": {"type": "array"},
    "where": {"type": "object"}, "note": {"description": "no type"}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": NO_ARGUMENTS, "get_forecast": FORECAST}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
PARIS = '{"city": "Paris"}'
WEATHER_CALL, TIME_CALL = call("get_weather", PARIS), call("get_time", "{}")
# the parts of the templates that say which format they teach (Qwen3-Coder's, vLLM's Mistral and Llama 3.2 ones)
QWEN3_CODER_TEMPLATE = (
    "If you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
    "</tool_call>")
MISTRAL_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' and message['tool_calls'] %}"
                    "{{ '[TOOL_CALLS]' + message['content']|string + eos_token }}{% endif %}{% endfor %}")
PYTHONIC_TEMPLATE = ("{{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...)"
                     ", func_name2(params)] ' }}{{- \"Do not use variables.\\n\\n\" }}")


def qwen(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3-Coder writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_WEATHER, QWEN_TIME = qwen("get_weather", ("city", "Paris")), qwen("get_time")


def tool_calls(parser, text: str) -> list[dict]:
    """The calls of a whole output, each call's arguments as an object."""
    calls = message(parser, text)[0].get("tool_calls", [])
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


def header(index: int, name: str) -> dict:
    return {"tool_calls": [{"index": index, "type": "function", "function": {"name": name, "arguments": ""}}]}


def arguments(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


# ----------------------------------------------------------------------------- Qwen3-Coder

def test_qwen3_coder_a_call_alone_has_no_content():
    assert message(Qwen3CoderParser(SCHEMAS), QWEN_WEATHER) == (
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}, "tool_calls")


def test_qwen3_coder_text_before_the_calls_is_the_content_and_each_function_a_call():
    text = f"Let me look.\n{QWEN_WEATHER}\n{QWEN_TIME}"
    assert message(Qwen3CoderParser(SCHEMAS), text) == (
        {"role": "assistant", "content": "Let me look.", "tool_calls": [WEATHER_CALL, TIME_CALL]}, "tool_calls")


@pytest.mark.parametrize("text", [
    QWEN_WEATHER.removesuffix("</tool_call>"),
    QWEN_WEATHER.removesuffix("</function>\n</tool_call>"),
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
], ids=["no-tool-call-end", "no-function-end", "no-parameter-end", "no-tool-call-tags"])
def test_qwen3_coder_a_call_with_a_closing_tag_missing_is_a_call(text):
    assert message(Qwen3CoderParser(SCHEMAS), text)[0]["tool_calls"] == [WEATHER_CALL]


def test_qwen3_coder_values_take_the_type_their_schema_declares():
    text = qwen("get_forecast", ("city", "42"), ("days", "3"), ("ratio", "0.5"), ("hourly", "true"), ("limit", "null"),
                ("tags", '["a", "b"]'), ("where", '{"lat": 48.9}'), ("note", "7"), ("extra", "8"))
    assert tool_calls(Qwen3CoderParser(SCHEMAS), text) == [{"name": "get_forecast", "arguments": {
        "city": "42", "days": 3, "ratio": 0.5, "hourly": True, "limit": None, "tags": ["a", "b"],
        "where": {"lat": 48.9}, "note": "7", "extra": "8"}}]  # no type, or no property: the text


def test_qwen3_coder_a_value_that_is_not_its_types_json_stays_text_and_keeps_its_inner_newlines():
    text = qwen("get_forecast", ("days", "three"), ("hourly", "True"), ("city", "\nline one\nline two\n"))
    assert tool_calls(Qwen3CoderParser(SCHEMAS), text) == [{"name": "get_forecast", "arguments": {
        "days": "three", "hourly": "True", "city": "\nline one\nline two\n"}}]  # one newline off each end


def test_qwen3_coder_a_function_that_is_not_among_the_tools_stays_text():
    unknown = qwen("get_news", ("topic", "rain"))
    assert message(Qwen3CoderParser(SCHEMAS), unknown) == ({"role": "assistant", "content": unknown}, "stop")
    assert message(Qwen3CoderParser(SCHEMAS), f"{unknown}\n{QWEN_TIME}")[0]["tool_calls"] == [TIME_CALL]


def test_qwen3_coder_cut_off_in_a_value_the_call_has_what_was_written():
    """Its name and closed parameters have streamed already (vLLM's rule: the value runs to the end)."""
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert message(Qwen3CoderParser(SCHEMAS), text, "length") == (
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Par"}')]}, "tool_calls")
    cut = "Let me look.\n<tool_call>\n<function=get_wea"
    assert message(Qwen3CoderParser(SCHEMAS), cut, "length") == ({"role": "assistant", "content": cut}, "length")


def test_qwen3_coder_streams_the_name_then_each_parameter_as_it_closes():
    pieces = ["Let me look.\n<tool", "_call>\n<function=get_fore", "cast>\n<parameter=city>\nPar",
              "is\n</parameter>\n<parameter=days>\n3\n</parameter>\n", "</function>\n</tool_call>",
              f"\n{QWEN_TIME}", ""]
    assert feed(Qwen3CoderParser(SCHEMAS), pieces) == [
        [{"content": "Let me look."}],
        [],
        [header(0, "get_forecast")],
        [arguments(0, '{"city": "Paris", "days": 3')],
        [arguments(0, "}")],
        [header(1, "get_time"), arguments(1, "{}")],
        [],
    ]


def test_qwen3_coder_parallel_tool_calls_false_streams_the_first_call_only():
    text = f"{QWEN_WEATHER}\n{QWEN_TIME}"
    assert feed(Qwen3CoderParser(SCHEMAS), [text[:-8], text[-8:], ""], max_calls=1) == [
        [header(0, "get_weather"), arguments(0, PARIS)], [], []]


# ----------------------------------------------------------------------------- Mistral

MISTRAL_ARRAY = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {}}]')
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("text", [
    MISTRAL_ARRAY, MISTRAL_NAMED, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}[TOOL_CALLS]'
                                  'get_time[CALL_ID]f5g6h7i8j[ARGS]{}',
    '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}',
], ids=["json-array", "name-args", "with-call-ids", "args-token-skipped"])
def test_mistral_calls_alone_have_no_content(text):
    assert message(MistralParser(SCHEMAS), text) == (
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL, TIME_CALL]}, "tool_calls")


def test_mistral_text_before_the_calls_is_the_content():
    assert message(MistralParser(SCHEMAS), f"Let me look. {MISTRAL_ARRAY}")[0] == {
        "role": "assistant", "content": "Let me look.", "tool_calls": [WEATHER_CALL, TIME_CALL]}
    assert message(MistralParser(SCHEMAS), "It is sunny.") == ({"role": "assistant", "content": "It is sunny."}, "stop")


def test_mistral_an_array_without_its_closing_bracket_keeps_its_whole_calls():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti'
    assert message(MistralParser(SCHEMAS), text)[0]["tool_calls"] == [WEATHER_CALL]


def test_mistral_a_function_that_is_not_among_the_tools_stays_text():
    text = "[TOOL_CALLS]get_news[ARGS]{}"
    assert message(MistralParser(SCHEMAS), text) == ({"role": "assistant", "content": text}, "stop")
    assert message(MistralParser(SCHEMAS), text + "[TOOL_CALLS]get_time[ARGS]{}")[0]["tool_calls"] == [TIME_CALL]


def test_mistral_streams_the_content_then_each_call_when_its_json_closes():
    pieces = ["Sure. [TOOL", "_CALLS]get_weather[AR", 'GS]{"city": ', '"Paris"}', "[TOOL_CALLS]get_time[ARGS]{}", ""]
    assert feed(MistralParser(SCHEMAS), pieces) == [
        [{"content": "Sure."}], [], [], [header(0, "get_weather"), arguments(0, PARIS)],
        [header(1, "get_time"), arguments(1, "{}")], []]


def test_mistral_keeps_its_special_tokens_in_the_text(tokenizer):
    encoder = PromptEncoder(tokenizer, MISTRAL_TEMPLATE + "{{ messages[0].content }}")
    encoder.is_special_token = lambda text: text == "[TOOL_CALLS]"  # as in Mistral's tokenizers
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, encoder, len(tokenizer))
    assert parsed.tool_parser == MistralParser(SCHEMAS) and parsed.skip_special_tokens is False


# ----------------------------------------------------------------------------- pythonic

@pytest.mark.parametrize("text", [
    '[get_weather(city="Paris"), get_time()]',
    '<|python_start|>[get_weather(city="Paris"), get_time()]<|python_end|>',
    ' \n[get_weather(city="Paris"),\n get_time()]\n',
    '[get_weather(city="Paris"), get_time()',
], ids=["list", "llama4-wrapped", "whitespace", "no-closing-bracket"])
def test_pythonic_a_list_of_calls_is_the_calls(text):
    assert message(PythonicParser(SCHEMAS), text) == (
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL, TIME_CALL]}, "tool_calls")


def test_pythonic_values_are_python_literals_as_json():
    text = "[get_forecast(city='Paris', days=3, ratio=-0.5, hourly=True, limit=None, tags=('a', 'b'), where={'lat': 1})]"
    assert tool_calls(PythonicParser(SCHEMAS), text) == [{"name": "get_forecast", "arguments": {
        "city": "Paris", "days": 3, "ratio": -0.5, "hourly": True, "limit": None, "tags": ["a", "b"],
        "where": {"lat": 1}}}]


@pytest.mark.parametrize("text", [
    'Here you are: [get_weather(city="Paris")]', '[get_weather(city="Paris")] and more', "[1, 2] are numbers",
    '[get_weather("Paris")]', "[get_weather(city=town)]", "[get_weather(city={1, 2})]", "[get_weather(**where)]",
    "[__import__('os').system('true')]", "[get_news()]",
], ids=["text-before", "text-after", "not-calls", "positional", "variable", "set", "kwargs", "attribute", "unknown"])
def test_pythonic_anything_but_a_list_of_calls_to_the_tools_is_content(text):
    assert message(PythonicParser(SCHEMAS), text) == ({"role": "assistant", "content": text}, "stop")


def test_pythonic_a_function_that_is_not_among_the_tools_is_left_out():
    assert message(PythonicParser(SCHEMAS), "[get_news(), get_time()]")[0]["tool_calls"] == [TIME_CALL]


def test_pythonic_streams_text_at_once_and_the_calls_when_the_output_ends():
    assert feed(PythonicParser(SCHEMAS), ["It is", " sunny.", ""]) == [
        [{"content": "It is"}], [{"content": " sunny."}], []]
    assert feed(PythonicParser(SCHEMAS), ["<|python_", "start|>[get_weather(", 'city="Paris")]', ""]) == [
        [], [], [], [header(0, "get_weather"), arguments(0, PARIS)]]
    assert feed(PythonicParser(SCHEMAS), ["[1,", " 2] are numbers", ""]) == [
        [], [], [{"content": "[1, 2] are numbers"}]]


# ----------------------------------------------------------------------------- every format

@pytest.mark.parametrize("parser, text", [
    (HermesParser(SCHEMAS), '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>'),
    (Llama3JsonParser(SCHEMAS), '{"name": "get_news", "parameters": {}}'),
    (Qwen3CoderParser(SCHEMAS), qwen("get_news")),
    (MistralParser(SCHEMAS), '[TOOL_CALLS][{"name": "get_news", "arguments": {}}]'),
    (PythonicParser(SCHEMAS), "[get_news()]"),
], ids=["hermes", "llama3-json", "qwen3-coder", "mistral", "pythonic"])
def test_a_call_to_a_function_that_is_not_among_the_tools_stays_text(parser, text):
    assert message(parser, text) == ({"role": "assistant", "content": text}, "stop")
    content = "".join(delta.get("content", "") for step in feed(parser, [*text, ""]) for delta in step)
    assert content == text


def test_arguments_that_fail_the_schema_still_make_a_call():
    """As vLLM does: free output is not held to the schema (a grammar is, with tool_choice "required")."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}\n</tool_call>'
    assert message(HermesParser(SCHEMAS), text)[0]["tool_calls"] == [call("get_weather", '{"town": 3}')]


# ----------------------------------------------------------------------------- choosing the format

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_each_format_is_detected_from_its_template():
    assert detect_tool_call_format(QWEN3_CODER_TEMPLATE) == "qwen3_coder"  # it names <tool_call> too
    assert detect_tool_call_format(MISTRAL_TEMPLATE) == "mistral"
    assert detect_tool_call_format(PYTHONIC_TEMPLATE) == "pythonic"


@pytest.mark.parametrize("template, format, parser", [
    (QWEN3_CODER_TEMPLATE, "qwen3_coder", Qwen3CoderParser(SCHEMAS)),
    (MISTRAL_TEMPLATE, "mistral", MistralParser(SCHEMAS)),
    (PYTHONIC_TEMPLATE, "pythonic", PythonicParser(SCHEMAS)),
], ids=["qwen3-coder", "mistral", "pythonic"])
def test_auto_serves_the_detected_formats_parser_with_the_requests_tools(tokenizer, template, format, parser):
    encoder = PromptEncoder(tokenizer, template + "{{ messages[0].content }}")
    assert encoder.tool_call_format == format
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, encoder, len(tokenizer))
    assert parsed.tool_parser == parser
    assert PromptEncoder(tokenizer, None, format).tool_call_format == format  # --tool-call-parser names it


def test_enable_auto_tool_choice_refuses_to_start_without_a_format(tokenizer):
    with pytest.raises(ConfigError) as error:
        Gateway(GatewayConfig(enable_auto_tool_choice=True), tokenizer)  # the default model's template has none
    assert str(error.value) == AUTO_TOOL_CHOICE_NEEDS_A_FORMAT == (
        "--enable-auto-tool-choice needs a tool-call format, and the chat template teaches none that "
        "--tool-call-parser auto recognizes: pass --tool-call-parser hermes|llama3_json|qwen3_coder|mistral|pythonic|openai, "
        "or a --chat-template FILE that has one")
    gateway = Gateway(GatewayConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"), tokenizer)
    assert gateway.encoder.tool_call_format == "qwen3_coder"
