"""`pagoda up --data-parallel-size 2` on CPU: two engine groups (a scheduler and a worker each) read
the one request stream; /metrics shows each group's share; a group whose scheduler is killed loses
only the requests it had started streaming, and the other group serves on meanwhile."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest
import redis

from common import streams
from pagoda.bench.soak import wait_drained
from pagoda.bench.stack import parse_samples, process_tree
from tests.stack import Stack, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "The weather today is"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(redis_server):
    # --max-num-seqs 2: a scheduler holds at most 2 running and 2 waiting requests, so 8 at once
    # must be shared; --claim-idle-ms 3000: a dead scheduler's requests are taken over after 3 s
    stack = Stack("--redis-url", redis_server.url, "--data-parallel-size", "2", "--max-num-seqs", "2",
                  "--claim-idle-ms", "3000", "--worker-timeout", "10").wait_ready().wait_engines(2)
    yield stack
    assert stack.stop() == 0


def stream(url: str, prompt: str) -> dict:
    """One streamed completion to its end: its tokens, the error object if any, its prompt tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens, error, prompt_tokens = [], None, None
    with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            elif chunk["choices"]:
                tokens += chunk["choices"][0]["logprobs"]["tokens"]
    return {"prompt": prompt, "tokens": tokens, "error": error, "prompt_tokens": prompt_tokens}


def engine_samples(stack: Stack, name: str) -> dict[str, float]:
    with httpx.Client(timeout=10) as http:
        text = http.get(stack.url + "/metrics").text
    return {labels["engine"]: value for metric, labels, value in parse_samples(text) if metric == name}


def scheduler_pid(stack: Stack, engine: str) -> int:
    """The scheduler of one engine group: `pagoda up` passes it --engine-id=<engine>."""
    for pid in process_tree(stack.process.pid).values():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().decode().split("\0")
        if "scheduler" in words and f"--engine-id={engine}" in words:
            return pid
    raise AssertionError(f"no scheduler of engine {engine}")


def test_both_engine_groups_take_requests_from_the_one_stream(stack):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream(stack.url, p), PROMPTS * 2))
    assert [(r["error"], len(r["tokens"])) for r in results] == [(None, MAX_TOKENS)] * 8
    assert results[:4] == results[4:]  # the same greedy text from whichever group ran it
    queried = engine_samples(stack, "pagoda:prefix_cache_queries_total")  # prompt tokens each group scheduled
    assert sorted(queried) == ["0", "1"] and min(queried.values()) > 0
    assert sum(queried.values()) == sum(r["prompt_tokens"] for r in results)  # each request ran once
    wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 0, "1": 0}, 5, "both groups idle")


def test_a_killed_groups_started_requests_fail_and_the_rest_are_served(stack, redis_server):
    """Engine 1's scheduler is killed while it runs 2 requests and holds 1-2 more unstarted: those it
    had started streaming end with an error event (their text so far the greedy text), the others
    complete, taken over; /health stays 200 throughout (engine 0 serves) and nothing leaks."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        references = {p: r["tokens"] for p, r in zip(PROMPTS, pool.map(lambda p: stream(stack.url, p), PROMPTS))}
        wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 0, "1": 0}, 5, "both idle")
        killed = scheduler_pid(stack, "1")
        futures = [pool.submit(stream, stack.url, p) for p in PROMPTS * 2]
        wait_for(lambda: engine_samples(stack, "pagoda:num_requests_waiting").get("1", 0) >= 1, 60,
                 "engine 1 to hold a request it has not started")
        os.kill(killed, signal.SIGKILL)
        health = []
        while not all(f.done() for f in futures):
            health.append(stack.health())
            time.sleep(0.2)
        results = [f.result() for f in futures]
    interrupted = [r for r in results if r["error"] is not None]
    assert len(interrupted) <= 2  # at most engine 1's running ones
    for r in interrupted:
        assert r["error"]["message"] == (
            "generation failed: the scheduler serving this request stopped after it had started streaming")
        assert r["tokens"] == references[r["prompt"]][:len(r["tokens"])]
    for r in results:
        if r["error"] is None:
            assert r["tokens"] == references[r["prompt"]]
    assert len(results) - len(interrupted) >= 6  # engine 0's 4 and at least one of engine 1's unstarted
    assert set(health) == {200}
    assert scheduler_pid(stack, "1") != killed  # `pagoda up` restarted it
    stack.wait_engines(2, timeout=60)
    drained, state, _ = wait_drained(stack.url, redis_server.url, timeout=15)
    assert drained, state
    assert redis.Redis.from_url(redis_server.url).hlen(streams.STARTED) == 0
