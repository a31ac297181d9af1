"""The memory page's data without a model: the scheduler server publishing its snapshot to a real
redis-server, and the gateway's /dashboard/snapshot and /dashboard/events (under uvicorn, as
`pagoda gateway` runs it) reading it back, with and without the API key.
(tests/test_dashboard.py checks the same through the real stack.)"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import threading
import time

import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request

try:  # as tests/test_gateway.py
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from common import streams
from common.config import EngineConfig, GatewayConfig, ServingConfig
from common.memory_snapshot import snapshot_json
from common.protocol import SamplingParams, WorkerHello, decode, encode
from common.redis_server import free_port
from common.tokenizer import load_tokenizer
from common.transport import WorkerLink
from gateway import dashboard as gateway_dashboard
from gateway.app import create_app
from gateway.dashboard import require_dashboard_key
from pagoda.bench.publish import EOS_TOKEN_IDS, VOCAB, ModelFreeExecutor
from pagoda.bench.stack import parse_samples
from scheduler.memory_view import build_snapshot
from scheduler.scheduler import Scheduler
from scheduler.server import SchedulerServer
from tests.stack import serve_app, wait_for

API_KEY = "sk-dash"


def running_scheduler(n: int = 2, prompt_len: int = 40) -> tuple[Scheduler, ModelFreeExecutor]:
    """A scheduler with one request of `n` samples, a few steps in (its samples share the prompt)."""
    config = EngineConfig(block_size=16, async_scheduling=False)
    scheduler = Scheduler(config, 64, 512, EOS_TOKEN_IDS, 16)
    scheduler.add_request("req-1", list(range(3, 3 + prompt_len)), SamplingParams(n=n, max_tokens=50, ignore_eos=True))
    executor = ModelFreeExecutor(16, seed=1)
    for _ in range(3):
        step(scheduler, executor)
    return scheduler, executor


def step(scheduler: Scheduler, executor: ModelFreeExecutor) -> None:
    scheduler.update(executor.execute(scheduler.schedule()))


# ----------------------------------------------------------------------------- the scheduler's side


def test_the_server_publishes_the_snapshot_when_it_changed_at_most_every_interval_and_deletes_it_at_shutdown(
        redis_url, r, monkeypatch):
    serving = ServingConfig(redis_url=redis_url, zmq_address=f"tcp://127.0.0.1:{free_port()}", scheduler_id="s-1",
                            engine_id="7")
    server = SchedulerServer(EngineConfig(block_size=16), serving)
    key = streams.memory_key("s-1")
    r.set(streams.MEMORY_WATCH, b"1")  # a page watches (test_nothing_is_published_while_no_page_watches)
    try:
        server._publish_status()
        server._publish_memory()  # no worker group yet: nothing to show
        assert r.get(key) is None
        server.scheduler, executor = running_scheduler()
        server._publish_memory()
        assert r.get(key) is None  # written with the next flush, in the round trip of the step's events
        server.stream.flush()
        published = decode(r.get(key))
        expected = build_snapshot(server.scheduler, "7", "s-1", version=1)
        assert snapshot_json(published) | {"time": 0} == snapshot_json(expected) | {"time": 0}
        assert 0 < r.pttl(key) <= streams.STATUS_TTL_S * 1000

        step(server.scheduler, executor)
        server._publish_memory()  # within the interval: not yet
        server.stream.flush()
        assert decode(r.get(key)).step == published.step
        server._last_memory -= server_interval()
        server._publish_memory()
        server.stream.flush()
        assert (decode(r.get(key)).step, decode(r.get(key)).version) == (published.step + 1, 2)

        r.delete(key)
        server._last_memory -= server_interval()
        server._publish_memory()  # nothing changed: nothing written
        server.stream.flush()
        assert r.get(key) is None
        server._last_status = 0.0
        server._publish_status()  # the status finds the snapshot gone (Redis lost it)...
        status = decode(r.get(streams.status_key("s-1")))
        assert (status.num_cpu_blocks, status.num_shared_blocks, status.num_blocks_saved_by_sharing) == (16, 2, 2)
        assert status.iteration_tokens_sum == 40 + 2 + 2 + 2 and sum(status.iteration_tokens) == 4
        server._publish_memory()  # ...so it is published again, at once
        server.stream.flush()
        assert (decode(r.get(key)).step, decode(r.get(key)).version) == (published.step + 1, 3)
    finally:
        server._shutdown()
    assert r.get(key) is None and r.get(streams.status_key("s-1")) is None


def test_a_restarted_worker_group_goes_on_with_the_event_ids(redis_url, r):
    """SchedulerServer hands its one MemoryEventLog to each Scheduler: a page that de-duplicates
    events by id sees the new group's events."""
    serving = ServingConfig(redis_url=redis_url, zmq_address=f"tcp://127.0.0.1:{free_port()}", scheduler_id="s-2")
    server = SchedulerServer(EngineConfig(block_size=16, async_scheduling=False), serving)
    r.set(streams.MEMORY_WATCH, b"1")
    try:
        last_ids = []
        for group in range(2):
            server.link.hellos = {0: HELLO}
            server._start_group()
            executor = ModelFreeExecutor(16, seed=group)
            server.scheduler.add_request(f"req-{group}", list(range(3, 43)),
                                         SamplingParams(n=2, max_tokens=50, ignore_eos=True))
            for _ in range(2):  # a fork, then a copy on write
                step(server.scheduler, executor)
            server._last_status, server._last_memory = 0.0, float("-inf")  # status and snapshot due
            server._publish()
            server.stream.flush()
            events = snapshot_json(decode(r.get(streams.memory_key("s-2"))))["events"]
            last_ids.append(events[-1]["id"])
            assert [e["id"] for e in events] == list(range(1, 1 + len(events)))  # none restarted at 1
            assert [(e["kind"], e["request_id"]) for e in events[-2:]] == [("fork", f"req-{group}"),
                                                                         ("cow", f"req-{group}")]
            server._fail_group("a worker restarted")  # the next group starts afresh, but for its ids
        assert last_ids == [2, 4]
    finally:
        server._shutdown()


