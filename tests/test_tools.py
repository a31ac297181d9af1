"""Tool calls (gateway/tools.py): the parsers of each format on exact outputs, the streamed deltas
and the whole message they make (the deltas add up to the message), tool_choice's rules, and the
conversation with calls as the default model's chat template renders it."""
from __future__ import annotations

import json

import pytest

from common.config import ConfigError, GatewayConfig
from common.protocol import RequestEvent
from common.structured_output import json_schema_spec
from common.tokenizer import load_tokenizer
from gateway.app import Gateway
from gateway.detokenizer import IncrementalDetokenizer
from gateway.models import ChatCompletionRequest, InvalidField
from gateway.openai_api import parse_chat
from gateway.serving import ChoiceState, ResponseShape
from gateway.tokenizer import PromptEncoder
from gateway.tool_parsers import (
    HermesParser, Llama3JsonParser, MistralParser, NamedParser, PythonicParser, Qwen3CoderParser, RequiredParser,
    detect_tool_call_format, tool_call_format,
)
from gateway.tools import FORMAT_MISSING, NO_ARGUMENTS, ToolCallStream, chat_messages, tool_calling
from tests.tool_calls import call, concatenated, feed, message

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": NO_ARGUMENTS}  # what the parsers of a request with TOOLS get
PARIS = '{"city": "Paris"}'
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
# the parts of the templates that say which format they teach (Qwen 2.5's and Llama 3.1's words)
HERMES_TEMPLATE = ("{%- if tools %}For each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags{%- endif %}")
LLAMA31_TEMPLATE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                    'its value}.{%- if builtin_tools is defined %}<|python_tag|>{%- endif %}')
# a template that renders tools and tool_calls itself (the arguments with tojson, as Qwen 2.5's does)
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


# ----------------------------------------------------------------------------- Hermes

