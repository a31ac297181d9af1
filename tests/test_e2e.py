"""The real stack, as separate processes, driven with the official openai client."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time

import httpx
import openai
import pytest

from common.protocol import SamplingParams
from tests import scripted
from tests.stack import Stack

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
COUNTING = {"One": [" two,", " three,", " four."]}


@pytest.fixture(scope="module")
def stack(default_stack):
    """The `pagoda up` of the default model (--num-gpu-blocks 2048 --num-cpu-blocks 256) that
    the modules of tests/conftest.py's DEFAULT_STACK_MODULES share."""
    return default_stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(default_llm):
    """The offline engine in this process, as `pagoda generate` runs it: tests/conftest.py's session
    engine (the default model on CPU; float32, what dtype auto is on CPU unquantized), reset."""
    default_llm.reset()
    return default_llm


def offline_outputs(llm, prompts: list[dict], max_tokens: int, **given) -> list[dict]:
    """The offline engine on the same prompts, sampling as `pagoda generate` with these flags does
    (greedy unless told; the model's generation_config.json for what is not given, except for beam
    search): the reference the stack must equal."""
    from pagoda.cli import GENERATE_SAMPLING

    sampling = {name: value for name, value in given.items() if name in GENERATE_SAMPLING}
    params = SamplingParams(max_tokens=max_tokens, **(GENERATE_SAMPLING | given))
    if not params.beam_width:
        params = dataclasses.replace(params, **{k: v for k, v in llm.default_sampling_params.items() if k not in sampling})
    return [out.to_json() for out in llm.generate(prompts, params, use_tqdm=False)]


def offline_texts(llm, prompts: list[dict], max_tokens: int) -> list[str]:
    return [out["text"] for out in offline_outputs(llm, prompts, max_tokens)]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_gives_the_served_model_and_404_for_another(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "pagoda")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body == {"message": "the model 'gpt-4' does not exist; this server serves "
                                            f"'{MODEL}'", "type": "invalid_request_error", "param": "model",
                                 "code": "model_not_found"}


def test_chat_answers_paris(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32,
        temperature=0,
    )
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert response.usage.completion_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion_max_tokens_and_usage(client):
    response = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens == 4


def test_streaming_equals_non_streaming_and_reports_usage(client):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_2_returns_two_choices(client):
    response = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=7,
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in response.choices)
    assert 2 <= response.usage.completion_tokens <= 16
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]  # seeded: reproducible


def test_seeded_samples_equal_the_offline_engines(client, offline):
    """One seed rule online and offline: n samples are one group, sample i seeded sample_seed(seed, i)."""
    prompt = "Once upon a time"
    (expected,) = offline_outputs(offline, [{"prompt": prompt}], 12, temperature=1.0, seed=7, n=3)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [
        (i, sample["text"], sample["finish_reason"]) for i, sample in enumerate(expected["outputs"])]
    assert len({c.text for c in response.choices}) == 3
    assert response.usage.completion_tokens == sum(len(sample["token_ids"]) for sample in expected["outputs"])


def test_beam_search_returns_the_offline_engines_beams_best_first(client, offline):
    prompt = "The best way to learn a language is"
    (expected,) = offline_outputs(offline, [{"prompt": prompt}], 8, beam_width=2, n=2)
    assert len(expected["outputs"]) == 2
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2,
                                         extra_body={"use_beam_search": True, "best_of": 2})
    assert [c.index for c in response.choices] == [0, 1]
    assert [(c.text, c.finish_reason) for c in response.choices] == [
        (beam["text"], beam["finish_reason"]) for beam in expected["outputs"]]
    assert response.usage.completion_tokens == sum(len(beam["token_ids"]) for beam in expected["outputs"])
    assert response.choices[0].text != response.choices[1].text


def test_stop_string_truncates(client):
    reference = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32,
        temperature=0,
    ).choices[0].message.content
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32,
        temperature=0, stop=["Paris"],
    )
    assert response.choices[0].message.content == reference[: reference.index("Paris")]
    assert response.choices[0].finish_reason == "stop"


def test_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                         temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert all(max(top.values()) == pytest.approx(l) for top, l in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)