def test_nothing_is_published_while_no_page_watches_and_a_watcher_sees_it_within_a_second(
        redis_url, r, gateway, client):
    serving = ServingConfig(redis_url=redis_url, zmq_address=f"tcp://127.0.0.1:{free_port()}", scheduler_id="s-3",
                            engine_id="3")
    server = SchedulerServer(EngineConfig(block_size=16), serving)
    server.scheduler, _ = running_scheduler()
    key = streams.memory_key("s-3")

    def serve_until(done, seconds: float) -> float:
        """The server's publishing, as its loop runs it, until done() or `seconds`: how long it took."""
        start = time.monotonic()
        while not done() and time.monotonic() - start < seconds:
            server._publish()
            time.sleep(0.02)
        return time.monotonic() - start

    try:
        serve_until(lambda: False, 1.2)  # its status three times: nobody watches, nothing is written
        assert r.get(key) is None and r.exists(streams.MEMORY_WATCH) == 0
        gateway.engine._memory_watched_at = float("-inf")  # (an earlier test's request set it within 2 s)
        assert client.get("/dashboard/snapshot").status_code == 200  # a page: it watches
        assert 0 < r.ttl(streams.MEMORY_WATCH) <= streams.MEMORY_WATCH_TTL_S
        assert serve_until(lambda: r.exists(key), 3.0) < 1.0  # published at the next status (0.5 s)
        served = []
        serve_until(lambda: served.extend(client.get("/dashboard/snapshot").json()["engines"]) or served, 3.0)
        assert [(e["engine"], e["scheduler_id"]) for e in served] == [("3", "s-3")]
        r.delete(streams.MEMORY_WATCH)  # no page for 10 s: the snapshot goes at the next status
        assert serve_until(lambda: not r.exists(key), 3.0) < 1.0
        serve_until(lambda: False, 0.6)
        assert r.get(key) is None
    finally:
        server._shutdown()