def test_hermes_a_call_alone_has_no_content():
    assert message(HermesParser(), HERMES_CALL) == (
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", PARIS)]}, "tool_calls")


def test_hermes_text_before_the_calls_is_the_content_and_each_block_a_call():
    text = f"Let me look.\n{HERMES_CALL}\n{HERMES_TIME}"
    assert message(HermesParser(), text) == ({"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("get_weather", PARIS), call("get_time", "{}")]}, "tool_calls")


def test_hermes_parallel_tool_calls_false_keeps_the_first_call():
    body, reason = message(HermesParser(), f"{HERMES_CALL}\n{HERMES_TIME}", max_calls=1)
    assert body["tool_calls"] == [call("get_weather", PARIS)] and reason == "tool_calls"


def test_hermes_text_without_a_call_is_all_content():
    assert message(HermesParser(), "It is sunny.") == ({"role": "assistant", "content": "It is sunny."}, "stop")


def test_hermes_a_block_cut_off_is_content_and_keeps_length():
    text = '<tool_call>\n{"name": "get_weather", "argu'
    assert message(HermesParser(), text, "length") == ({"role": "assistant", "content": text}, "length")


def test_hermes_a_whole_call_without_its_closing_tag_is_a_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert message(HermesParser(), text)[0]["tool_calls"] == [call("get_weather", PARIS)]


def test_hermes_a_block_that_is_not_a_call_is_left_out():
    text = f'<tool_call>\n{{"arguments": {{}}}}\n</tool_call>\n{HERMES_CALL}'
    assert message(HermesParser(), text)[0]["tool_calls"] == [call("get_weather", PARIS)]
    assert message(HermesParser(), "<tool_call>\nnot json\n</tool_call>") == (
        {"role": "assistant", "content": "<tool_call>\nnot json\n</tool_call>"}, "stop")


def test_hermes_streams_the_content_then_each_call_when_its_block_closes():
    pieces = ["Let me", " look. <tool", '_call>\n{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}\n</tool_call>', "\n<tool_call>", HERMES_TIME[11:], ""]
    assert feed(HermesParser(), pieces) == [
        [{"content": "Let me"}],
        [{"content": " look."}],  # "<tool" could begin a call, and the space before it could end the content
        [],
        [{"tool_calls": [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
         {"tool_calls": [{"index": 0, "function": {"arguments": PARIS}}]}],
        [],
        [{"tool_calls": [{"index": 1, "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
         {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}],
        [],
    ]


def test_hermes_held_text_that_was_no_call_is_sent_at_the_end():
    assert feed(HermesParser(), ["a <tool", "box> b", " <tool_call>\nnot json", ""]) == [
        [{"content": "a"}], [{"content": " <toolbox> b"}], [], [{"content": " <tool_call>\nnot json"}]]


# ----------------------------------------------------------------------------- Llama 3.1 JSON

@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ' \n{"name": "get_weather", "arguments": {"city": "Paris"}}',
], ids=["json", "after-python-tag", "arguments-key"])
def test_llama3_json_a_call(text):
    assert message(Llama3JsonParser(), text) == (
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", PARIS)]}, "tool_calls")


def test_llama3_json_calls_separated_by_semicolons():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert message(Llama3JsonParser(), text)[0]["tool_calls"] == [call("get_weather", PARIS), call("get_time", "{}")]


@pytest.mark.parametrize("text, reason", [
    ("It is sunny in Paris.", "stop"), ('{"answer": 42}', "stop"),
    ('{"name": "get_weather", "parameters": {"ci', "length"),
], ids=["text", "json-not-a-call", "cut-off"])
def test_llama3_json_anything_else_is_content(text, reason):
    assert message(Llama3JsonParser(), text, reason) == ({"role": "assistant", "content": text}, reason)


def test_llama3_json_streams_text_at_once_and_a_call_when_its_object_closes():
    assert feed(Llama3JsonParser(), ["It is", " sunny.", ""]) == [[{"content": "It is"}], [{"content": " sunny."}], []]
    pieces = ["<|python", '_tag|>{"name": "get_weather", "parameters": ', '{"city": "Paris"}', "}", ""]
    assert feed(Llama3JsonParser(), pieces) == [[], [], [], [
        {"tool_calls": [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": PARIS}}]}], []]
    assert feed(Llama3JsonParser(), ['{"answer":', " 42}", ""]) == [[], [], [{"content": '{"answer": 42}'}]]


# ----------------------------------------------------------------------------- required, named

def test_required_the_array_is_the_calls():
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    assert message(RequiredParser(), text) == ({"role": "assistant", "content": None, "tool_calls": [
        call("get_weather", PARIS), call("get_time", "{}")]}, "tool_calls")
    cut = '[{"name":"get_weather","parameters":{"ci'
    assert message(RequiredParser(), cut, "length") == ({"role": "assistant", "content": cut}, "length")


def test_required_streams_the_calls_when_the_array_closes():
    pieces = ['[{"name":"get_weather",', '"parameters":{"city":"Paris"}}', "]", ""]
    assert feed(RequiredParser(), pieces) == [[], [], [
        {"tool_calls": [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": PARIS}}]}], []]


def test_named_the_output_is_the_arguments_and_streams_as_generated():
    parser = NamedParser("get_weather")
    assert message(parser, '{"city":"Paris"}') == (
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city":"Paris"}')]}, "tool_calls")
    assert message(parser, '{"city":"Pa', "length") == ({"role": "assistant", "content": '{"city":"Pa'}, "length")
    assert feed(parser, ['{"city":', '"Paris"}', ""]) == [
        [{"tool_calls": [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
         {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}],
        [{"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}],
        [],
    ]


QWEN_CALLS = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_news>\n"
              "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
FORECAST = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), f"Sure, I will check the weather <tools> for you.\n{HERMES_CALL}\n{HERMES_TIME}"),
    (HermesParser(), "No <tool_call> here after all"),
    (HermesParser(SCHEMAS), f'<tool_call>\n{{"name": "get_news", "arguments": {{}}}}\n</tool_call>\n{HERMES_TIME}'),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                         '{"name": "get_time", "parameters": {}}'),
    (Llama3JsonParser(), "  <|python_ta and then text"),
    (Qwen3CoderParser({**SCHEMAS, "get_weather": FORECAST}), QWEN_CALLS),
    (Qwen3CoderParser(SCHEMAS), "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    (Qwen3CoderParser(SCHEMAS), "A <tool_call> that never was"),
    (MistralParser(SCHEMAS), 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                             '{"name": "get_time", "arguments": {}}]'),
    (MistralParser(SCHEMAS), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_news[ARGS]{}'
                             "[TOOL_CALLS]get_time[ARGS]{}"),
    (MistralParser(SCHEMAS), "[TOOL_CALLS] is what I would write"),
    (PythonicParser(SCHEMAS), '<|python_start|>[get_weather(city="Paris"), get_time()]<|python_end|>'),
    (PythonicParser(SCHEMAS), "[1, 2] are numbers"),
    (RequiredParser(), '[{"name":"get_weather","parameters":{"city":"Paris"}}]'),
    (NamedParser("get_weather"), '{"city":"Paris"}'),
], ids=["hermes", "hermes-no-call", "hermes-unknown-function", "llama3-json", "llama3-json-no-call", "qwen3-coder",
        "qwen3-coder-cut-off", "qwen3-coder-no-call", "mistral-array", "mistral-named", "mistral-no-call", "pythonic",
        "pythonic-no-call", "required", "named"])
def test_the_deltas_add_up_to_the_message_however_the_text_is_cut(parser, text):
    body, _ = message(parser, text)
    cuts = [[text[:cut], text[cut:], ""] for cut in range(len(text) + 1)]
    for pieces in [*cuts, [*text, ""]]:
        content, calls = concatenated(feed(parser, pieces))
        assert (content, calls) == (body["content"], body.get("tool_calls", []))


def test_a_streamed_choice_carries_its_logprobs_and_the_finish_reason_on_its_last_chunk(tokenizer):
    shape = ResponseShape.new("chat", "m", 0, lambda t: tokenizer.decode([t]), "abc")
    choice = ChoiceState(0, "r", IncrementalDetokenizer(tokenizer), [], frozenset(), 0.0,
                         tools=ToolCallStream(RequiredParser()))
    ids = tokenizer.encode('[{"name":"get_time","parameters":{}}]')
    choice.add(RequestEvent("r", ids, [[-0.5, [[i, -0.5]]] for i in ids], "stop"))
    chunks = shape.choice_deltas(choice, *choice.take_delta())
    assert [c["finish_reason"] for c in chunks] == [None, "tool_calls"]
    assert chunks[0]["logprobs"] is None and len(chunks[1]["logprobs"]["content"]) == len(ids)
    assert chunks[1]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    body = shape.body([choice], {})["choices"][0]
    assert body["finish_reason"] == "tool_calls" and body["message"]["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": "{}"}


# ----------------------------------------------------------------------------- tool_choice

def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_decides_the_tools_the_grammar_and_the_parser():
    none = tool_calling(request(tools=TOOLS, tool_choice="none"), "hermes")
    assert (none.tools, none.structured_output, none.parser) == (None, None, None)
    auto = tool_calling(request(tools=TOOLS), "hermes")
    assert auto.tools == TOOLS and auto.structured_output is None and auto.parser == HermesParser(SCHEMAS)
    assert tool_calling(request(tools=TOOLS, tool_choice="auto"), "llama3_json").parser == Llama3JsonParser(SCHEMAS)
    required = tool_calling(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    assert required.parser == RequiredParser() and required.max_calls == 1
    assert json.loads(required.structured_output.spec) == ({"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "anyOf": [{"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
                   "required": ["name", "parameters"]},
                  {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": NO_ARGUMENTS},
                   "required": ["name", "parameters"]}]}})
    assert required.structured_output.kind == "json_schema"
    named = tool_calling(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                         None)
    assert (named.structured_output, named.parser) == (json_schema_spec(WEATHER), NamedParser("get_weather"))
    assert tool_calling(request(), None).parser is None


@pytest.mark.parametrize("fields, param, text", [
    (dict(tool_choice="none"), "tool_choice", "tool_choice is only allowed when tools are given"),
    (dict(tools=TOOLS), "tool_choice", FORMAT_MISSING),
    (dict(tools=TOOLS, tool_choice="auto"), "tool_choice", FORMAT_MISSING),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_news"}}), "tool_choice",
     "tool_choice names the function 'get_news', which is not among tools (get_weather, get_time)"),
    (dict(tools=TOOLS + TOOLS[:1], tool_choice="required"), "tools",
     "tools declares the function 'get_weather' more than once"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "response_format cannot be combined with tool_choice \"required\": the output is the call's JSON"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, guided_regex="a+"),
     "guided_regex", "guided_regex cannot be combined with tool_choice {function: 'get_time'}: the output is the "
                     "call's JSON"),
    (dict(tools=TOOLS, tool_choice="required", use_beam_search=True), "use_beam_search",
     'tool_choice "required" is not supported with use_beam_search'),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "text"}, use_beam_search=True),
     "use_beam_search", 'tool_choice "required" is not supported with use_beam_search'),
], ids=["choice-without-tools", "auto-by-default-without-a-format", "auto-without-a-format", "unknown-function",
        "duplicate-function", "required-and-response-format", "named-and-guided-regex", "required-and-beam-search",
        "response-format-text-is-no-grammar"])
def test_tool_choice_errors(fields, param, text):
    with pytest.raises(InvalidField) as error:
        tool_calling(request(**fields), None)
    assert (error.value.param, str(error.value)) == (param, text)


def test_the_format_is_detected_from_the_template_unless_named(tokenizer):
    assert detect_tool_call_format(HERMES_TEMPLATE) == "hermes"
    assert detect_tool_call_format(LLAMA31_TEMPLATE) == "llama3_json"
    assert detect_tool_call_format(tokenizer.chat_template) is None  # the default model's: plain ChatML
    assert tool_call_format("auto", "{{ messages }}") is None
    assert tool_call_format("hermes", "{{ messages }}") == "hermes"
    with pytest.raises(ValueError):
        tool_call_format("granite", HERMES_TEMPLATE)


# ----------------------------------------------------------------------------- the conversation

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15 C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_a_round_trip_renders_with_the_default_template_as_hermes_text(tokenizer):
    encoder = PromptEncoder(tokenizer)
    parsed = parse_chat({"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "required"}, encoder, len(tokenizer))
    assert tokenizer.decode(parsed.prompts[0]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>\n"
        "<|im_start|>tool\n15 C, sunny<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert parsed.params.structured_output.kind == "json_schema" and parsed.tool_parser == RequiredParser()
    assert parsed.structured_param == "tools"  # the gateway's grammar check names the field


def test_a_template_that_renders_tool_calls_gets_them_with_their_arguments_as_objects(tokenizer):
    encoder = PromptEncoder(tokenizer, TOOLS_TEMPLATE)
    parsed = parse_chat({"messages": CONVERSATION + [{"role": "assistant", "content": "Sunny."}], "tools": TOOLS,
                         "tool_choice": "none"}, encoder, len(tokenizer))
    assert tokenizer.decode(parsed.prompts[0]) == (
        "user: Weather in Paris?\nassistant: [get_weather {\"city\": \"Paris\"}]\ntool: 15 C, sunny (call_1)\n"
        "assistant: Sunny.\nassistant:")  # "none": the tools are not rendered
    parsed = parse_chat({"messages": CONVERSATION[:1], "tools": TOOLS, "tool_choice": "required"}, encoder,
                        len(tokenizer))
    assert tokenizer.decode(parsed.prompts[0]) == "tools: get_weather get_time\nuser: Weather in Paris?\nassistant:"


def test_a_chat_template_file_with_a_tool_format_serves_auto(tokenizer):
    encoder = PromptEncoder(tokenizer, HERMES_TEMPLATE + "{{ messages[0].content }}")
    parsed = parse_chat({"messages": CONVERSATION[:1], "tools": TOOLS}, encoder, len(tokenizer))
    assert parsed.tool_parser == HermesParser(SCHEMAS) and parsed.params.structured_output is None
    assert parsed.skip_special_tokens  # <tool_call> is no special token of this tokenizer: nothing to keep


def test_the_gateway_serves_the_chat_template_file_and_the_parser_it_is_given(tokenizer, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(HERMES_TEMPLATE + "{{ messages[0].content }}")
    encoder = Gateway(GatewayConfig(chat_template=str(template)), tokenizer).encoder
    assert (encoder.chat_template, encoder.tool_call_format) == (template.read_text(), "hermes")
    assert Gateway(GatewayConfig(tool_call_parser="llama3_json"), tokenizer).encoder.tool_call_format == "llama3_json"
    with pytest.raises(ConfigError, match="chat_template must be a file"):
        GatewayConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_a_call_the_client_sends_back_renders_as_it_came(tokenizer):
    """Arguments that are not the JSON of an object (a model can make such a call) stay text, and a
    tool message without its call's id renders without it: neither is refused."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{city"}}]},
                {"role": "tool", "content": "15 C"}]
    parsed = parse_chat({"messages": messages}, PromptEncoder(tokenizer), len(tokenizer))
    assert tokenizer.decode(parsed.prompts[0]).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": "{city"}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n15 C<|im_end|>\n<|im_start|>assistant\n")


def test_chat_messages_without_tools_are_as_before():
    messages = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant"}]}).messages
    assert chat_messages(messages, True) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}]


def test_the_required_grammar_accepts_a_call_and_refuses_an_unknown_function(tokenizer):
    xgr = pytest.importorskip("xgrammar")
    from common.structured_output import compile_structured_output

    spec = tool_calling(request(tools=TOOLS, tool_choice="required"), None).structured_output
    compiled = compile_structured_output(xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)), spec)
    assert xgr.GrammarMatcher(compiled).accept_string('[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert not xgr.GrammarMatcher(compiled).accept_string('[{"name":"get_news"')
    body, _ = message(RequiredParser(), '[{"name":"get_weather","parameters":{"city":"Paris"}}]')
    assert json.loads(body["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.fixture(scope="module")
def accepts(tokenizer):
    """Whether the grammar of a spec, compiled as the worker does, accepts a text and then the end."""
    xgr = pytest.importorskip("xgrammar")
    from common.structured_output import compile_structured_output

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))

    def accepts(spec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compile_structured_output(compiler, spec))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    return accepts


def test_required_lifts_each_tools_defs_to_the_root_so_a_pydantic_model_compiles(accepts):
    import jsonschema
    from pydantic import BaseModel

    class Place(BaseModel):
        city: str

    class Trip(BaseModel):
        start: Place
        stops: list[Place]

    tree = {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {
        "$ref": "#"}}, "left": {"$ref": "#/definitions/Node"}}, "required": ["value"],
        "definitions": {"Node": {"$ref": "#/properties/value"}}}  # draft 7's container, "#" and a path from the root
    tools = [{"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}},
             {"type": "function", "function": {"name": "tree", "parameters": tree}}]
    spec = tool_calling(request(tools=tools, tool_choice="required"), None).structured_output
    schema = json.loads(spec.spec)
    place = {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"], "title": "Place",
             "type": "object"}
    # parameters that refer to themselves ("#", "#/properties/...") move to the root's $defs too
    moved_tree = {**tree, "properties": {**tree["properties"], "children": {"type": "array", "items": {
        "$ref": "#/$defs/tree"}}, "left": {"$ref": "#/definitions/tree.Node"}}}
    del moved_tree["definitions"]
    assert schema["$defs"] == {"plan_trip.Place": place, "tree": moved_tree}
    assert schema["definitions"] == {"tree.Node": {"$ref": "#/$defs/tree/properties/value"}}
    trip, tree_call = (call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    assert trip["properties"]["start"] == {"$ref": "#/$defs/plan_trip.Place"} and "$defs" not in trip
    assert tree_call == {"$ref": "#/$defs/tree"}
    calls = ('[{"name": "plan_trip", "parameters": {"start": {"city": "Paris"}, "stops": [{"city": "Lyon"}]}}, '
             '{"name": "tree", "parameters": {"value": 1, "children": [{"value": 2}], "left": 3}}]')
    jsonschema.validate(json.loads(calls), schema)
    assert accepts(spec, calls)
    assert not accepts(spec, '[{"name": "plan_trip", "parameters": {"start": {"town": "Paris"}')


@pytest.mark.parametrize("parameters_", [{}, {"properties": {"city": {"type": "string"}}}], ids=["empty", "no-type"])
def test_parameters_without_a_type_are_an_object(accepts, parameters_):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters_}}]
    named = tool_calling(request(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), None)
    assert named.structured_output == json_schema_spec({"type": "object", **parameters_})
    assert accepts(named.structured_output, '{"city": "Paris"}')
    assert not accepts(named.structured_output, '"Paris"')
    required = tool_calling(request(tools=tools, tool_choice="required"), None)
    assert json.loads(required.structured_output.spec)["items"]["anyOf"][0]["properties"]["parameters"] == {
        "type": "object", **parameters_}


def test_two_structured_fields_beside_a_tool_choice_name_the_second():
    with pytest.raises(InvalidField) as error:
        tool_calling(request(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"},
                             guided_regex="a+"), None)
    assert (error.value.param, str(error.value)) == (
        "guided_regex", "guided_regex cannot be combined with tool_choice \"required\": the output is the call's JSON")
