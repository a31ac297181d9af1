"""Reasoning output (gateway/reasoning.py, --reasoning-parser): the parsers on exact outputs cut at
every character (the streamed deltas add up to the whole message), thinking switched off by the
prompt or the template's kwargs, special and plain tags through the real detokenizer, and the
chat API through one served scripted model (tests/scripted.py) with the openai SDK."""
from __future__ import annotations

import json

import pytest

import scripted
from common.config import ConfigError, GatewayConfig
from common.protocol import RequestEvent
from gateway.detokenizer import IncrementalDetokenizer
from gateway.openai_api import APIError, parse_chat
from gateway.reasoning import PARSERS, ReasoningStream, ThinkParser, reasoning_parser
from gateway.serving import ChoiceState, ResponseShape, usage
from gateway.tokenizer import PromptEncoder
from gateway.tools import ToolCallStream

# One scripted model for every test here: the user's last word picks the script.
SCRIPTS = {
    # plain (not special) tags, the closing one cut in two tokens
    "hello": ["<think>\n", "Greet them.", "</th", "ink>", "\n\nHello", " there!"],
    # DeepSeek R1's way: the template opened the block; the special </think> continues with the answer
    # (so a prompt that ends with `<think></think>`, thinking off, is answered "\n\nDone.")
    "quietly": ["Quiet thought.", "</think>", "\n\nDone."],
    # a special <think>, then a plain piece holding the closing tag, then a Hermes call
    "weather": ["<think>", "I should call", " a tool.", "</think>\n", "<tool_call>",
                '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"],
    # thinking that never ends
    "muse": ["Musing", " on", " and on."],
}
SPECIAL = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# what each script's output is, as (reasoning, content), under deepseek_r1 and qwen3 alike
EXPECTED = {
    "hello": ("\nGreet them.", "\n\nHello there!"),
    "quietly": ("Quiet thought.", "\n\nDone."),
    "weather": ("I should call a tool.", '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         "</tool_call>"),
    "muse": ("Musing on and on.", None),
}
# the tokens up to the one that completes the closing tag; all of them (EOS too) when it never comes
REASONING_TOKENS = {"hello": 4, "quietly": 2, "weather": 4, "muse": 4}
TEXTS = {cue: scripted.text(SCRIPTS, cue) for cue in SCRIPTS}


def stream(parser, thinking: bool, pieces: list[str]) -> tuple[str, str]:
    """The reasoning and answer deltas of `pieces`, each concatenated."""
    s = ReasoningStream(parser, thinking)
    reasoning = answer = ""
    for i, piece in enumerate(pieces):
        r, a = s.feed(piece, i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


def cuts(text: str):
    """`text` one character at a time, and in two pieces at every boundary."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


THINK_PARSERS = [name for name, parser in PARSERS.items() if isinstance(parser, ThinkParser)]  # harmony's: test_harmony


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("cue", SCRIPTS)
def test_the_deltas_add_up_to_the_message_however_the_output_is_cut(name, cue):
    parser, text = PARSERS[name], TEXTS[cue]
    reasoning, answer = ReasoningStream(parser, True).split(text)
    assert (reasoning, answer or None) == EXPECTED[cue]
    for pieces in cuts(text):
        streamed = stream(parser, True, pieces)
        assert streamed == (reasoning or "", answer)
        assert "<think>" not in streamed[1] and "</think>" not in streamed[1]


@pytest.mark.parametrize("text, expected", [
    ("<think>\nGreet them.</th", ("\nGreet them.</th", "")),  # cut inside the closing tag: all reasoning
    ("<thi", ("<thi", "")),
    ("<think></think>Hi", (None, "Hi")),
    ("Before<think>inside</think>after", ("Beforeinside", "after")),  # the first opening tag is dropped
    ("a</think>b</think>c", ("a", "b</think>c")),  # the first closing tag ends the thinking
])
def test_unclosed_and_unusual_outputs(text, expected):
    parser = ThinkParser()
    assert ReasoningStream(parser, True).split(text) == expected
    for pieces in cuts(text):
        assert stream(parser, True, pieces) == (expected[0] or "", expected[1])


def test_nothing_is_sent_while_the_text_could_still_become_a_tag():
    s = ReasoningStream(ThinkParser(), True)
    assert s.feed("<", False) == ("", "")
    assert s.feed("/th", False) == ("", "")
    assert s.feed("x", False) == ("</thx", "")
    assert s.feed("</think>", False) == ("", "")
    assert s.feed("A", True) == ("", "A")


def test_thinking_off_the_whole_output_is_the_answer():
    for pieces in cuts("<think>x</think>y"):
        assert stream(ThinkParser(), False, pieces) == ("", "<think>x</think>y")
    assert ReasoningStream(ThinkParser(), False).split("Done.") == (None, "Done.")


@pytest.mark.parametrize("name, prompt_tail, kwargs, thinking", [
    ("deepseek_r1", "user hi\nassistant\n", {}, True),
    ("deepseek_r1", "<｜Assistant｜><think>\n", {}, True),
    ("deepseek_r1", "assistant\n<think>\n\n</think>\n\n", {}, False),  # the template closed it: thinking off
    ("deepseek_r1", "user hi\n", {"enable_thinking": False}, True),  # R1 has no switch
    ("qwen3", "user hi\n", {"enable_thinking": False}, False),
    ("qwen3", "user hi\n", {"enable_thinking": True}, True),
    ("qwen3", "<think></think>", {"enable_thinking": True}, False),
])
def test_the_prompt_and_the_template_kwargs_say_whether_the_output_starts_thinking(name, prompt_tail, kwargs,
                                                                                  thinking):
    assert PARSERS[name].thinking(prompt_tail, kwargs) is thinking


def test_reasoning_tokens_count_up_to_the_token_that_completes_the_end_tag():
    s = ReasoningStream(ThinkParser(), True)
    text = ""
    for piece in SCRIPTS["hello"]:
        text += piece
        s.observe(text)
    assert s.num_tokens(text) == 4  # "<think>\n", "Greet them.", "</th", "ink>"
    assert s.num_tokens(text[:20]) == 6  # cut inside the tag (a stop string): all of them
    off = ReasoningStream(ThinkParser(), False)
    off.observe("Done.")
    assert off.num_tokens("Done.") == 0


QWEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", "Let me call." + QWEN_CALL, ("Let me call.", QWEN_CALL)),
    ("qwen3", "<think>\nCall." + QWEN_CALL, ("\nCall.", QWEN_CALL)),
    ("deepseek_r1", "Let me call." + QWEN_CALL, ("Let me call." + QWEN_CALL, "")),
    ("qwen3", "I mention <tool_call> here.</think>Answer", ("I mention <tool_call> here.", "Answer")),
    ("qwen3", "I write <tool_call>", ("I write <tool_call>", "")),  # no <function= after it: still thinking
    ("qwen3", "Call " + QWEN_CALL + "</think>Later", ("Call ", QWEN_CALL + "</think>Later")),
])
def test_qwen3_ends_the_thinking_at_a_tool_call_that_opens_a_function(name, text, expected):
    """vLLM's qwen3 parser: Qwen3.5 may call a tool (qwen3_coder's format) without closing the thinking."""
    parser = PARSERS[name]
    assert ReasoningStream(parser, True).split(text) == expected
    for pieces in cuts(text):
        assert stream(parser, True, pieces) == expected


def test_unknown_parser_and_bad_default_kwargs_are_config_errors():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3, openai_gptoss, got 'x'"):
        reasoning_parser("x")
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        GatewayConfig(reasoning_parser="x")
    with pytest.raises(ConfigError, match="default_chat_template_kwargs must be a JSON object"):
        GatewayConfig(default_chat_template_kwargs="[1]")
    with pytest.raises(ConfigError, match="default_chat_template_kwargs must be a JSON object"):
        GatewayConfig(default_chat_template_kwargs="{")
    assert GatewayConfig(default_chat_template_kwargs='{"a": 1}').chat_template_kwargs == {"a": 1}


# ----------------------------------------------------------------------------- through the real tokenizer

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted.build(tmp_path_factory.mktemp("reasoning"), SCRIPTS, special=SPECIAL)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def parsed_chat(tokenizer, cue: str, parser: str = "deepseek_r1", **fields):
    encoder = PromptEncoder(tokenizer, reasoning_parser=parser, tool_call_parser="hermes")
    body = {"messages": [{"role": "user", "content": f"What about {cue}"}], **fields}
    return parse_chat(body, encoder, len(tokenizer))


def run_choice(tokenizer, parsed, cue: str, max_tokens: int | None = None):
    """The script's tokens (then EOS) into one choice, one event per token; (streamed chunks, body)."""
    ids = tokenizer.convert_tokens_to_ids(SCRIPTS[cue]) + [tokenizer.eos_token_id]
    reason = "stop"
    if max_tokens is not None and max_tokens < len(ids):
        ids, reason = ids[:max_tokens], "length"
    choice = ChoiceState(0, "r", IncrementalDetokenizer(tokenizer, parsed.skip_special_tokens, parsed.skipped_token_ids),
                         [], frozenset([tokenizer.eos_token_id]), 0.0,
                         tools=ToolCallStream(parsed.tool_parser) if parsed.tool_parser else None,
                         reasoning=ReasoningStream(parsed.reasoning_parser, parsed.thinking))
    shape = ResponseShape.new("chat", "m", None, str, "abc")
    chunks = []
    for i, token_id in enumerate(ids):
        choice.add(RequestEvent("r", [token_id], None, reason if i == len(ids) - 1 else None))
        chunks += shape.choice_deltas(choice, *choice.take_delta())
    return chunks, shape.body([choice], usage([[1]], [choice]))


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in chunks)


@pytest.mark.parametrize("cue", ["hello", "quietly", "muse"])
def test_special_and_plain_tags_reach_the_parser_and_never_the_content(tokenizer, cue):
    parsed = parsed_chat(tokenizer, cue)
    assert parsed.skip_special_tokens and parsed.skipped_token_ids is not None  # <think> kept, </s> and others not
    chunks, body = run_choice(tokenizer, parsed, cue)
    message = body["choices"][0]["message"]
    reasoning, content = EXPECTED[cue]
    assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning, "reasoning": reasoning}
    assert (joined(chunks, "reasoning_content"), joined(chunks, "content")) == (reasoning, content or "")
    assert joined(chunks, "reasoning") == reasoning
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": REASONING_TOKENS[cue]}