def test_the_first_snapshot_request_waits_for_the_ready_schedulers_it_began_watching(
        redis_url, r, gateway, client, monkeypatch):
    """Nobody watched, so no scheduler had published: the request that begins the watch answers
    with every ready scheduler's snapshot, not an empty list (a user's first curl)."""
    monkeypatch.setattr(WorkerLink, "ready", True)  # its workers said hello (the status: workers_ready)
    serving = ServingConfig(redis_url=redis_url, zmq_address=f"tcp://127.0.0.1:{free_port()}", scheduler_id="s-4",
                            engine_id="4")
    server = SchedulerServer(EngineConfig(block_size=16), serving)
    server.scheduler, _ = running_scheduler()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server._publish()
            time.sleep(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        gateway.engine._memory_watched_at = float("-inf")  # (an earlier test's request set it within 2 s)
        wait_for(lambda: r.exists(streams.status_key("s-4")), 5, "the scheduler's status")
        time.sleep(0.2)  # (the gateway's status cache)
        assert r.exists(streams.MEMORY_WATCH) == 0 and r.get(streams.memory_key("s-4")) is None
        engines = client.get("/dashboard/snapshot").json()["engines"]
        assert [(e["engine"], e["scheduler_id"]) for e in engines] == [("4", "s-4")]
    finally:
        stop.set()
        thread.join(5)
        server._shutdown()
        gateway.engine._memory_read_at = float("-inf")  # the next test reads Redis afresh


def server_interval() -> float:
    from scheduler.server import MEMORY_INTERVAL_S

    return MEMORY_INTERVAL_S


# ----------------------------------------------------------------------------- the gateway's side


@pytest.fixture(scope="module")
def gateway(redis_url):
    config = GatewayConfig(redis_url=redis_url, port=free_port(), api_key=API_KEY)
    app = create_app(config, tokenizer=load_tokenizer("default"))
    with serve_app(app, config.port):
        yield app.state.gateway


@pytest.fixture
def client(gateway):
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.config.port}", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


HELLO = WorkerHello(0, 1, "cpu", "dummy", 64, 16, 16, 512, VOCAB, EOS_TOKEN_IDS, 1000, 1e9, 1e4)


VERSIONS = itertools.count(1)


def publish(r: redis.Redis, scheduler: Scheduler, engine: str, scheduler_id: str) -> dict:
    """As a scheduler publishes: each snapshot a new version (the gateway streams a snapshot whose version is new)."""
    snapshot = build_snapshot(scheduler, engine, scheduler_id, version=next(VERSIONS))
    r.set(streams.memory_key(scheduler_id), encode(snapshot))
    return json.loads(json.dumps(snapshot_json(snapshot)))


def test_the_snapshot_route_serves_each_live_schedulers_snapshot_sorted_by_engine(client, r):
    assert client.get("/dashboard/snapshot").json() == {"engines": []}
    (a, _), (b, _) = running_scheduler(n=2), running_scheduler(n=3)
    second = publish(r, a, "1", "sched-a")
    first = publish(r, b, "0", "sched-b")
    # skipped, each logged: not msgpack, not a snapshot, bad packed ints (no width byte, a width of 3)
    r.set(streams.memory_key("garbage"), b"not msgpack")
    r.set(streams.memory_key("a-status"), encode(SamplingParams()))
    malformed = build_snapshot(a, "2", "empty-counts")
    r.set(streams.memory_key("empty-counts"), encode(dataclasses.replace(malformed, ref_counts=b"")))
    r.set(streams.memory_key("width-3"), encode(dataclasses.replace(malformed, cpu_ref_counts=b"\x03\x00\x00\x00")))
    time.sleep(0.3)  # the gateway reads Redis at most every 0.25 s
    response = client.get("/dashboard/snapshot")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json() == {"engines": [first, second]}
    assert [s["seq_id"] for s in first["sequences"]] == [0, 1, 2] and first["ref_counts"][1] == 3


def sse_events(lines, count: int) -> tuple[list[tuple[str, dict]], list[str]]:
    """The next `count` events (name, data) from an SSE response's lines, and the comments read meanwhile."""
    events, comments, event = [], [], None
    for line in lines:
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((event, json.loads(line[len("data: "):])))
            if len(events) == count:
                return events, comments
        else:
            assert line == "", line
    raise AssertionError("the stream ended")


def sse_snapshots(lines, count: int) -> tuple[list[dict], list[str]]:
    """The next `count` events' data, each a snapshot, and the comments read meanwhile."""
    events, comments = sse_events(lines, count)
    assert [name for name, _ in events] == ["snapshot"] * count
    return [data for _, data in events], comments


