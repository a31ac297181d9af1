"""A tensor-parallel group loses a rank, on real processes: redis-server, two engine groups (each
a `pagoda scheduler --tensor-parallel-size 2` and two `pagoda worker --rank R` processes over
ZeroMQ, the ranks joined by torch.distributed on gloo), a tiny random Llama, and a client that
speaks the gateway's side of Redis (requests in, reply stream out).

A rank killed (SIGKILL) or stopped (SIGSTOP) mid-stream: the streams its group runs end with an
error event within seconds (a killed rank's connection closes at once, a stopped one's ZeroMQ
heartbeat times out after 4 s); the requests its group held but had not started are taken over;
the other group serves throughout; when the rank is back (restarted, or SIGCONT) the group forms
again under a new epoch and streams the same greedy tokens as before; no KV block, running request
or pending entry is left in either group.

Which group runs what: a scheduler holds at most twice --max-num-seqs requests (running and
waiting); group 0 runs two sequences at a time and group 1 one, so of five long streams group 1
holds at most two and group 0 at least three: two it streams, and at least one it has not started.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from common import streams
from common.protocol import GenerateRequest, RequestEvent, SamplingParams, SchedulerStatus, decode, decode_events, encode
from common.redis_server import free_port
from tests.conftest import TINY_LLAMA
from tests.stack import ROOT, wait_for

pytestmark = pytest.mark.slow
# TINY_LLAMA: 4 query heads, 2 KV heads: one KV head per rank
ENGINE = ["--model", f"dummy:{TINY_LLAMA}", "--device", "cpu", "--tensor-parallel-size", "2", "--num-gpu-blocks",
          "128", "--num-cpu-blocks", "0"]
REPLIES = streams.reply_stream("test-rank-loss")
LONG = list(range(100, 120))  # a prompt whose greedy stream runs long enough to strike mid-stream
# the strike comes within milliseconds of the group's second stream starting, and 64 tokens take over
# a second here; every stream not struck runs to the end, five per phase: 160 made each test 6-8 s longer
LONG_TOKENS = 64
SHORT = list(range(300, 310))
SHORT_TOKENS = 16


class EngineGroup:
    """One engine group's processes: its scheduler and its two ranks, each logging to a file."""

    def __init__(self, engine_id: str, redis_url: str, max_num_seqs: int, logs: Path) -> None:
        self.engine_id = engine_id
        self.logs = logs
        self.zmq_address = f"tcp://127.0.0.1:{free_port()}"
        self.dist_init_address = f"tcp://127.0.0.1:{free_port()}"
        self.scheduler = self._start(
            "scheduler", "scheduler", "--redis-url", redis_url, "--zmq-address", self.zmq_address,
            "--engine-id", engine_id, "--max-num-seqs", str(max_num_seqs), "--step-timeout", "10",
            "--drain-timeout", "1", "--claim-interval", "0.5", "--claim-idle-ms", "2000")
        self.scheduler_id = f"{socket.gethostname()}-{self.scheduler.pid}"  # its consumer name in Redis
        self.ranks = [self.start_rank(rank) for rank in (0, 1)]

    def start_rank(self, rank: int) -> subprocess.Popen:
        # --step-timeout: how long a rank waits in a collective (or to form the group) for the others;
        # past the ZeroMQ heartbeat's 4-5 s, so the scheduler names a stopped rank, not its peer's timeout
        return self._start(f"rank{rank}", "worker", "--rank", str(rank), "--zmq-address", self.zmq_address,
                           "--dist-init-address", self.dist_init_address, "--step-timeout", "8")

    def _start(self, name: str, command: str, *flags: str) -> subprocess.Popen:
        with open(self.logs / f"engine{self.engine_id}-{name}.log", "a") as log:
            return subprocess.Popen([sys.executable, "-m", "pagoda.cli", command, *ENGINE, *flags], cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})

    def generations(self, rank: int) -> list[int]:
        """The group incarnations (epochs) this rank has joined, in order, from its log."""
        text = (self.logs / f"engine{self.engine_id}-rank{rank}.log").read_text()
        return [int(g) for g in re.findall(rf"tensor-parallel rank {rank}/2 joined generation (\d+)", text)]

    def stop(self) -> None:
        processes = [self.scheduler, *self.ranks]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Client:
    """The gateway's side of Redis: requests on the stream, events from its reply stream."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.cursor = b"0-0"
        self.events: dict[str, list[RequestEvent]] = {}
        self.owners: dict[str, str] = {}  # request id -> the scheduler that streamed it (pagoda:started)
        self.entries: dict[bytes, str] = {}  # entry id in the requests stream -> request id

    def submit(self, prompt: list[int], max_tokens: int, tag: str) -> str:
        request_id = f"{tag}-{uuid.uuid4().hex[:8]}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(request_id, prompt, params, REPLIES, time.time())
        self.entries[self.r.xadd(streams.REQUESTS, {streams.FIELD: encode(request)})] = request_id
        return request_id

    def poll(self) -> None:
        for _, entries in self.r.xread({REPLIES: self.cursor}, block=20) or []:
            for entry_id, fields in entries:
                self.cursor = entry_id
                for event in decode_events(fields[streams.FIELD]):
                    events = self.events.setdefault(event.request_id, [])
                    assert not events or events[-1].finish_reason is None, f"an event after {event.request_id}'s last"
                    events.append(event)
                    if event.token_ids and event.request_id not in self.owners:
                        owner = self.r.hget(streams.STARTED, event.request_id)  # set with its first token
                        if owner is not None:
                            self.owners[event.request_id] = owner.decode()

    def wait(self, condition, timeout: float, what: str) -> float:
        start = time.monotonic()
        while not condition():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            self.poll()
        return time.monotonic() - start

    def finished(self, request_id: str) -> bool:
        events = self.events.get(request_id)
        return bool(events) and events[-1].finish_reason is not None

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events.get(request_id, []) for t in e.token_ids]

    def run(self, prompt: list[int], max_tokens: int, tag: str, timeout: float = 60) -> list[int]:
        request_id = self.submit(prompt, max_tokens, tag)
        self.wait(lambda: self.finished(request_id), timeout, f"{request_id} to finish")
        assert self.events[request_id][-1].finish_reason == "length", self.events[request_id][-1]
        return self.tokens(request_id)


@pytest.fixture(scope="module")
def logs() -> Path:
    directory = ROOT / ".pytest_cache" / f"rank-loss-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture(scope="module")
def groups(redis_server, logs):
    made = [EngineGroup("0", redis_server.url, 2, logs), EngineGroup("1", redis_server.url, 1, logs)]
    r = redis.Redis.from_url(redis_server.url)
    try:
        for group in made:
            wait_for(lambda: ready(r, group), 180, f"engine group {group.engine_id} to be ready (logs in {logs})")
        yield made
    finally:
        for group in made:
            group.stop()
        r.close()


@pytest.fixture(scope="module")
def client(redis_server):
    client = Client(redis.Redis.from_url(redis_server.url))
    yield client
    client.r.close()


@pytest.fixture(scope="module")
def reference(groups, client) -> dict[str, list[int]]:
    """Greedy outputs before any fault (both groups run the same shards the same way: one answer)."""
    return {"long": client.run(LONG, LONG_TOKENS, "ref"), "short": client.run(SHORT, SHORT_TOKENS, "ref")}


def status(r: redis.Redis, group: EngineGroup) -> SchedulerStatus | None:
    raw = r.get(streams.status_key(group.scheduler_id))
    return None if raw is None else decode(raw)


def ready(r: redis.Redis, group: EngineGroup) -> bool:
    s = status(r, group)
    return s is not None and s.workers_ready


def idle(r: redis.Redis, group: EngineGroup) -> bool:
    """Nothing running, waiting or swapped, and no KV block in use."""
    s = status(r, group)
    return s is not None and (s.num_running, s.num_waiting, s.num_swapped, s.kv_cache_usage) == (0, 0, 0, 0.0)


def started_by(r: redis.Redis, group: EngineGroup) -> list[str]:
    return sorted(k.decode() for k, v in r.hgetall(streams.STARTED).items() if v.decode() == group.scheduler_id)


def held_by(client: Client, group: EngineGroup) -> list[str]:
    """The requests `group`'s scheduler has read and not yet ended (pending under its name)."""
    pending = client.r.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", 100,
                                      consumername=group.scheduler_id)
    return sorted(client.entries[p["message_id"]] for p in pending)


