"""`pagoda up --data-parallel-size 2` on CPU: two engine groups (a scheduler and a worker each), the
gateway routing by cache (`--routing auto`: cache-aware with two groups); /metrics shows each
group's share; a prefix's later requests go to the group that cached it, and one too busy for them
has them stolen by the other; a group whose scheduler is killed loses only the requests it had
started streaming, and the other group serves on meanwhile."""
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
    # --num-gpu-blocks 64, --cpu-prefix-cache: 1,000 tokens evict a prefix into the CPU tier
    stack = Stack("--redis-url", redis_server.url, "--data-parallel-size", "2", "--max-num-seqs", "2",
                  "--claim-idle-ms", "3000", "--worker-timeout", "10", "--num-gpu-blocks", "64",
                  "--cpu-prefix-cache").wait_ready().wait_engines(2)
    yield stack
    assert stack.stop() == 0


def stream(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed completion to its end: its tokens, the error object if any, its prompt tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
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


def routing_samples(stack: Stack) -> dict[tuple[str, str], float]:
    with httpx.Client(timeout=10) as http:
        text = http.get(stack.url + "/metrics").text
    return {(labels["engine"], labels["reason"]): value for metric, labels, value in parse_samples(text)
            if metric == "pagoda:routing_decisions_total"}


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def complete(url: str, token_ids: list[int], max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        response = http.post(url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_both_engine_groups_take_requests(stack):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream(stack.url, p), PROMPTS * 2))
    assert [(r["error"], len(r["tokens"])) for r in results] == [(None, MAX_TOKENS)] * 8
    assert results[:4] == results[4:]  # the same greedy text from whichever group ran it
    queried = engine_samples(stack, "pagoda:prefix_cache_queries_total")  # prompt tokens each group scheduled
    assert sorted(queried) == ["0", "1"] and min(queried.values()) > 0
    assert sum(queried.values()) == sum(r["prompt_tokens"] for r in results)  # each request ran once
    wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 0, "1": 0}, 5, "both groups idle")


def test_concurrent_prompts_shorter_than_a_block_are_served_by_both_groups(stack):
    """24 short prompts at once hold no block to route by: they go by load (then in turn), so both
    groups read some from their own streams (what a busy group leaves unread, the other may steal),
    and each request is decided and read once."""
    names = ("pagoda:requests_routed_total", "pagoda:requests_stolen_total")
    before, decisions = [engine_samples(stack, name) for name in names], routing_samples(stack)
    prompts = [f"Count from {i} to {i + 5}:" for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda p: stream(stack.url, p, max_tokens=4), prompts))
    assert [(r["error"], len(r["tokens"])) for r in results] == [(None, 4)] * 24
    assert max(r["prompt_tokens"] for r in results) < 16  # the block size: no prefix to place
    by_reason = delta(routing_samples(stack), decisions)
    assert {reason for _, reason in by_reason} == {"least_loaded"} and sum(by_reason.values()) == 24
    assert {engine for engine, _ in by_reason} == {"0", "1"}

    def read():
        return [delta(engine_samples(stack, name), b) for name, b in zip(names, before)]
    wait_for(lambda: sum(sum(counts.values()) for counts in read()) == 24, 5, "every request read, in the statuses")
    routed, _ = read()
    assert sorted(routed) == ["0", "1"]
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


def request_stream_lengths(redis_url: str) -> int:
    """Entries in every requests stream (the shared one and each group's)."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = [streams.REQUESTS, *client.scan_iter(match=streams.GROUP_REQUESTS_PREFIX + "*", _type="stream")]
        return sum(client.xlen(name) for name in names)
    finally:
        client.close()


def prefix_on_each_group(stack: Stack) -> dict[str, list[int]]:
    """A cached 16-token block in each group: new prompts go to the group holding fewer blocks, so
    they come to both."""
    found: dict[str, list[int]] = {}
    for i in range(20):
        prefix = list(range(30_000 + 16 * i, 30_000 + 16 * i + 16))
        before = routing_samples(stack)
        complete(stack.url, prefix + [1], max_tokens=1)
        [(engine, _)] = delta(routing_samples(stack), before)
        found.setdefault(engine, prefix)
        if len(found) == 2:
            return found
    raise AssertionError(f"20 new prompts all went to engine(s) {sorted(found)}")


def test_a_redis_killed_with_4_running_and_20_queued_serves_all_24_once(stack, redis_server):
    """Redis SIGKILLed and back empty (no persistence) while each group runs 2 requests and 20 more
    are queued: held by a scheduler that read them (2 at most per group) or unread in the groups'
    streams. The gateway queues the unread ones again under their ids, the schedulers keep what
    they hold, and all 24 complete with every token; the prompt tokens scheduled are each
    request's once; nothing is left in Redis."""
    prefixes = prefix_on_each_group(stack)  # the long requests follow them: 2 to each group
    running = [prefixes[engine] + [7, 8, 9, i] for engine in ("0", "1") for i in range(2)]
    queued = [list(range(45_000 + 100 * i, 45_000 + 100 * i + 20)) for i in range(20)]
    time.sleep(0.6)  # a status (every 0.5 s) after the prompts above: their lookups counted
    queried_before = sum(engine_samples(stack, "pagoda:prefix_cache_queries_total").values())
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        long = [pool.submit(complete, stack.url, ids, 48) for ids in running]
        wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 2, "1": 2}, 30,
                 "each group to run 2")
        short = [pool.submit(complete, stack.url, ids, 4) for ids in queued]  # 4 tokens each, 2 at a time per group
        wait_for(lambda: sum(engine_samples(stack, "pagoda:num_requests_waiting").values()) >= 2
                 and request_stream_lengths(redis_server.url) == 24, 30, "all 24 in Redis, 2 or more held")
        assert not any(f.done() for f in long), "a long request ended before Redis was killed"
        redis_server.kill()
        redis_server.stop()  # its directory goes: the restart is empty
        redis_server.start()
        results = [f.result(timeout=300) for f in long + short]
    assert [r["usage"]["completion_tokens"] for r in results] == [48] * 4 + [4] * 20
    wait_for(lambda: sum(engine_samples(stack, "pagoda:prefix_cache_queries_total").values()) - queried_before
             >= 24 * 20, 5, "the last lookups in the statuses")
    time.sleep(0.6)
    queried = sum(engine_samples(stack, "pagoda:prefix_cache_queries_total").values()) - queried_before
    assert queried == 24 * 20  # each request scheduled once (all 20 tokens long)
    drained, state, _ = wait_drained(stack.url, redis_server.url, timeout=15)
    assert drained, state
    stack.wait_engines(2, timeout=30)