def test_the_event_stream_sends_each_engine_then_each_change_and_keeps_alive(client, r, monkeypatch):
    monkeypatch.setattr(gateway_dashboard, "DASHBOARD_KEEPALIVE_S", 0.5)
    a, executor = running_scheduler(n=2)
    b, _ = running_scheduler(n=1)
    publish(r, a, "0", "sched-a")
    publish(r, b, "1", "sched-b")
    time.sleep(0.3)
    with client.stream("GET", "/dashboard/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        (first, second), _ = sse_snapshots(lines, 2)
        assert [(s["engine"], s["scheduler_id"], s["step"]) for s in (first, second)] == [
            ("0", "sched-a", 3), ("1", "sched-b", 3)]
        step(a, executor)
        publish(r, a, "0", "sched-a")  # engine 1 unchanged: not sent again
        (changed,), comments = sse_snapshots(lines, 1)
        assert (changed["engine"], changed["step"]) == ("0", 4) and comments == []
        assert next(line for line in lines if line) == ": keepalive"  # nothing changes: a comment, not a snapshot
    served = {(labels["route"], labels["status"]): value for name, labels, value in parse_samples(
        client.get("/metrics").text) if name == "pagoda:http_requests_total"}
    assert served[("/dashboard/events", "200")] >= 1


def test_the_event_stream_says_when_an_engines_snapshot_is_gone(client, r):
    a, _ = running_scheduler(n=2)
    b, _ = running_scheduler(n=1)
    publish(r, a, "0", "sched-a")
    publish(r, b, "1", "sched-b")
    time.sleep(0.3)
    with client.stream("GET", "/dashboard/events") as response:
        lines = response.iter_lines()
        sse_snapshots(lines, 2)
        r.delete(streams.memory_key("sched-b"))  # its scheduler stopped, or lost its workers
        (gone,), _ = sse_events(lines, 1)
        assert gone == ("gone", {"engine": "1", "scheduler_id": "sched-b"})
        publish(r, b, "1", "sched-b")  # back: sent again in full
        (again,), _ = sse_snapshots(lines, 1)
        assert (again["engine"], again["scheduler_id"]) == ("1", "sched-b")


@pytest.mark.parametrize("path", ["/dashboard/snapshot", "/dashboard/events"])
def test_the_dashboard_data_needs_the_api_key_by_header_or_query(gateway, path):
    base = f"http://127.0.0.1:{gateway.config.port}"
    with httpx.Client(base_url=base, timeout=10) as c:
        for response, message in [
            (c.get(path), "missing API key: send the header 'Authorization: Bearer <key>' or add ?api_key=<key> "
                          "to the URL"),
            (c.get(path, params={"api_key": "wrong"}), "incorrect API key provided"),
            (c.get(path, headers={"Authorization": "Bearer wrong"}, params={"api_key": API_KEY}),
             "incorrect API key provided"),  # a header, when sent, is the key
        ]:
            assert response.status_code == 401
            assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                                 "param": None, "code": "invalid_api_key"}}
        if path == "/dashboard/snapshot":
            assert c.get(path, params={"api_key": API_KEY}).status_code == 200
            assert c.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        else:
            with c.stream("GET", path, params={"api_key": API_KEY}) as response:
                assert response.status_code == 200


def test_without_an_api_key_the_dashboard_is_open(gateway):
    """require_dashboard_key, as the page's own routes call it."""
    app = Starlette()
    app.state.gateway = copy.copy(gateway)
    app.state.gateway.config = dataclasses.replace(gateway.config, api_key=None)
    request = Request({"type": "http", "method": "GET", "path": "/dashboard", "headers": [], "query_string": b"",
                       "app": app})
    assert require_dashboard_key(request) is None


# ----------------------------------------------------------------------------- pagoda bench publish


def test_bench_publish_writes_its_measurement(tmp_path):
    from pagoda.cli import main

    out = tmp_path / "publish.json"
    assert main(["bench", "publish", "--num-blocks", "3000", "--num-requests", "40", "--publishes", "3",
                 "--publish-every", "5", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("pagoda bench publish --num-blocks 3000 --num-requests 40")
    assert (result["publishes"], result["publish_every_steps"], result["steps"]) == (3, 5, 15)
    assert set(result["publish_parts_ms"]) == {"build", "encode", "redis"}
    assert result["publish_ms"] > 0 and result["scheduler_step_ms"] > 0 and result["snapshot_bytes"] > 3000
    assert result["share_at_interval"] == round(result["publish_ms"] / max(250, result["scheduler_step_ms"]), 5)
    state = result["state"]
    assert state["num_used_blocks"] >= 0.9 * 2999
    assert state["num_shared_blocks"] > 0 and state["blocks_saved_by_sharing"] > 0
