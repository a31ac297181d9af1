"""[openai-api] through the real stack: one `pagoda up` (the default model on CPU) for scoring (echo,
prompt logprobs), logit_bias, structured output and tool calls over HTTP, and the real clients
(lm-evaluation-harness, the openai SDK)."""
from __future__ import annotations

import json
import re

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(default_stack):
    """The `pagoda up` of the default model (--num-gpu-blocks 2048 --num-cpu-blocks 256) that
    the modules of tests/conftest.py's DEFAULT_STACK_MODULES share."""
    return default_stack


# ----------------------------------------------------------------------------- scoring: echo, prompt_logprobs, max_tokens 0
# (helper "scoring")
from common.tokenizer import load_tokenizer  # noqa: E402 (each section imports what it uses: the sections merge apart)

SCORING_PROMPT = "The capital of France is Paris. The capital of Italy is"


def _post(stack, body: dict, path: str = "/v1/completions") -> dict:
    response = httpx.post(stack.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def scoring_prompt_ids():
    return load_tokenizer("default").encode(SCORING_PROMPT)


def test_echo_logprobs_max_tokens_0_scores_the_prompt(stack, scoring_prompt_ids):
    """lm-evaluation-harness's loglikelihood body, with max_tokens 0: the prompt's text, one entry per
    prompt token (the first null), nothing generated."""
    body = _post(stack, {"prompt": scoring_prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                         "temperature": 0})
    [choice] = body["choices"]
    assert choice["text"] == SCORING_PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    n = len(scoring_prompt_ids)
    assert [len(logprobs[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 and max(top.values()) >= lp
               for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:]))
    tokenizer = load_tokenizer("default")
    assert logprobs["text_offset"] == [len(tokenizer.decode(scoring_prompt_ids[:i])) for i in range(n)]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in scoring_prompt_ids]
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # prompt logprobs: never from the cache
    # lm-eval's own body (max_tokens 1): the prompt's entries, then the generated token's
    lm_eval = _post(stack, {"prompt": [scoring_prompt_ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                            "temperature": 0, "seed": 1234})
    [choice_1] = lm_eval["choices"]
    assert len(choice_1["logprobs"]["token_logprobs"]) == n + 1
    assert choice_1["logprobs"]["token_logprobs"][:n] == logprobs["token_logprobs"]
    assert choice_1["logprobs"]["top_logprobs"][:n] == logprobs["top_logprobs"]
    assert choice_1["text"].startswith(SCORING_PROMPT) and len(choice_1["text"]) > len(SCORING_PROMPT)
    # what lm-eval reads of it: the continuation's summed logprobs, greedy when each token ranked first
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ranks = _post(stack, {"prompt": scoring_prompt_ids, "prompt_logprobs": 0, "max_tokens": 0,
                          "echo": True})["choices"][0]["prompt_logprobs"]
    ranks = [None] + [entry[str(t)]["rank"] for t, entry in zip(scoring_prompt_ids[1:], ranks[1:])]
    for ctxlen in (1, n - 3, n - 1):
        [(total, greedy)] = LocalCompletionsAPI.parse_logprobs(lm_eval, ctxlens=[ctxlen])
        assert total == sum(logprobs["token_logprobs"][ctxlen:])
        assert greedy == all(rank == 1 for rank in ranks[ctxlen:])


def test_echo_with_generation_streams_the_prompt_first(stack, scoring_prompt_ids):
    """n = 2: each choice echoes the prompt (its logprobs from the one request's prompt logprobs),
    streamed in each choice's first chunk; the chunks add up to the whole body."""
    request = {"prompt": SCORING_PROMPT, "echo": True, "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 1}
    whole = _post(stack, request)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    n = len(scoring_prompt_ids)
    for choice in whole["choices"]:
        assert choice["text"].startswith(SCORING_PROMPT) and len(choice["text"]) > len(SCORING_PROMPT)
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == n + 4 and token_logprobs[0] is None and None not in token_logprobs[1:]
        assert choice["logprobs"]["text_offset"][n] == len(SCORING_PROMPT)  # the first generated token's
    firsts: dict[int, dict] = {}
    texts, logprobs = {0: "", 1: ""}, {0: [], 1: []}
    with httpx.stream("POST", stack.url + "/v1/completions", json={**request, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                [choice] = json.loads(line[6:])["choices"]
                firsts.setdefault(choice["index"], choice)
                texts[choice["index"]] += choice["text"]
                logprobs[choice["index"]] += choice["logprobs"]["token_logprobs"] if choice["logprobs"] else []
    assert set(firsts) == {0, 1}
    assert all(first["text"].startswith(SCORING_PROMPT) and len(first["logprobs"]["tokens"]) >= n
               for first in firsts.values())
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert logprobs == {c["index"]: c["logprobs"]["token_logprobs"] for c in whole["choices"]}


def test_prompt_logprobs_shape(stack, scoring_prompt_ids):
    """vLLM's prompt_logprobs in each choice: [null, {"<id>": {logprob, rank, decoded_token}}, ...]:
    the prompt token's own entry first, then the top 2; on chat too."""
    body = _post(stack, {"prompt": scoring_prompt_ids, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    [choice] = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(scoring_prompt_ids) and entries[0] is None
    for token_id, entry in zip(scoring_prompt_ids[1:], entries[1:]):
        keys = list(entry)
        assert keys[0] == str(token_id) and len(keys) in (2, 3)
        own = entry[str(token_id)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["rank"] >= 1 and own["logprob"] <= 0
        tops = [entry[key] for key in keys[1:]]
        assert [t["rank"] for t in tops] == sorted(t["rank"] for t in tops)
        if own["rank"] <= 2:  # then it is one of the top 2 itself
            assert len(keys) == 2
    assert "prompt_logprobs" not in _post(stack, {"prompt": "Hi", "max_tokens": 1})["choices"][0]
    chat = _post(stack, {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 1},
                 "/v1/chat/completions")
    [chat_choice] = chat["choices"]
    assert chat_choice["prompt_logprobs"][0] is None
    assert len(chat_choice["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat_choice["prompt_logprobs"][1:])


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
    from gateway.openai_api import parse_chat
    from gateway.tokenizer import PromptEncoder

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "15 degrees, sunny"}]
    body = post(http, CHAT, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    choice = body["choices"][0]
    assert choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")
    # the model read the conversation the gateway renders, the tool's result in it, token for token
    tokenizer = load_tokenizer("default")
    prompt, = parse_chat({"messages": messages, "tools": TOOLS, "tool_choice": "none"}, PromptEncoder(tokenizer),
                         len(tokenizer)).prompts
    assert tokenizer.decode(prompt).count("15 degrees, sunny") == 1
    assert body["usage"]["prompt_tokens"] == len(prompt)


# ----------------------------------------------------------------------------- real clients: lm-evaluation-harness, the openai SDK
# (helper "clients"; its imports here, so that the sections merge apart)
import os  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

LM_EVAL_TASKS = Path(__file__).resolve().parent / "data" / "lm_eval"  # pagoda_mc (multiple choice), pagoda_gen
LM_EVAL_TOLERANCE = 1e-4  # per-request loglikelihood, Pagoda's server against lm-eval's transformers backend


def _lm_evaluate(lm) -> dict:
    """lm-eval's simple_evaluate of `lm` on the two local tasks, offline, with every request's sample."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(LM_EVAL_TASKS), include_defaults=False)
    return simple_evaluate(model=lm, tasks=["pagoda_mc", "pagoda_gen"], task_manager=tasks, log_samples=True,
                           bootstrap_iters=0)


def _default_hf_directory() -> Path:
    from common.models import resolve_model
    from worker.loader import hf_directory

    return hf_directory(resolve_model("default"))


@pytest.fixture(scope="module")
def hf_lm_eval() -> dict:
    """lm-eval's own transformers backend (HFLM) on the default model's weights, float32 on CPU."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = _default_hf_directory()
    # the model object itself: HFLM's from_pretrained(..., quantization_config=None) trips over the
    # converted config's record of its GGUF source
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(directory / "tokenizer"), batch_size=1,
              device="cpu")
    return _lm_evaluate(lm)


def _served_model(stack) -> str:
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _responses(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_local_completions_scores_as_lm_evals_transformers_backend(stack, hf_lm_eval):
    """`lm_eval --model local-completions` against /v1/completions (echo + logprobs for the
    loglikelihoods, stop strings for generate-until) answers each request as lm-eval's transformers
    backend does on the same weights, so both score the tasks alike."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=stack.url + "/v1/completions", model=_served_model(stack),
                             tokenizer=str(_default_hf_directory() / "tokenizer"), tokenizer_backend="huggingface",
                             tokenized_requests=True, num_concurrent=4, max_retries=1, timeout=120)
    served = _lm_evaluate(lm)

    choices = _responses(served, "pagoda_mc")
    expected = _responses(hf_lm_eval, "pagoda_mc")
    assert [len(c) for c in choices] == [4] * 10
    for doc, (got, want) in enumerate(zip(choices, expected)):
        for (loglikelihood, greedy), (hf_loglikelihood, hf_greedy) in zip(got, want):
            assert abs(loglikelihood - hf_loglikelihood) <= LM_EVAL_TOLERANCE, (doc, got, want)
            assert greedy == hf_greedy, (doc, got, want)
    assert _responses(served, "pagoda_gen") == _responses(hf_lm_eval, "pagoda_gen")
    metrics = {"pagoda_mc": ("acc,none", "acc_norm,none"), "pagoda_gen": ("exact_match,strip",)}
    for task, names in metrics.items():
        assert {n: served["results"][task][n] for n in names} == {n: hf_lm_eval["results"][task][n] for n in names}
    assert 0 < hf_lm_eval["results"]["pagoda_mc"]["acc,none"] < 1  # the scores can tell the two apart


@pytest.fixture(scope="module")
def openai_client(stack):
    import openai

    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_sdk_parses_a_pydantic_response_format(stack, openai_client):
    """The openai SDK's structured parsing: response_format = a pydantic model (a strict json_schema)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=16)
        population: int = Field(ge=0, le=50_000_000)
        continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
        coastal: bool

    completion = openai_client.beta.chat.completions.parse(
        model=_served_model(stack), response_format=City, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City)
    assert type(city.name) is str and len(city.name) <= 16
    assert type(city.population) is int and type(city.coastal) is bool
    assert City.model_validate_json(choice.message.content) == city


def test_openai_sdk_tool_call_round_trip(stack, openai_client):
    """A named tool_choice gives message.tool_calls; the assistant message and the tool's result go
    back and the model answers in text."""
    model = _served_model(stack)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = openai_client.chat.completions.create(
        model=model, messages=messages, tools=tools, temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert list(arguments) == ["city"] and isinstance(arguments["city"], str)

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C"}]
    final = openai_client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                                  temperature=0, max_tokens=24)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert isinstance(answer.message.content, str) and answer.message.content
    assert answer.message.tool_calls in (None, [])