def test_a_prefixs_later_requests_go_to_the_group_that_cached_it(stack):
    """Each of two new 3-block prefixes goes to the group holding fewer blocks (smallest_cache); its
    second request goes where its blocks are, by cache, and finds all 3 there: cached_tokens is
    the blocks hit times the block size, and that group's prefix-cache hits grow by as much."""
    prefixes = [list(range(1000, 1048)), list(range(3000, 3048))]
    hits_before = engine_samples(stack, "pagoda:prefix_cache_hits_total")
    owners = []
    for p in prefixes:
        before = routing_samples(stack)
        first = complete(stack.url, p + [1, 2, 3])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        [(owner, reason)] = delta(routing_samples(stack), before)
        assert reason == "smallest_cache"
        owners.append(owner)
    hits = {}
    for p, owner in zip(prefixes, owners):
        before = routing_samples(stack)
        second = complete(stack.url, p + [7, 8])
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert delta(routing_samples(stack), before) == {(owner, "cache_hit"): 1}
        hits[owner] = hits.get(owner, 0) + 48
    wait_for(lambda: delta(engine_samples(stack, "pagoda:prefix_cache_hits_total"), hits_before) == hits,
             5, "each group's hits in its status")


def test_a_busy_groups_requests_are_stolen_by_the_idle_one(stack):
    """8 long requests of a prefix cached in one group all go there (within the balance margin);
    it holds 2 running and 2 waiting (--max-num-seqs 2), the rest wait in its stream, and the other
    group steals them after --steal-after-ms. Every one completes, once."""
    prefix = list(range(5000, 5048))
    before = routing_samples(stack)
    complete(stack.url, prefix + [1])
    [(owner, reason)] = delta(routing_samples(stack), before)
    other = {"0": "1", "1": "0"}[owner]
    stolen_before = engine_samples(stack, "pagoda:requests_stolen_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: complete(stack.url, prefix + [100 + i], max_tokens=24), range(8)))
    assert [r["usage"]["completion_tokens"] for r in results] == [24] * 8
    routes = delta(routing_samples(stack), before)
    assert routes == {(owner, reason): 1, (owner, "cache_hit"): 8}
    wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 0, "1": 0}, 5, "both groups idle")
    stolen = delta(engine_samples(stack, "pagoda:requests_stolen_total"), stolen_before)
    assert set(stolen) == {other} and 1 <= stolen[other] <= 4
    wait_for(lambda: engine_samples(stack, "pagoda:num_requests_running") == {"0": 0, "1": 0}, 5, "both groups idle")


def test_an_evicted_prefix_comes_back_from_the_cpu_tier_with_the_tokens_it_had(stack):
    """--cpu-prefix-cache on the real stack: a prompt's 3 blocks are cached in one group; two
    long prompts sharing only its first block follow it there (by cache) and evict its other two
    from the 64-block pool into the group's CPU tier. The prompt again is routed there, finds
    block 1 in the pool and blocks 2-3 in the tier (cached_tokens 48, tier hits 32), and generates
    the tokens it generated when it computed them."""
    prompt = list(range(7000, 7048)) + [1, 2, 3]
    stores, hits = (engine_samples(stack, f"pagoda:cpu_prefix_cache_{name}_total") for name in ("stores", "hits"))
    before = routing_samples(stack)
    first = complete(stack.url, prompt, max_tokens=8)
    [(owner, _)] = delta(routing_samples(stack), before)
    # 60 blocks each, 59 of them new, of the 63: the second evicts all but the first one's, least
    # recently used first, the prompt's blocks 2 and 3 among them
    for start in (10_000, 20_000):
        complete(stack.url, prompt[:16] + list(range(start, start + 930)), max_tokens=1)
    assert delta(routing_samples(stack), before) == {(owner, "smallest_cache"): 1, (owner, "cache_hit"): 2}
    wait_for(lambda: delta(engine_samples(stack, "pagoda:cpu_prefix_cache_stores_total"), stores).get(owner, 0) >= 2,
             5, "the group's tier to hold the evicted blocks")
    again = complete(stack.url, prompt, max_tokens=8)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    wait_for(lambda: delta(engine_samples(stack, "pagoda:cpu_prefix_cache_hits_total"), hits) == {owner: 32}, 5,
             "the group's tier hits in its status")
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