def test_other_special_tokens_stay_out_of_the_text(tokenizer):
    chunks, body = run_choice(tokenizer, parsed_chat(tokenizer, "weather"), "weather")
    assert body["choices"][0]["message"]["content"] == '\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert body["choices"][0]["message"]["reasoning_content"] == "I should call a tool."


def test_the_thinking_comes_first_then_the_tool_parser_reads_the_answer(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parsed = parsed_chat(tokenizer, "weather", tools=tools)
    chunks, body = run_choice(tokenizer, parsed, "weather")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call a tool." and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert joined(chunks, "reasoning_content") == "I should call a tool." and joined(chunks, "content") == ""
    streamed = [c["delta"]["tool_calls"][0]["function"] for c in chunks if "tool_calls" in c["delta"]]
    assert streamed == [{"name": "get_weather", "arguments": ""}, {"arguments": '{"city": "Paris"}'}]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_prompt_that_closes_the_thinking_makes_the_output_content(tokenizer):
    for parser in THINK_PARSERS:
        parsed = parsed_chat(tokenizer, "hello", parser, chat_template_kwargs={"enable_thinking": False})
        assert not parsed.thinking
        chunks, body = run_choice(tokenizer, parsed, "quietly", max_tokens=None)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (None, "Quiet thought.\n\nDone.")


def test_chat_template_kwargs_must_be_an_object(tokenizer):
    with pytest.raises(APIError) as error:
        parsed_chat(tokenizer, "hello", chat_template_kwargs=["enable_thinking"])
    assert error.value.status == 400 and error.value.body()["error"] == {
        "message": 'chat_template_kwargs must be an object, got ["enable_thinking"]', "type": "invalid_request_error",
        "param": "chat_template_kwargs", "code": None}


def test_the_worker_gets_the_end_tag_to_gate_on_only_while_the_output_thinks(tokenizer):
    end = [tokenizer.convert_tokens_to_ids("</think>")]
    params = parsed_chat(tokenizer, "hello", thinking_token_budget=5).params
    assert (params.reasoning_end_token_ids, params.thinking_token_budget) == (end, 5)
    params = parsed_chat(tokenizer, "hello", guided_choice=["a"]).params  # a grammar waits for the thinking
    assert (params.reasoning_end_token_ids, params.thinking_token_budget) == (end, None)
    assert parsed_chat(tokenizer, "hello").params.reasoning_end_token_ids == []  # nothing to gate
    off = parsed_chat(tokenizer, "hello", thinking_token_budget=5, chat_template_kwargs={"enable_thinking": False},
                      parser="qwen3")
    assert (off.params.reasoning_end_token_ids, off.params.thinking_token_budget) == ([], None)
    with pytest.raises(APIError) as error:
        parsed_chat(tokenizer, "hello", parser=None, thinking_token_budget=5)
    assert error.value.body()["error"]["param"] == "thinking_token_budget"
    assert "needs a reasoning parser" in error.value.body()["error"]["message"]


def test_template_kwargs_reach_the_template_and_the_request_overrides_the_default(tokenizer):
    encoder = PromptEncoder(tokenizer, chat_template_kwargs={"enable_thinking": False})
    messages = [{"role": "user", "content": "hi"}]
    tail = tokenizer.convert_ids_to_tokens(encoder.encode_chat(messages))[-2:]
    assert tail == ["<think>", "</think>"]
    assert encoder.encode_chat(messages, template_kwargs={"enable_thinking": True, "unknown": 1}) == \
        PromptEncoder(tokenizer).encode_chat(messages)
    # apply_chat_template's own parameters are no template variables
    assert encoder.encode_chat(messages, template_kwargs={"tokenize": False, "enable_thinking": True}) == \
        PromptEncoder(tokenizer).encode_chat(messages)


def test_without_a_reasoning_parser_nothing_changes(tokenizer):
    parsed = parse_chat({"messages": [{"role": "user", "content": "What about hello"}]}, PromptEncoder(tokenizer),
                        len(tokenizer))
    assert (parsed.reasoning_parser, parsed.skipped_token_ids) == (None, None)
    assert json.dumps(usage([[1]], [])) == json.dumps(
        {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}})