def start_long_streams(client: Client, group: EngineGroup, tag: str) -> list[str]:
    """Five long streams; back once all are read and `group` streams two of them. Group 1 holds at
    most two, so group 0 holds at least three: two running, one or more waiting."""
    ids = [client.submit(LONG, LONG_TOKENS, tag) for _ in range(5)]
    client.wait(lambda: client.r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] == 5, 30,
                "the streams to be read")
    client.wait(lambda: len(started_by(client.r, group)) == 2, 30, f"engine group {group.engine_id} to stream two")
    return ids


@pytest.mark.parametrize("sig, rank", [(signal.SIGKILL, 0), (signal.SIGSTOP, 1)],
                         ids=["SIGKILL-rank0", "SIGSTOP-rank1"])
def test_a_group_that_loses_a_rank_fails_its_streams_and_forms_again_while_the_other_serves(
        groups, client, reference, sig, rank):
    lost, other = groups
    r = client.r
    ids = start_long_streams(client, lost, f"{sig.name}-before")
    struck_ids = started_by(r, lost)
    waiting_ids = [i for i in held_by(client, lost) if i not in struck_ids]
    assert len(waiting_ids) >= 1
    generations = lost.generations(1 - rank)
    os.kill(lost.ranks[rank].pid, sig)

    # the streams of the group that lost a rank end with an error within seconds, never hang
    took = client.wait(lambda: all(client.finished(i) for i in struck_ids), 15, "the struck streams to end")
    assert took < (5 if sig == signal.SIGKILL else 9), took  # killed: at once; stopped: the 4 s heartbeat
    for request_id in struck_ids:
        last = client.events[request_id][-1]
        assert (last.finish_reason, last.token_ids) == ("error", [])
        assert last.error == (f"the worker failed: worker rank {rank} disconnected "
                              "(exited, was killed or stopped answering)")
        n = len(client.tokens(request_id))
        assert 1 <= n < LONG_TOKENS and client.tokens(request_id) == reference["long"][:n]
    wait_for(lambda: not ready(r, lost) and idle(r, lost), 5, "the group to hold nothing and wait for its ranks")

    # the other group serves throughout: a request sent now, and what the lost group had not started
    assert client.run(SHORT, SHORT_TOKENS, f"{sig.name}-during") == reference["short"]
    rest = [i for i in ids if i not in struck_ids]
    client.wait(lambda: all(client.finished(i) for i in rest), 60, "the other streams to finish")
    for request_id in rest:  # the other group's, and those the lost group had not started: taken over
        assert client.events[request_id][-1].finish_reason == "length", client.events[request_id][-1]
        assert client.tokens(request_id) == reference["long"]
        assert client.owners[request_id] == other.scheduler_id
    assert set(waiting_ids) <= set(rest)
    assert not ready(r, lost)

    # the rank comes back: the group forms again, under a new epoch, and streams the same tokens
    if sig == signal.SIGKILL:
        lost.ranks[rank].wait(5)
        lost.ranks[rank] = lost.start_rank(rank)  # rank 0: binds the group's store again
    else:
        os.kill(lost.ranks[rank].pid, signal.SIGCONT)
    wait_for(lambda: ready(r, lost), 60, "the group to be ready again")
    ids = start_long_streams(client, lost, f"{sig.name}-after")
    client.wait(lambda: all(client.finished(i) for i in ids), 60, "the streams after the rank came back")
    assert [client.tokens(i) for i in ids] == [reference["long"]] * 5
    assert [client.owners[i] for i in ids].count(lost.scheduler_id) >= 2
    new = [g for g in lost.generations(1 - rank) if g not in generations]
    assert len(set(new)) >= 1 and new[-1] == lost.generations(rank)[-1]  # both ranks in the new incarnation

    # nothing left behind in either group or in Redis
    for group in groups:
        wait_for(lambda: idle(r, group), 5, f"engine group {group.engine_id} to be idle")
    assert r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] == 0
    assert r.xlen(streams.REQUESTS) == 0 and r.hlen(streams.STARTED) == 0
