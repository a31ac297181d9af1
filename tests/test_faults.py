"""Faults on the real stack (`pagoda up`: redis-server, scheduler, worker and gateway processes).

A worker killed (SIGKILL) or stopped (SIGSTOP) mid-stream, the scheduler killed, Redis restarted,
and SIGTERM: each test checks what clients see, that the supervisor brought the stack back, and
that no KV block, Redis entry or running request is left behind.
"""
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
from tests.stack import Stack, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Tell me a very long story about a dragon.", "max_tokens": 2000,
        "ignore_eos": True, "temperature": 0, "stream": True}
SHORT_PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
DRAIN_TIMEOUT_S = 5  # --drain-timeout: how long the SIGTERM test's cut stream runs on


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_worker():
    """The stack here runs with OMP_NUM_THREADS=1 (as tests/test_load.py's): on 2 cores the worker's
    two intra-op threads wait on each other whenever the gateway, the scheduler or this process holds a
    core. On a 2-core host shared with another test run, a step of two streams took 1.25 s with two
    threads and 0.18 s with one: with two, the Redis-restart test took 4-5 minutes (once past its 300 s
    timeout) and the SIGTERM test's 10-token stream once missed the drain."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if saved is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = saved


@pytest.fixture(scope="module")
def stack(redis_server):
    # --max-num-seqs 2: with two streams running, later requests queue (in the scheduler and in Redis)
    # --claim-idle-ms 3000: a killed scheduler's requests are taken over 3 s after its last claim (not 10)
    stack = Stack("--redis-url", redis_server.url, "--max-num-seqs", "2", "--worker-timeout", "5",
                  "--step-timeout", "30", "--drain-timeout", str(DRAIN_TIMEOUT_S),
                  "--claim-idle-ms", "3000").wait_ready()
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def r(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def references(stack):
    """Greedy outputs taken before any fault: what every later answer must equal."""
    with httpx.Client(timeout=120) as http:
        short = {p: complete(http, stack, p, 8) for p in SHORT_PROMPTS}
        long_start = complete(http, stack, LONG["prompt"], 40, text=False)
    return short, long_start


def complete(http: httpx.Client, stack: Stack, prompt: str, max_tokens: int, text: bool = True):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    response = http.post(stack.url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if text else choice["logprobs"]["tokens"]


def stream(url: str, body: dict, started: concurrent.futures.Future) -> dict:
    """Read one SSE stream to its end: the token strings, the error object if any, [DONE] or not."""
    tokens, error, done = [], None, False
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json={**body, "logprobs": 0}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                tokens += chunk["choices"][0]["logprobs"]["tokens"]
                if len(tokens) >= 3 and not started.done():
                    started.set_result(True)
    if not started.done():
        started.set_result(False)
    return {"tokens": tokens, "error": error, "done": done, "ended": time.monotonic()}


def start_streams(pool, stack: Stack, count: int) -> list[concurrent.futures.Future]:
    futures = []
    for _ in range(count):
        started = concurrent.futures.Future()
        futures.append(pool.submit(stream, stack.url, LONG, started))
        assert started.result(timeout=120), "the stream ended before its third token"
    return futures


def assert_nothing_leaked(stack: Stack, redis_server, r: redis.Redis) -> None:
    """No KV block used, no request running, waiting or swapped, nothing pending or left in Redis."""
    drained, state, _ = wait_drained(stack.url, redis_server.url, timeout=10)
    assert drained, state
    assert r.hlen(streams.STARTED) == 0


def assert_serves(stack: Stack, references) -> None:
    short, _ = references
    with httpx.Client(timeout=120) as http:
        for prompt, text in short.items():
            assert complete(http, stack, prompt, 8) == text


def assert_interrupted(result: dict, long_start: list[str]) -> None:
    """Ended by an error event then [DONE]; the text so far is the greedy text, never repeated."""
    assert result["done"] and result["error"] is not None
    assert result["error"]["type"] == "server_error"
    n = min(len(result["tokens"]), len(long_start))  # a fast host may stream past the reference
    assert n >= 3
    assert result["tokens"][:n] == long_start[:n]


# ----------------------------------------------------------------------------- workers


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_stopped_mid_stream_fails_its_streams_and_is_restarted(stack, redis_server, r, references,
                                                                                  sig):
    _, long_start = references
    worker = stack.children()["worker"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = start_streams(pool, stack, 2)
        os.kill(worker, sig)
        struck = time.monotonic()
        results = [f.result(timeout=30) for f in futures]
    # killed: its connection closes at once; stopped: the ZeroMQ heartbeat times out (4 s)
    limit = 5 if sig == signal.SIGKILL else 8
    for result in results:
        assert result["ended"] - struck < limit, result["ended"] - struck
        assert_interrupted(result, long_start)
        assert "worker rank 0 disconnected" in result["error"]["message"]
    wait_for(lambda: stack.health() == 503, 2, "/health to say 503")
    # the supervisor restarts it: on its exit, or when its heartbeat goes stale (--worker-timeout 5)
    wait_for(lambda: stack.children().get("worker") not in (None, worker), 30, "a new worker process")
    assert not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split()[2] == "Z"
    wait_for(lambda: stack.health() == 200, 120, "the stack to be healthy again")
    assert_serves(stack, references)
    assert_nothing_leaked(stack, redis_server, r)


# ----------------------------------------------------------------------------- scheduler


def test_a_killed_scheduler_is_restarted_and_takes_over_the_requests_it_held(stack, redis_server, r, references):
    short, long_start = references
    scheduler = stack.children()["scheduler"]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        streams_ = start_streams(pool, stack, 2)  # both sequences the scheduler runs at once
        queued = [pool.submit(lambda p=p: complete(httpx.Client(timeout=120), stack, p, 8)) for p in SHORT_PROMPTS]
        wait_for(lambda: r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] >= 4, 10,
                 "queued requests to be read by the scheduler")
        os.kill(scheduler, signal.SIGKILL)
        for result in (f.result(timeout=120) for f in streams_):
            assert_interrupted(result, long_start)  # streamed before: an error, no repeated text
            assert result["error"]["message"] == (
                "generation failed: the scheduler serving this request stopped after it had started streaming")
        assert [f.result(timeout=120) for f in queued] == [short[p] for p in SHORT_PROMPTS]  # not started: complete
    assert stack.children()["scheduler"] != scheduler
    assert_serves(stack, references)
    assert_nothing_leaked(stack, redis_server, r)


# ----------------------------------------------------------------------------- redis


def test_while_redis_restarts_the_gateway_answers_503_and_service_resumes(stack, r, redis_server, references):
    pids = stack.children()
    redis_server.stop()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # Redis down for 3 s
            with httpx.Client(timeout=10) as http:
                response = http.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "service_unavailable"
            assert response.headers["retry-after"] == "5"
            assert stack.health() == 503
            time.sleep(0.3)
    finally:
        redis_server.start()  # the same port, empty: no stream, no group, no status
    wait_for(lambda: stack.health() == 200, 30, "the stack to be healthy again")
    assert stack.children() == pids  # no process crashed or was restarted
    assert_serves(stack, references)
    assert_nothing_leaked(stack, redis_server, r)


def test_a_redis_restart_loses_no_accepted_request(stack, r, redis_server, references):
    """Two streams run and two requests wait in the scheduler (it read them); two more are queued
    unread in Redis when it restarts empty (no persistence). The gateway queues those two again
    under their ids; every request, and one sent once the new Redis is up, finishes once with the
    text it would have had; nothing runs on once every client has its answer."""
    short, long_start = references
    prompts = SHORT_PROMPTS + SHORT_PROMPTS[:1]
    pids = stack.children()
    long_tokens = 100  # the streams outlast the restart (checked below); the queued requests wait for them
    # the requests queued again wait for every other: a slow (shared) CPU may take minutes
    with concurrent.futures.ThreadPoolExecutor(7) as pool, httpx.Client(timeout=300) as http:
        streams_ = []
        for _ in range(2):
            started = concurrent.futures.Future()
            streams_.append(pool.submit(stream, stack.url, {**LONG, "max_tokens": long_tokens}, started))
            assert started.result(timeout=120), "the stream ended before its third token"
        held = [pool.submit(complete, http, stack, p, 8) for p in prompts[:2]]
        wait_for(lambda: r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] == 4, 10,
                 "two requests to wait in the scheduler")
        lost = [pool.submit(complete, http, stack, p, 8) for p in prompts[2:]]
        wait_for(lambda: r.xlen(streams.REQUESTS) == 6, 10, "two requests queued unread in Redis")
        redis_server.stop()
        redis_server.start()  # the same port, empty
        wait_for(lambda: stack.health() == 200, 30, "the scheduler's status in the new Redis")
        after = pool.submit(complete, http, stack, SHORT_PROMPTS[2], 8)  # before the gateway saw the restart
        assert not any(f.done() for f in streams_), "a stream ended before Redis was back"
        assert [f.result(timeout=300) for f in lost] == [short[p] for p in prompts[2:]]
        for result in (f.result(timeout=120) for f in streams_):
            assert (result["error"], result["done"], len(result["tokens"])) == (None, True, long_tokens)
            assert result["tokens"][:len(long_start)] == long_start
        assert [f.result(timeout=120) for f in held] == [short[p] for p in prompts[:2]]
        assert after.result(timeout=120) == short[SHORT_PROMPTS[2]]
    drained, state, _ = wait_drained(stack.url, redis_server.url, timeout=3)
    assert drained, state  # no request ran on for a client that had its answer
    assert stack.children() == pids


# ----------------------------------------------------------------------------- shutdown


def test_sigterm_drains_then_exits_0(stack, references):
    """Last in this module: it stops the stack."""
    short = {**LONG, "max_tokens": 10}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        finishing_started, cut_started = concurrent.futures.Future(), concurrent.futures.Future()
        finishing = pool.submit(stream, stack.url, short, finishing_started)
        cut = pool.submit(stream, stack.url, LONG, cut_started)
        assert finishing_started.result(timeout=60) and cut_started.result(timeout=60)
        processes = list(stack.children().values())
        stack.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_for(lambda: stack.health() == 0, 5, "the gateway to stop accepting connections")
        finished, failed = finishing.result(timeout=30), cut.result(timeout=30)
    assert failed["ended"] - signalled > DRAIN_TIMEOUT_S - 1  # it ran on until --drain-timeout
    assert (len(finished["tokens"]), finished["error"], finished["done"]) == (10, None, True)  # ran to its end
    assert failed["done"] and failed["error"]["code"] == "service_unavailable"  # cut at --drain-timeout
    assert failed["error"]["message"] == "the server is shutting down; retry the request"
    assert stack.process.wait(30) == 0
    assert [pid for pid in processes if os.path.exists(f"/proc/{pid}")] == []