# ----------------------------------------------------------------------------- the served model (openai SDK)

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def stack(model_dir):
    from tests.stack import Stack

    stack = Stack("--model", str(model_dir), "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes",
                  "--max-model-len", "256", "--num-gpu-blocks", "128", "--num-cpu-blocks", "16").wait_ready()
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def qwen3_client(stack, model_dir):
    """A second gateway on the stack's Redis, in process: --reasoning-parser qwen3 and thinking off
    by default (--default-chat-template-kwargs)."""
    from openai import OpenAI

    from common.redis_server import free_port
    from gateway.app import create_app
    from tests.stack import serve_app

    port = free_port()
    config = GatewayConfig(redis_url=stack.redis_url, model=str(model_dir), port=port, reasoning_parser="qwen3",
                           default_chat_template_kwargs='{"enable_thinking": false}')
    with serve_app(create_app(config), port):
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, cue: str, **kwargs):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": f"What about {cue}"}],
                                          temperature=0, **kwargs)


def fields(message) -> tuple:
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"]
    return extra["reasoning_content"], message.content


def streamed(client, cue: str, **kwargs) -> tuple[dict, object]:
    """Each choice's (reasoning, content, finish_reason, tool_calls deltas) from a stream, and its usage."""
    chunks = list(ask(client, cue, stream=True, stream_options={"include_usage": True}, **kwargs))
    out: dict = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            delta, got = choice.delta, out.setdefault(choice.index, ["", "", None, []])
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            got[0] += extra.get("reasoning_content") or ""
            got[1] += delta.content or ""
            got[2] = choice.finish_reason or got[2]
            got[3] += delta.tool_calls or []
    for reasoning, content, *_ in out.values():
        assert not any(tag in content for tag in ("<think>", "</think>", "</th", "ink>"))
    return out, chunks[-1].usage


