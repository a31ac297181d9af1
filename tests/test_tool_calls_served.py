"""Every tool-call parser (gateway/tool_parsers.py) on real engine output, token by token: one
scripted model (tests/scripted.py) holds a script per format, served by one stack (--tool-call-parser
hermes) and one in-process gateway per other parser on the stack's Redis. With the openai SDK,
each script's whole message and its streamed deltas: the deltas add up to the message, and a
call's first delta carries its id and name."""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import pytest

import scripted
from common.config import GatewayConfig

# The user's last word picks the script. Pieces are unique over all scripts (a token has one
# successor), so repeated texts are cut differently; pieces cut tags in the middle.
SCRIPTS = {
    "coder": ["Let me check.", "\n<tool_call>\n<func", "tion=get_weather>\n<parameter=ci", "ty>\nParis\n</parameter>",
              "\n<parameter=days>\n3", "\n</param", "eter>\n</function>", "\n</tool_", "call>"],
    # an undeclared function's call, then a declared one without parameters
    "coder2": ["<tool_call>\n<function=book_flight>\n<parameter=to>\nRome\n</parameter>\n</function>\n</tool_call>",
               "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"],
    # Qwen3-Coder's call cut off inside its value: at the end everything open closes
    "cutoff": ["<tool_call>\n<function=get_weather>\n<parameter=city>\n", "Lyon\n"],
    "mistral": ["[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": ', '"Paris"}'],
    # two calls, the tags' texts inside plain pieces (a special token is one piece of one script)
    "mistral2": ["[TOOL_CALLS]get_time[ARGS]{}", "[TOOL_CALLS]get_weather", '[ARGS]{"city": "Lyon"}'],
    "pythonic": ['[get_weather(city=', '"Paris", days=3)', ', get_time(', ')]'],
    "llama": ["<|python_tag|>", '{"name": "get_weather", "parameters": ', '{"city": "Paris"}}', "; ",
              '{"name": "get_time", "parameters": {}}'],
    # a call to a function the request does not declare, then one to a declared one
    "hermes": ["Sure.", "<tool_call>", '\n{"name": "book_flight", "arguments": {"to": "Rome"}}\n', "</tool_call>",
               "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_call>"],
    "unclosed": ['<tool_call>\n{"name": "get_time", ', '"arguments": {}}'],  # Hermes without </tool_call>
}
SPECIAL = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<tool_call>", "</tool_call>")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
# a template that teaches Qwen3-Coder's format (its markers in a comment), for --tool-call-parser auto
CODER_TEMPLATE = scripted.TEMPLATE + "{# <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter> #}"


@dataclass(frozen=True)
class Expected:
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments)
    finish_reason: str = "tool_calls"


WEATHER, TIME = ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")
CASES = {  # (the gateway's parser, the script) -> the message
    ("qwen3_coder", "coder"): Expected("Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("auto", "coder"): Expected("Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("qwen3_coder", "cutoff"): Expected(None, [("get_weather", '{"city": "Lyon"}')]),
    ("qwen3_coder", "coder2"): Expected(None, [TIME]),
    ("mistral", "mistral"): Expected(None, [WEATHER]),
    ("mistral", "mistral2"): Expected(None, [TIME, ("get_weather", '{"city": "Lyon"}')]),
    ("pythonic", "pythonic"): Expected(None, [("get_weather", '{"city": "Paris", "days": 3}'), TIME]),
    ("llama3_json", "llama"): Expected(None, [WEATHER, TIME]),
    ("hermes", "hermes"): Expected("Sure.", [WEATHER]),
    ("hermes", "unclosed"): Expected(None, [TIME]),
    # another format's output is content; special tags are skipped when the parser names none special
    ("hermes", "pythonic"): Expected(scripted.text(SCRIPTS, "pythonic"), [], "stop"),
    ("pythonic", "mistral"): Expected('get_weather{"city": "Paris"}', [], "stop"),
    # the request keeps special tokens for hermes' special <tool_call> (vLLM's rule): all of them
    ("hermes", "mistral"): Expected(scripted.text(SCRIPTS, "mistral"), [], "stop"),
    ("pythonic", "coder"): Expected(scripted.text(SCRIPTS, "coder"), [], "stop"),
}


def test_every_piece_is_unique():
    pieces = [p for chain in SCRIPTS.values() for p in chain]
    assert len(pieces) == len(set(pieces))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted.build(tmp_path_factory.mktemp("tool_calls"), SCRIPTS, special=SPECIAL)


@pytest.fixture(scope="module")
def clients(model_dir, tmp_path_factory):
    """An openai client per --tool-call-parser: the stack's gateway (hermes) and, on its Redis, one
    in-process gateway for each other parser and for auto over a Qwen3-Coder template."""
    from openai import OpenAI

    from common.redis_server import free_port
    from gateway.app import create_app
    from tests.stack import Stack, serve_app

    template = tmp_path_factory.mktemp("template") / "coder.jinja"
    template.write_text(CODER_TEMPLATE)

    def client(url: str) -> OpenAI:
        return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    stack = Stack("--model", str(model_dir), "--tool-call-parser", "hermes", "--max-model-len", "128",
                  "--num-gpu-blocks", "64", "--num-cpu-blocks", "8").wait_ready()
    with ExitStack() as gateways:
        out = {"hermes": client(stack.url)}
        for parser in ("qwen3_coder", "mistral", "pythonic", "llama3_json", "auto"):
            port = free_port()
            config = GatewayConfig(redis_url=stack.redis_url, model=str(model_dir), port=port, tool_call_parser=parser,
                                   chat_template=str(template) if parser == "auto" else None)
            gateways.enter_context(serve_app(create_app(config), port))
            out[parser] = client(f"http://127.0.0.1:{port}")
        yield out
    assert stack.stop() == 0


def ask(client, cue: str, **kwargs):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": f"What about {cue}"}],
                                          tools=TOOLS, temperature=0, **kwargs)


@pytest.mark.parametrize("parser, cue", CASES)
def test_whole_message(clients, parser, cue):
    expected = CASES[parser, cue]
    choice = ask(clients[parser], cue).choices[0]
    assert choice.message.content == expected.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == expected.calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    assert choice.finish_reason == expected.finish_reason


@pytest.mark.parametrize("parser, cue", CASES)
def test_streamed_deltas_add_up_to_the_message(clients, parser, cue):
    expected = CASES[parser, cue]
    content, calls, finish_reason = "", {}, None
    for chunk in ask(clients[parser], cue, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # a call's first delta: its id and name
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments or ""
    assert content == (expected.content or "")
    assert sorted(calls) == list(range(len(calls)))
    assert [tuple(calls[i]) for i in sorted(calls)] == expected.calls
    assert finish_reason == expected.finish_reason


def test_parallel_tool_calls_false_keeps_the_first_call(clients):
    choice = ask(clients["pythonic"], "pythonic", parallel_tool_calls=False).choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')]
    calls = [c for chunk in ask(clients["pythonic"], "pythonic", parallel_tool_calls=False, stream=True)
             for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert {c.index for c in calls} == {0}
