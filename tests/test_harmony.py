"""gpt-oss's harmony format (gateway/harmony.py): --reasoning-parser openai_gptoss and
--tool-call-parser openai on exact outputs cut at every character (the streamed deltas add up to
the whole message), then through one served scripted model (tests/scripted.py) with the openai
SDK: chat completions whole and streamed, the Responses API's items."""
from __future__ import annotations

import pytest

import scripted
from tests import families
from gateway.reasoning import PARSERS, ReasoningStream
from gateway.tool_parsers import Call, HarmonyToolParser, detect_tool_call_format
from gateway.tools import ToolCallStream

# The user's last word picks the script. Pieces are unique over all scripts (a token has one
# successor): the tags are special tokens where a script holds each once, else inside plain pieces.
SCRIPTS = {
    "ponder": ["<|channel|>", "analysis", "<|message|>", "Two and two", " make four.", "<|end|>", "<|start|>",
               "assistant<|channel|>final<|message|>", "It is 4."],
    "weather": ["<|channel|>analysis<|message|>Need", " the weather.<|end|><|start|>assistant",
                "<|channel|>commentary to=functions.get_weather", " <|constrain|>json<|message|>", '{"city": ',
                '"Paris"}'],
    # the recipient before the channel; an undeclared function's call is no call
    "flight": ["<|start|>assistant to=functions.book_flight<|channel|>commentary json<|message|>",
               '{"to": "Rome"}'],
    "direct": ["<|channel|>final<|message|>Hi", " there."],
    "plain": ["Just", " an answer."],
    # thinking that never ends (cut by max_tokens, or it stops)
    "muse": ["<|channel|>analysis<|message|>Musing", " on", " and on."],
    # two analysis messages (one a line), then the answer
    "twice": ["<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.",
              "<|end|><|start|>assistant<|channel|>final<|message|>Done."],
    # a call made from the analysis channel: the answer, for the tool parser
    "hasty": ["<|channel|>analysis to=functions.get_weather<|message|>", '{"city": "Oslo"}'],
}
SPECIAL = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
EXPECTED = {  # (reasoning, the answer's text) as the reasoning parser splits the output
    "ponder": ("Two and two make four.", "It is 4."),
    "weather": ("Need the weather.", '<|start|>assistant<|channel|>commentary to=functions.get_weather '
                                     '<|constrain|>json<|message|>{"city": "Paris"}'),
    "flight": (None, scripted.text(SCRIPTS, "flight")),
    "direct": (None, "Hi there."),
    "plain": (None, "Just an answer."),
    "muse": ("Musing on and on.", ""),
    "twice": ("First.\nSecond.", "Done."),
    "hasty": (None, scripted.text(SCRIPTS, "hasty")),
}
TEXTS = {cue: scripted.text(SCRIPTS, cue) for cue in SCRIPTS}
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}


def cuts(text: str):
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("cue", SCRIPTS)
def test_the_deltas_add_up_to_the_message_however_the_output_is_cut(cue):
    parser, text = PARSERS["openai_gptoss"], TEXTS[cue]
    assert ReasoningStream(parser, True).split(text) == EXPECTED[cue]
    for pieces in cuts(text):
        stream = ReasoningStream(parser, True)
        reasoning = answer = ""
        for i, piece in enumerate(pieces):
            r, a = stream.feed(piece, i == len(pieces) - 1)
            reasoning, answer = reasoning + r, answer + a
        assert (reasoning or None, answer) == EXPECTED[cue]
        assert "<|" not in reasoning


def test_nothing_is_sent_while_the_text_could_still_become_a_tag():
    s = ReasoningStream(PARSERS["openai_gptoss"], True)
    assert s.feed("<|chan", False) == ("", "")  # could be a header: neither reasoning nor answer yet
    assert s.feed("nel|>analysis<|mess", False) == ("", "")
    assert s.feed("age|>Hmm<|e", False) == ("Hmm", "")  # "<|e" could be <|end|>
    assert s.feed("nd|><|start|>assistant<|channel|>final<|message|>Yes", False) == ("", "Yes")
    assert s.feed(".", True) == ("", ".")
    s = ReasoningStream(PARSERS["openai_gptoss"], True)
    assert s.feed("<x", False) == ("", "<x")  # no header can start so: plain text, all answer