@pytest.mark.parametrize("cue", ["hello", "quietly", "muse"])
def test_served_chat_whole_and_streamed(client, cue):
    response = ask(client, cue)
    choice = response.choices[0]
    assert fields(choice.message) == EXPECTED[cue] and choice.finish_reason == "stop"
    assert response.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS[cue]
    out, stream_usage = streamed(client, cue)
    assert out[0][:3] == [EXPECTED[cue][0], EXPECTED[cue][1] or "", "stop"]
    assert stream_usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS[cue]


def test_served_n2_each_choice_parses_its_own_thinking(client):
    response = ask(client, "hello", n=2)
    assert [fields(c.message) for c in response.choices] == [EXPECTED["hello"]] * 2
    assert response.usage.completion_tokens_details.reasoning_tokens == 2 * REASONING_TOKENS["hello"]
    out, _ = streamed(client, "hello", n=2)
    assert {i: got[:2] for i, got in out.items()} == {i: list(EXPECTED["hello"]) for i in (0, 1)}


def test_served_thinking_then_a_tool_call(client):
    choice = ask(client, "weather", tools=[WEATHER_TOOL]).choices[0]
    assert fields(choice.message) == ("I should call a tool.", None) and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    out, _ = streamed(client, "weather", tools=[WEATHER_TOOL])
    reasoning, content, finish_reason, calls = out[0]
    assert (reasoning, content, finish_reason) == ("I should call a tool.", "", "tool_calls")
    assert calls[0].function.name == "get_weather" and calls[1].function.arguments == '{"city": "Paris"}'