def test_32_concurrent_streams_match_the_offline_engine(client, offline):
    prompts = [{"prompt": f"Here is fact number {i} about the ocean:"} for i in range(32)]
    expected = offline_texts(offline, prompts, 16)

    def stream(i: int) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompts[i]["prompt"], max_tokens=16, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(stream, range(32)))
    assert texts == expected


def test_errors_keep_the_server_serving(stack, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404
    assert (err.value.body["type"], err.value.body["param"], err.value.body["code"]) == (
        "invalid_request_error", "model", "model_not_found")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi " * 9000, max_tokens=2)
    assert "context" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).choices[0].text


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_frees_blocks(stack):
    # 4,000 tokens would take minutes on CPU: only the abort can free the blocks within seconds.
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", stack.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert wait_for(lambda: stack.metrics()["pagoda:kv_cache_usage_perc"] > 0, 5)
    metrics = stack.wait_drained(5)
    assert metrics["pagoda:kv_cache_usage_perc"] == 0
    assert metrics["pagoda:num_requests_running"] == 0


def test_bench_serve_measures_the_real_stack(stack):
    import asyncio

    from pagoda.bench.serve import run_rate, summarize

    requests = [([504, 1218, 281, 253, 1345], 6), ([1780, 3346, 314], 4), ([2078] * 20, 5)]
    results, duration = asyncio.run(run_rate(stack.url, None, requests, rate=10.0, seed=1))
    assert [r.failure for r in results] == [None, None, None]
    assert [r.output_len for r in results] == [6, 4, 5]  # ignore_eos: exactly max_tokens each
    for r in results:
        assert 0 < r.ttft <= r.e2e and 0 < len(r.itl) <= r.output_len - 1
    metrics = summarize(results, duration, {"e2e": 600.0})
    assert (metrics["completed"], metrics["failed"]) == (3, 0)
    assert metrics["output_token_throughput"] == pytest.approx(15 / duration)
    assert metrics["goodput"] == pytest.approx(3 / duration)


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 the first time; the second time every full
    block but the one holding the last prompt token (block size 16), streamed usage included."""
    prompt = "Zebras, quokkas and axolotls met at dawn. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0)
    answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens == (answer.usage.prompt_tokens - 1) // 16 * 16


def test_the_drained_metrics_count_each_prompt_answered_before_them_once(client, stack):
    """pagoda:prefix_cache_queries_total gains each prompt's tokens once, read by wait_drained right
    after the answer (a status published before the request would show it drained, uncounted)."""
    queries = "pagoda:prefix_cache_queries_total"
    for i in range(3):
        before = stack.wait_drained(30)[queries]
        client.completions.create(model=MODEL, prompt=[300 + i + j for j in range(20)], max_tokens=1)
        assert stack.wait_drained(30)[queries] == before + 20


def test_kill_9_of_pagoda_up_takes_every_child_down_and_a_new_stack_starts_on_its_port(tmp_path):
    """On a stack of its own (the module's is shared, tests/conftest.py), of a scripted model (what
    is tested is the processes, and it starts in seconds). Each child lives in a session of its own,
    so only the parent-death signal can take it down with a supervisor that had no chance to stop it."""
    flags = ("--model", str(scripted.build(tmp_path, COUNTING)), "--max-model-len", "64", "--num-gpu-blocks", "16")
    stack = Stack(*flags).wait_ready()
    try:
        children = stack.children()
        assert {"redis-server", "gateway", "scheduler", "worker"} <= {name.rstrip("'") for name in children}
        os.kill(stack.process.pid, signal.SIGKILL)
        assert stack.process.wait(10) == -signal.SIGKILL
        assert wait_for(lambda: not [pid for pid in children.values() if _alive(pid)], 5), "a child outlived pagoda up"
        assert stack.health() == 0
        again = Stack(*flags, port=stack.port).wait_ready()
        try:
            with httpx.Client(timeout=60) as http:
                body = {"model": tmp_path.name, "prompt": "One", "max_tokens": 3, "temperature": 0}
                answer = http.post(again.url + "/v1/completions", json=body).json()
                assert (answer["choices"][0]["text"], answer["usage"]["completion_tokens"]) == (" two, three, four.", 3)
        finally:
            assert again.stop() == 0
    finally:
        assert stack.stop() == (-signal.SIGKILL if stack.process.returncode == -signal.SIGKILL else 0)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