def test_the_thinking_budget_forces_the_close_of_the_analysis_and_the_final_header():
    assert PARSERS["openai_gptoss"].end == "<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("cue, content, calls", [
    ("weather", None, [Call("get_weather", '{"city": "Paris"}')]),
    ("hasty", None, [Call("get_weather", '{"city": "Oslo"}')]),
    ("flight", scripted.text(SCRIPTS, "flight"), []),  # book_flight is not declared: no call, all content
    ("ponder", None, []),
])
def test_the_tool_parser_reads_the_answer(cue, content, calls):
    _, answer = ReasoningStream(PARSERS["openai_gptoss"], True).split(TEXTS[cue])
    parser = HarmonyToolParser(TOOLS)
    scan = parser.scan(answer, True)
    assert scan.calls == calls
    if cue != "ponder":
        message = ToolCallStream(parser).message(answer)
        assert message["content"] == content
    # streamed, a call comes whole when its body ends: at the end of the output
    assert parser.scan(answer[:-3], False).calls == []


def test_auto_detects_harmony_from_the_template_and_brings_its_reasoning_parser():
    """The tool parser reads the answer the reasoning parser leaves: without it, the analysis
    messages and the tags would be content."""
    from transformers import AutoTokenizer

    from gateway.reasoning import HarmonyParser
    from gateway.tokenizer import PromptEncoder

    template = "<|start|>assistant<|channel|>commentary to=functions.{{ name }}"
    assert detect_tool_call_format(template) == "openai"
    tokenizer = AutoTokenizer.from_pretrained(families.TOKENIZER)
    assert isinstance(PromptEncoder(tokenizer, template).reasoning_parser, HarmonyParser)
    assert isinstance(PromptEncoder(tokenizer, None, "openai").reasoning_parser, HarmonyParser)
    assert PromptEncoder(tokenizer, None, "openai", reasoning_parser="qwen3").reasoning_parser is PARSERS["qwen3"]
    assert PromptEncoder(tokenizer, None, "hermes").reasoning_parser is None


# ----------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    from tests.stack import Stack

    directory = scripted.build(tmp_path_factory.mktemp("harmony"), SCRIPTS, special=SPECIAL)
    stack = Stack("--model", str(directory), "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                  "--max-model-len", "128", "--num-gpu-blocks", "64", "--num-cpu-blocks", "8").wait_ready()
    yield OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert stack.stop() == 0


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}


def ask(client, cue: str, **kwargs):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": f"What about {cue}"}],
                                          temperature=0, **kwargs)


def streamed(client, cue: str, **kwargs) -> tuple[str, str, str, list]:
    reasoning, content, finish, calls = "", "", None, []
    for chunk in ask(client, cue, stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            calls += choice.delta.tool_calls or []
    return reasoning, content, finish, calls


@pytest.mark.parametrize("cue, reasoning, content", [
    ("ponder", "Two and two make four.", "It is 4."), ("direct", None, "Hi there."), ("plain", None, "Just an answer."),
])
def test_served_chat_whole_and_streamed(client, cue, reasoning, content):
    choice = ask(client, cue).choices[0]
    assert (choice.message.model_extra["reasoning_content"], choice.message.content) == (reasoning, content)
    assert choice.finish_reason == "stop"
    assert streamed(client, cue)[:3] == (reasoning or "", content, "stop")


def test_served_thinking_then_a_tool_call(client):
    response = ask(client, "weather", tools=[WEATHER_TOOL])
    choice = response.choices[0]
    assert (choice.message.model_extra["reasoning_content"], choice.message.content) == ("Need the weather.", None)
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert response.usage.completion_tokens_details.reasoning_tokens == 2  # up to the piece that ends the analysis
    reasoning, content, finish, calls = streamed(client, "weather", tools=[WEATHER_TOOL])
    assert (reasoning, content, finish) == ("Need the weather.", "", "tool_calls")
    assert calls[0].function.name == "get_weather" and "".join(c.function.arguments or "" for c in calls) == (
        '{"city": "Paris"}')


def test_served_responses_api_gives_a_reasoning_item_and_a_function_call(client):
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="What about weather", tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS["get_weather"]}])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == "Need the weather."
    assert (response.output[1].name, response.output[1].arguments) == ("get_weather", '{"city": "Paris"}')
    answer = client.responses.create(model=model, input="What about ponder")
    assert [item.type for item in answer.output] == ["reasoning", "message"] and answer.output_text == "It is 4."