def test_served_max_tokens_inside_the_thinking_is_all_reasoning(client):
    response = ask(client, "hello", max_tokens=3)  # "<think>\n", "Greet them.", "</th"
    choice = response.choices[0]
    assert fields(choice.message) == ("\nGreet them.</th", None) and choice.finish_reason == "length"
    assert response.usage.completion_tokens_details.reasoning_tokens == 3
    out, _ = streamed(client, "hello", max_tokens=3)
    assert out[0][:3] == ["\nGreet them.</th", "", "length"]


def test_served_stop_strings_apply_to_the_whole_output(client):
    choice = ask(client, "hello", stop=["them"]).choices[0]
    assert fields(choice.message) == ("\nGreet ", None) and choice.finish_reason == "stop"
    choice = ask(client, "hello", stop=["there"]).choices[0]
    assert fields(choice.message) == ("\nGreet them.", "\n\nHello ")


def test_served_chat_template_kwargs_turn_thinking_off(client):
    response = ask(client, "hello", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert fields(response.choices[0].message) == (None, "\n\nDone.")
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_served_default_chat_template_kwargs_and_the_request_overriding_them(qwen3_client):
    assert fields(ask(qwen3_client, "hello").choices[0].message) == (None, "\n\nDone.")
    on = ask(qwen3_client, "hello", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert fields(on.choices[0].message) == EXPECTED["hello"]
    out, _ = streamed(qwen3_client, "hello", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert out[0][:2] == list(EXPECTED["hello"])


@pytest.mark.parametrize("cue, budget, expected, num_reasoning", [
    # "<think>\n" and "Greet them." then </think> forced: the special </think> goes on "\n\nDone."
    ("hello", 2, ("\nGreet them.", "\n\nDone."), 3),
    ("muse", 0, (None, "\n\nDone."), 1),  # the thinking ends at once
    ("quietly", 8, EXPECTED["quietly"], 2),  # a budget the thinking stays within changes nothing
])
def test_served_thinking_token_budget_forces_the_end_of_the_thinking(client, cue, budget, expected, num_reasoning):
    response = ask(client, cue, extra_body={"thinking_token_budget": budget})
    assert fields(response.choices[0].message) == expected
    assert response.usage.completion_tokens_details.reasoning_tokens == num_reasoning
    out, _ = streamed(client, cue, extra_body={"thinking_token_budget": budget})
    assert out[0][:2] == [expected[0] or "", expected[1]]


def test_served_grammar_applies_after_the_thinking(client):
    """The thinking is free (no answer the grammar allows starts with "Quiet thought."), then the
    answer is the grammar's, not the script's "\n\nDone."."""
    response = ask(client, "quietly", extra_body={"guided_choice": ["Musing on"]})
    assert fields(response.choices[0].message) == ("Quiet thought.", "Musing on")
    assert ask(client, "quietly", extra_body={"guided_choice": ["Musing on"], "chat_template_kwargs": {
        "enable_thinking": False}}).choices[0].message.content == "Musing on"


def test_served_thinking_token_budget_out_of_range_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as error:
        ask(client, "hello", extra_body={"thinking_token_budget": -1})
    assert error.value.body["param"] == "thinking_token_budget"


def test_served_chat_template_kwargs_not_an_object_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as error:
        ask(client, "hello", extra_body={"chat_template_kwargs": "enable_thinking"})
    assert error.value.body["param"] == "chat_template_kwargs"


def test_the_openapi_document_describes_the_reasoning_fields():
    from gateway.openapi import openapi_document

    schemas = openapi_document("m", 100, 1 << 20)["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]["description"]
    found = json.dumps(schemas)
    assert found.count('"reasoning_content"') == 2 and '"completion_tokens_details"' in found
