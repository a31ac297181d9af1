"""The scheduler process on its real edges: a real redis-server, real ZeroMQ, a fake worker rank.

The SchedulerServer runs `serve_forever()` in a thread. The fake worker speaks the worker's side
of common/transport.py like worker/server.py (hello, a result per plan, hello again when idle),
applies each plan's diffs the way worker/executor.py does (tests/fakes.py) and samples a
deterministic token, so no model and no torch are needed. It can be told to hang, to fail a step
or to exit.
"""
from __future__ import annotations

import threading
import time

import pytest
import redis

import scheduler.inbox as inbox
import scheduler.request_stream as request_stream
from common import streams
from common.config import EngineConfig, ServingConfig
from common.protocol import (
    PENDING_TOKEN, GenerateRequest, HeldRequests, RequestEvent, SampledToken, SamplingParams, SchedulerStatus, StepPlan,
    StepResult,
    WorkerHello, decode, decode_events, encode,
)
from common.redis_server import RedisServer, free_port, stable_port
from common.transport import SchedulerLink
from scheduler.scheduler import Scheduler
from scheduler.server import SchedulerServer
from tests.fakes import FakeExecutor, expected_output

EOS = 2
NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
SCHEDULER_ID = "test-scheduler"
REPLIES = streams.reply_stream("test-gateway")


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------------- fake worker


class FakeWorker:
    """One worker rank in a thread. `mode`: "serve", "hang" (no answers, no hellos), "boom" (fail
    the next step with error="boom", then serve again), "exit" (close the socket and end)."""

    def __init__(self, address: str, block_size: int = BLOCK_SIZE, step_delay_s: float = 0.0,
                 rehello_s: float = 2.0, rank: int = 0, world_size: int = 1,
                 executor: FakeExecutor | None = None, kv_groups: tuple[int, ...] = ()) -> None:
        self.address = address
        self.hello = WorkerHello(
            rank=rank, world_size=world_size, device="fake", model="fake-model", num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
            block_size=block_size, max_model_len=MAX_MODEL_LEN, vocab_size=1024, eos_token_ids=[EOS],
            kv_bytes_per_block=1024, host_bandwidth=1e9, prefill_tokens_per_s=1e5, kv_groups=list(kv_groups),
        )
        self.executor = executor or FakeExecutor(block_size)
        self.step_delay_s = step_delay_s
        self.rehello_s = rehello_s
        self.mode = "serve"
        self.plans: list[StepPlan] = []
        self.failures: list[str] = []  # broken contract, seen by the fake executor
        self.num_hellos = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        link = SchedulerLink(self.address)
        try:
            self._say_hello(link)
            epoch, failed_epoch, idle_since = None, None, time.monotonic()
            while not self._stop and self.mode != "exit":
                if self.mode == "hang":
                    time.sleep(0.01)
                    continue
                plan = link.recv_plan(timeout_ms=20)
                if plan is None:
                    if time.monotonic() - idle_since > self.rehello_s:
                        self._say_hello(link)
                        idle_since = time.monotonic()
                    continue
                if self.mode == "hang":  # hung while a plan was on its way
                    continue
                self.plans.append(plan)
                if plan.epoch != epoch:
                    self.executor.reset()
                    epoch = plan.epoch
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                if self.mode == "boom":
                    self.mode = "serve"
                    self.executor.reset()
                    failed_epoch = plan.epoch
                    result = StepResult(plan.step, plan.epoch, error="boom")
                elif plan.epoch == failed_epoch:  # as worker/server.py: sent before the scheduler saw it
                    result = StepResult(plan.step, plan.epoch, error="an earlier step of this epoch failed")
                else:
                    try:
                        result = self.executor.execute(plan)
                    except Exception as exc:  # noqa: BLE001 - reported to the test and the scheduler
                        self.failures.append(f"step {plan.step}: {type(exc).__name__}: {exc}")
                        self.executor.reset()
                        failed_epoch = plan.epoch
                        result = StepResult(plan.step, plan.epoch, error=f"fake executor: {exc}")
                link.send_result(result)
                idle_since = time.monotonic()
        finally:
            link.close()

    def _say_hello(self, link: SchedulerLink) -> None:
        link.hello(self.hello)
        self.num_hellos += 1

    def stop(self) -> None:
        self._stop = True
        self.thread.join(5)
        assert not self.thread.is_alive()


# ----------------------------------------------------------------------------- fixtures


class Harness:
    def __init__(self, redis_url: str, r: redis.Redis, scheduler_id: str = SCHEDULER_ID,
                 serving: dict | None = None, **engine) -> None:
        self.r = r
        self.scheduler_id = scheduler_id
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.serving = ServingConfig(redis_url=redis_url, zmq_address=self.address, step_timeout_s=1.0,
                                     scheduler_id=scheduler_id, **(serving or {}))
        self.server = SchedulerServer(EngineConfig(block_size=BLOCK_SIZE, **engine), self.serving)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.workers: list[FakeWorker] = []
        self.cursor = b"0-0"
        self.events: dict[str, list[RequestEvent]] = {}

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException as exc:  # reported by the waits and at teardown
            self.error = exc
            raise

    def worker(self, **kwargs) -> FakeWorker:
        worker = FakeWorker(self.address, **kwargs)
        self.workers.append(worker)
        return worker

    def stop_server(self) -> None:
        self.server.stopping = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server did not stop"

    def close(self) -> None:
        if self.thread.is_alive():
            self.stop_server()
        for worker in self.workers:
            worker.stop()
        assert self.error is None, f"serve_forever raised {self.error!r}"
        for worker in self.workers:
            assert worker.failures == []

    # -------------------------------------------------------------- requests and events
    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int = 8, **params) -> bytes:
        return self.submit_to(self.r, request_id, prompt_ids, max_tokens, **params)

    @staticmethod
    def submit_to(r: redis.Redis, request_id: str, prompt_ids: list[int], max_tokens: int = 8, **params) -> bytes:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
        request = GenerateRequest(request_id, prompt_ids, params, REPLIES, time.time())
        return r.xadd(streams.REQUESTS, {streams.FIELD: encode(request)})

    def abort(self, request_id: str) -> None:
        self.r.xadd(streams.ABORTS, {streams.ABORT_FIELD: request_id})

    def poll_events(self, block_ms: int = 50) -> None:
        replies = self.r.xread({REPLIES: self.cursor}, block=block_ms)
        for _, entries in replies or []:
            for entry_id, fields in entries:
                self.cursor = entry_id
                for event in decode_events(fields[streams.FIELD]):
                    events = self.events.setdefault(event.request_id, [])
                    assert not events or events[-1].finish_reason is None, f"an event after {event.request_id}'s last"
                    events.append(event)

    def finished(self, request_id: str) -> bool:
        events = self.events.get(request_id)
        return bool(events) and events[-1].finish_reason is not None

    def wait_until(self, condition, timeout: float = 5.0, what: str = "condition") -> float:
        """Poll the reply stream until `condition()`; returns the seconds it took."""
        start = time.monotonic()
        while not condition():
            if self.error is not None:
                raise AssertionError(f"serve_forever raised {self.error!r}") from self.error
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            self.poll_events()
        return time.monotonic() - start

    def wait_finished(self, *request_ids: str, timeout: float = 5.0) -> dict[str, list[RequestEvent]]:
        self.wait_until(lambda: all(self.finished(i) for i in request_ids), timeout, f"{request_ids} to finish")
        return {i: self.events[i] for i in request_ids}

    def wait_ready(self, timeout: float = 5.0) -> None:
        self.wait_until(lambda: self.server.scheduler is not None, timeout, "the workers to be ready")

    # -------------------------------------------------------------- redis state
    def num_pending(self) -> int:
        return self.r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"]

    def status(self) -> SchedulerStatus | None:
        raw = self.r.get(streams.status_key(self.scheduler_id))
        return None if raw is None else decode(raw)

    def assert_nothing_held(self) -> None:
        """Every request ended: acknowledged and deleted from the requests stream."""
        self.wait_until(lambda: self.num_pending() == 0 and self.r.xlen(streams.REQUESTS) == 0, 2.0,
                        "the requests to be acknowledged and deleted")


@pytest.fixture
def harness(redis_url, r):
    h = Harness(redis_url, r)
    yield h
    h.close()


@pytest.fixture
def make_harness(redis_url, r):
    """Harnesses with their own settings (`serving`: ServingConfig fields), closed at teardown."""
    made: list[Harness] = []

    def make(**kwargs) -> Harness:
        made.append(Harness(redis_url, r, **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.close()


def tokens(events: list[RequestEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


# ----------------------------------------------------------------------------- serving


def test_a_request_streams_exactly_max_tokens_then_is_acked_and_deleted(harness):
    harness.worker()
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=12)
    harness.submit("b", prompt(20, start=500), max_tokens=5, logprobs=1)
    done = harness.wait_finished("a", "b")

    assert tokens(done["a"]) == expected_output(0, 10, 12)
    assert tokens(done["b"]) == expected_output(1, 20, 5)
    for events in done.values():
        assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["length"]
        assert all(len(e.token_ids) == 1 for e in events)  # one token per step, streamed as it comes
        assert all(e.error is None for e in events)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # the gateway drops a repeat
    assert [e.logprobs for e in done["a"]] == [None] * 12
    assert [e.logprobs for e in done["b"]] == [[[-0.25, [[t, -0.25]]]] for t in expected_output(1, 20, 5)]
    harness.assert_nothing_held()

    def idle_status():
        s = harness.status()
        return s is not None and s.workers_ready and s.num_running == 0 and s.num_waiting == 0 \
            and s.kv_cache_usage == 0.0

    harness.wait_until(idle_status, 3.0, "an idle status")
    status = harness.status()
    assert (status.scheduler_id, status.model, status.max_model_len, status.block_size, status.num_gpu_blocks) == (
        SCHEDULER_ID, "fake-model", MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS,
    )
    assert harness.server.scheduler.block_manager.num_free_blocks == NUM_BLOCKS - 1


def test_the_overlapped_loop_plans_each_step_before_the_last_result_with_the_same_tokens(harness):
    """Async scheduling (the default): a plan made while its predecessor's result was outstanding
    continues a sequence with PENDING_TOKEN, which the worker resolves; the tokens are unchanged."""
    worker = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=12)
    harness.submit("b", prompt(20, start=500), max_tokens=5, logprobs=1)
    done = harness.wait_finished("a", "b")
    assert tokens(done["a"]) == expected_output(0, 10, 12)
    assert tokens(done["b"]) == expected_output(1, 20, 5)
    pending = [c.seq_id for plan in worker.plans for c in plan.cached_seqs if c.last_token_id == PENDING_TOKEN]
    assert pending.count(0) >= 9 and pending.count(1) >= 2
    assert [plan.step for plan in worker.plans] == list(range(1, len(worker.plans) + 1))  # in order, none lost
    harness.assert_nothing_held()
    harness.wait_until(lambda: harness.server.scheduler.num_in_flight == 0, 2.0, "the last plan's result to be applied")


class SampledBroadcast:
    """What rank 0 of a fake tensor-parallel group broadcasts to the others each step: its sampled
    tokens (worker/parallel.py carries them over torch.distributed in the real group)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list[SampledToken]] = {}
        self.cond = threading.Condition()

    def send(self, plan: StepPlan, sampled: list[SampledToken]) -> None:
        with self.cond:
            self.sent[plan.epoch, plan.step] = sampled
            self.cond.notify_all()

    def recv(self, plan: StepPlan) -> list[SampledToken]:
        with self.cond:
            assert self.cond.wait_for(lambda: (plan.epoch, plan.step) in self.sent, timeout=5)
            return self.sent[plan.epoch, plan.step]


class RankExecutor(FakeExecutor):
    """A rank of a fake tensor-parallel group, as the contract says: rank 0 samples, returns the
    tokens and broadcasts them; a rank > 0 records rank 0's tokens (what a PENDING_TOKEN of its next
    plan stands for) and returns an empty result. `steps`: each step's sequences and their tokens."""

    def __init__(self, block_size: int, rank: int, broadcast: SampledBroadcast) -> None:
        super().__init__(block_size)
        self.rank = rank
        self.broadcast = broadcast
        self.steps: list[list[tuple[int, list[int]]]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        if self.rank == 0:
            result = super().execute(plan)
            self.broadcast.send(plan, result.sampled)
        else:
            self.plans.append(plan)
            self.state.apply(plan)
            self.state.record_sampled(self.broadcast.recv(plan))
            result = StepResult(plan.step, plan.epoch)
        scheduled = [c.seq_id for c in plan.cached_seqs] + [n.seq_id for n in plan.new_seqs]
        self.steps.append([(i, list(self.state.seqs[i].token_ids)) for i in sorted(scheduled)])
        return result


def test_a_group_of_two_ranks_plans_ahead_and_every_rank_holds_rank_0s_tokens(redis_url, r):
    """Async scheduling stays on for a tensor-parallel group: rank 0 broadcasts its sampled tokens,
    so rank 1 resolves each PENDING_TOKEN to rank 0's draw; the scheduler waits for both ranks'
    results and streams rank 0's tokens."""
    harness = Harness(redis_url, r, tensor_parallel_size=2)
    try:
        broadcast = SampledBroadcast()
        workers = [harness.worker(rank=rank, world_size=2, step_delay_s=0.005,
                                  executor=RankExecutor(BLOCK_SIZE, rank, broadcast)) for rank in (0, 1)]
        harness.wait_ready()
        assert harness.server.scheduler.config.async_scheduling is True
        harness.submit("a", prompt(10), max_tokens=8)
        harness.submit("b", prompt(20, start=500), max_tokens=5)
        done = harness.wait_finished("a", "b")
        assert tokens(done["a"]) == expected_output(0, 10, 8)
        assert tokens(done["b"]) == expected_output(1, 20, 5)
        harness.wait_until(lambda: harness.server.scheduler.num_in_flight == 0, 2.0, "the last result to be applied")
        rank0, rank1 = (w.executor for w in workers)
        assert [p.step for p in rank1.plans] == [p.step for p in rank0.plans] == list(range(1, len(rank0.plans) + 1))
        assert rank1.steps == rank0.steps  # the same tokens, step by step
        last_of_a = [held for step in rank0.steps for seq_id, held in step if seq_id == 0][-1]
        assert last_of_a == prompt(10) + expected_output(0, 10, 7)  # its 8th token drawn from the 7th
        pending = [c.seq_id for p in rank1.plans for c in p.cached_seqs if c.last_token_id == PENDING_TOKEN]
        assert pending.count(0) >= 6 and pending.count(1) >= 2  # planned ahead
        for worker in workers:
            assert not worker.failures
        harness.assert_nothing_held()
    finally:
        harness.close()


def test_a_rank_of_a_group_of_another_size_is_not_taken_on(redis_url, r):
    """A rank started with another --tensor-parallel-size than its scheduler's would wait for peers
    that never come: its hello is dropped, and the group forms only from ranks of the right size."""
    harness = Harness(redis_url, r, tensor_parallel_size=2)
    try:
        harness.worker(rank=0, world_size=2, rehello_s=0.2)
        stray = harness.worker(rank=1, world_size=3, rehello_s=0.2)
        harness.wait_until(lambda: stray.num_hellos >= 3, 3.0, "the stray rank to say hello again")
        assert harness.server.scheduler is None and sorted(harness.server.link.hellos) == [0]
        harness.worker(rank=1, world_size=2)
        harness.wait_ready()
        assert [h.world_size for h in harness.server.link.hellos.values()] == [2, 2]
    finally:
        harness.close()


def test_the_scheduler_follows_the_workers_block_size(harness):
    worker = harness.worker(block_size=32)
    harness.wait_ready()
    harness.submit("a", prompt(40), max_tokens=30)
    done = harness.wait_finished("a")
    assert tokens(done["a"]) == expected_output(0, 40, 30)
    assert done["a"][-1].finish_reason == "length"
    assert len(worker.plans[0].new_seqs[0].block_ids) == 2  # 40 tokens in blocks of 32
    harness.wait_until(lambda: harness.status().block_size == 32, 2.0, "the status to show blocks of 32")
    harness.assert_nothing_held()


def test_the_start_up_log_gives_the_pool_its_bytes_and_the_most_sequences_at_once(make_harness, caplog):
    """64 blocks of 16 (63 usable) for a context of 512 (32 blocks): 1.97x; a hybrid's KV cache
    groups (a global one and a window of 32 tokens) hold a 512-token sequence in 32 + 3 blocks: 1.80x."""
    caplog.set_level("INFO", logger="scheduler.server")
    uniform = make_harness()
    uniform.worker()
    uniform.wait_ready()
    assert ("workers ready: fake-model, 64 KV blocks of 16 tokens (1024 bytes each, 64 a token), context 512: at "
            "most 1.97x sequences of 512 tokens at once") in caplog.text
    uniform.stop_server()
    hybrid = make_harness(scheduler_id="hybrid")
    hybrid.worker(kv_groups=(0, 32))
    hybrid.wait_ready()
    assert ("workers ready: fake-model, 64 KV blocks of 16 tokens (1024 bytes each, 64 a token in each KV cache "
            "group), context 512: at most 1.80x sequences of 512 tokens at once; KV cache groups [0, 32] (each "
            "one's window, 0: global)") in caplog.text


# ----------------------------------------------------------------------------- aborts


def test_an_abort_while_running_ends_the_request_and_frees_its_blocks(harness):
    worker = harness.worker(step_delay_s=0.01)
    harness.wait_ready()
    harness.submit("a", prompt(30), max_tokens=300)
    harness.wait_until(lambda: len(tokens(harness.events.get("a", []))) >= 3, 5.0, "a's first tokens")
    harness.abort("a")
    events = harness.wait_finished("a")["a"]

    assert events[-1].finish_reason == "abort" and events[-1].token_ids == [] and events[-1].error is None
    got = tokens(events)
    assert 3 <= len(got) < 300
    assert got == expected_output(0, 30, len(got))
    harness.assert_nothing_held()
    bm = harness.server.scheduler.block_manager
    # the abort's event is written as the abort is read, and the blocks freed just after, in the server's thread
    harness.wait_until(lambda: bm.num_free_blocks == bm.num_total_blocks, 5.0, "a's blocks freed")
    assert bm.num_total_blocks == NUM_BLOCKS - 1
    assert not harness.server.scheduler.has_unfinished_requests()

    # the next plan tells the worker to drop the aborted sequence (its blocks are reused)
    harness.submit("b", prompt(30), max_tokens=4)
    done = harness.wait_finished("b")
    assert tokens(done["b"]) == expected_output(1, 30, 4)
    first_plan_of_b = next(p for p in worker.plans if any(s.seq_id == 1 for s in p.new_seqs))
    assert first_plan_of_b.finished_seq_ids == [0]
    harness.assert_nothing_held()


def test_an_abort_that_arrives_before_its_request_ends_it_unrun(harness):
    worker = harness.worker()
    harness.wait_ready()
    harness.abort("early")
    harness.wait_until(lambda: "early" in harness.server.stream.early_aborts, 3.0, "the abort to be read")
    harness.submit("early", prompt(10), max_tokens=5)
    events = harness.wait_finished("early")["early"]

    assert [(e.token_ids, e.finish_reason, e.error) for e in events] == [([], "abort", None)]
    harness.assert_nothing_held()
    assert worker.plans == []  # it never ran
    assert "early" not in harness.server.stream.early_aborts

    harness.submit("next", prompt(10), max_tokens=3)  # the scheduler serves on
    assert tokens(harness.wait_finished("next")["next"]) == expected_output(0, 10, 3)


def test_an_early_abort_outlives_the_gateways_wait_for_its_request():
    from common.config import GatewayConfig

    # else a request queued in Redis longer than the abort is kept would run for nobody
    assert inbox.EARLY_ABORT_TTL_S > GatewayConfig().request_timeout_s


def test_an_abort_for_an_unknown_or_finished_request_changes_nothing(harness):
    harness.worker()
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=3)
    harness.wait_finished("a")
    harness.abort("a")  # already ended
    harness.abort("never-seen")
    harness.submit("b", prompt(10), max_tokens=3)
    done = harness.wait_finished("b")
    assert tokens(done["b"]) == expected_output(1, 10, 3)
    assert len(harness.events["a"]) == 3  # nothing after its last event
    harness.assert_nothing_held()


# ----------------------------------------------------------------------------- bad requests


def test_a_request_too_long_for_the_context_gets_one_error_event(harness):
    worker = harness.worker()
    harness.wait_ready()
    harness.submit("long", prompt(500), max_tokens=100)
    events = harness.wait_finished("long")["long"]

    assert len(events) == 1
    event = events[0]
    assert (event.token_ids, event.finish_reason) == ([], "error")
    assert event.error == ("this model's maximum context length is 512 tokens, but the request needs 600 (500 in the "
                           "prompt, 100 for the completion); shorten the prompt or lower max_tokens")
    harness.assert_nothing_held()
    assert worker.plans == []

    harness.submit("fits", prompt(500), max_tokens=12)  # exactly the context
    done = harness.wait_finished("fits")
    assert tokens(done["fits"]) == expected_output(0, 500, 12)
    assert done["fits"][-1].finish_reason == "length"


def test_malformed_entries_are_dropped_and_acked_and_serving_goes_on(harness):
    harness.worker()
    harness.wait_ready()
    r = harness.r
    r.xadd(streams.REQUESTS, {streams.FIELD: b"\xc1\x00garbage"})
    r.xadd(streams.REQUESTS, {streams.FIELD: encode(SamplingParams())})  # a message, not a request
    r.xadd(streams.REQUESTS, {streams.FIELD: encode(RequestEvent("x", [1], None))})
    r.xadd(streams.REQUESTS, {b"other": b"no message field"})
    r.xadd(streams.REQUESTS, {streams.FIELD: b"\x92\x07\xc0"})  # msgpack [7, nil]: an unknown version
    harness.submit("ok", prompt(10), max_tokens=4)
    done = harness.wait_finished("ok")

    assert tokens(done["ok"]) == expected_output(0, 10, 4)
    assert list(harness.events) == ["ok"]  # the dropped entries had no reply stream to answer on
    harness.assert_nothing_held()


def test_a_request_with_fields_of_the_wrong_type_gets_an_error_or_is_dropped(harness):
    """Badly typed fields must not reach the scheduler or a worker: with an address to answer on,
    one error event; without, dropped. Either way acked, and serving goes on."""
    worker = harness.worker()
    harness.wait_ready()
    params = SamplingParams(max_tokens=3)
    answered = {
        "bad-params": GenerateRequest("bad-params", prompt(10), None, REPLIES, time.time()),
        "bad-prompt": GenerateRequest("bad-prompt", 5, params, REPLIES, time.time()),
        "bad-tokens": GenerateRequest("bad-tokens", ["x", None], params, REPLIES, time.time()),
        "bad-floats": GenerateRequest("bad-floats", [1.0, 2.0], params, REPLIES, time.time()),
        "bad-vocab": GenerateRequest("bad-vocab", [5, 1024], params, REPLIES, time.time()),  # vocab_size 1024
    }
    dropped = [
        GenerateRequest(7, prompt(10), params, REPLIES, time.time()),
        GenerateRequest(["unhashable"], prompt(10), params, REPLIES, time.time()),
        GenerateRequest("bad-reply", prompt(10), params, None, time.time()),
    ]
    for request in [*answered.values(), *dropped]:
        harness.r.xadd(streams.REQUESTS, {streams.FIELD: encode(request)})
    harness.submit("ok", prompt(10), max_tokens=4)
    done = harness.wait_finished("ok", *answered)

    assert tokens(done["ok"]) == expected_output(0, 10, 4)
    assert set(harness.events) == {"ok", *answered}
    for request_id in answered:
        [event] = done[request_id]
        assert (event.token_ids, event.finish_reason) == ([], "error")
        assert event.error.startswith("invalid request: ")
    assert "[0, 1024)" in done["bad-vocab"][0].error
    assert [s.prompt_token_ids for p in worker.plans for s in p.new_seqs] == [prompt(10)]
    harness.assert_nothing_held()


def test_a_duplicate_request_id_in_flight_is_dropped(harness):
    harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=100)
    harness.wait_until(lambda: "a" in harness.events, 3.0, "a to start")
    harness.submit("a", prompt(10, start=300), max_tokens=100)
    done = harness.wait_finished("a")
    assert tokens(done["a"]) == expected_output(0, 10, 100)
    harness.poll_events(block_ms=200)
    assert len(harness.events["a"]) == 100  # no second run, no second last event
    harness.assert_nothing_held()


def test_two_entries_of_one_request_read_together_run_it_once(harness):
    """A gateway queued a request again after a Redis restart that had kept it after all: both
    entries come in one read, the second is acknowledged and dropped, with no error event."""
    harness.submit("b", prompt(10), max_tokens=5)
    harness.submit("b", prompt(10), max_tokens=5)  # queued before any worker: read in one batch
    harness.worker()
    done = harness.wait_finished("b")
    assert tokens(done["b"]) == expected_output(0, 10, 5) and all(e.error is None for e in done["b"])
    harness.poll_events(block_ms=200)
    assert len(harness.events["b"]) == 5
    harness.assert_nothing_held()


# ----------------------------------------------------------------------------- a request that breaks the scheduler


def test_a_request_whose_update_raises_fails_alone_and_the_others_are_served(harness, monkeypatch):
    append = Scheduler._append

    def append_or_raise(self, group, *args, **kwargs):  # a bug that only this request meets
        if group.request_id == "bad" and len(group.seqs[0].output_token_ids) == 3:
            raise ZeroDivisionError("float division by zero")
        return append(self, group, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_append", append_or_raise)
    worker = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=30)
    harness.submit("bad", prompt(12, start=300), max_tokens=30)
    harness.submit("b", prompt(14, start=500), max_tokens=30)
    done = harness.wait_finished("a", "bad", "b")

    assert tokens(done["a"]) == expected_output(0, 10, 30)
    assert tokens(done["b"]) == expected_output(2, 14, 30)
    assert [(e.token_ids, e.finish_reason) for e in done["bad"]] == [
        ([t], None) for t in expected_output(1, 12, 3)] + [([], "error")]
    assert done["bad"][-1].error == "the scheduler failed on this request: ZeroDivisionError: float division by zero"
    assert harness.server.scheduler is not None and worker.num_hellos == 1  # the group was kept
    harness.assert_nothing_held()
    bm = harness.server.scheduler.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS - 1  # the failed request's blocks were freed
    harness.submit("c", prompt(10), max_tokens=4)
    assert tokens(harness.wait_finished("c")["c"]) == expected_output(3, 10, 4)


def test_a_request_whose_scheduling_raises_fails_alone_and_the_others_are_served(harness, monkeypatch):
    add_to_plan = Scheduler._add_to_plan

    def add_or_raise(self, seqs, *args, **kwargs):  # after its blocks were allocated
        if seqs[0].prompt_token_ids[0] == 300:
            raise KeyError("no such block")
        return add_to_plan(self, seqs, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_add_to_plan", add_or_raise)
    worker = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=20)
    harness.submit("bad", prompt(40, start=300), max_tokens=20)
    harness.submit("b", prompt(14, start=500), max_tokens=20)
    done = harness.wait_finished("a", "bad", "b")

    assert [(e.token_ids, e.finish_reason, e.error) for e in done["bad"]] == [
        ([], "error", "the scheduler failed on this request: KeyError: 'no such block'")]
    assert tokens(done["a"]) == expected_output(0, 10, 20)
    assert tokens(done["b"]) == expected_output(2, 14, 20)
    assert all(s.prompt_token_ids[0] != 300 for p in worker.plans for s in p.new_seqs)  # never sent
    harness.assert_nothing_held()
    assert harness.server.scheduler.block_manager.num_free_blocks == NUM_BLOCKS - 1


# ----------------------------------------------------------------------------- worker failures


def test_a_hung_worker_fails_the_requests_in_flight_and_a_new_worker_takes_over(harness):
    old = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=400)
    harness.submit("b", prompt(20), max_tokens=400)
    harness.wait_until(lambda: "a" in harness.events and "b" in harness.events, 3.0, "a and b to start")
    old.mode = "hang"
    took = harness.wait_until(lambda: harness.finished("a") and harness.finished("b"), 4.0, "a and b to fail")
    assert took < 2.0  # the step timeout is 1 s

    for request_id in ("a", "b"):
        last = harness.events[request_id][-1]
        assert (last.token_ids, last.finish_reason) == ([], "error")
        assert "no result within 1 s" in last.error
        assert len(tokens(harness.events[request_id])) < 400
    harness.assert_nothing_held()
    harness.wait_until(lambda: not harness.status().workers_ready, 2.0, "the status to say no workers")

    new = harness.worker()
    harness.wait_ready()
    harness.wait_until(lambda: harness.status().workers_ready, 2.0, "the status to say workers ready")
    harness.submit("c", prompt(10), max_tokens=5)
    done = harness.wait_finished("c")
    assert tokens(done["c"]) == expected_output(0, 10, 5)  # a new scheduler: sequence ids start over
    assert done["c"][-1].finish_reason == "length"
    assert {p.epoch for p in new.plans}.isdisjoint({p.epoch for p in old.plans})
    assert len({p.epoch for p in new.plans}) == 1
    harness.assert_nothing_held()


def test_a_worker_error_fails_the_requests_in_flight_and_service_resumes_after_its_hello(harness):
    worker = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=400)
    harness.submit("b", prompt(20), max_tokens=400)
    harness.wait_until(lambda: "a" in harness.events and "b" in harness.events, 3.0, "a and b to start")
    hellos = worker.num_hellos
    worker.mode = "boom"
    harness.wait_finished("a", "b", timeout=2.0)

    for request_id in ("a", "b"):
        last = harness.events[request_id][-1]
        assert (last.token_ids, last.finish_reason) == ([], "error")
        assert "boom" in last.error
    harness.assert_nothing_held()
    old_epochs = {p.epoch for p in worker.plans}

    harness.submit("c", prompt(10), max_tokens=5)  # waits in Redis until the worker says hello again
    done = harness.wait_finished("c", timeout=5.0)
    assert worker.num_hellos > hellos
    assert tokens(done["c"]) == expected_output(0, 10, 5)
    new_epochs = {p.epoch for p in worker.plans} - old_epochs
    assert len(new_epochs) == 1
    harness.assert_nothing_held()


def test_a_failed_group_leaves_the_requests_not_started_to_be_taken_over(make_harness):
    """Only what has streamed fails with the group: a request that waited in the scheduler stays
    pending in Redis and is taken over (here by the same scheduler once its worker is back), from
    the start, with its full text."""
    harness = make_harness(serving={"claim_idle_ms": 500, "claim_interval_s": 0.2}, max_num_seqs=1)
    worker = harness.worker(step_delay_s=0.005, rehello_s=0.3)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=400)
    harness.wait_until(lambda: "a" in harness.events, 3.0, "a to start")
    harness.submit("b", prompt(20, start=500), max_tokens=5)  # waits: one sequence at a time
    harness.wait_until(lambda: len(harness.server.scheduler.waiting) == 1, 3.0, "b to wait in the scheduler")
    group = harness.server.scheduler
    worker.mode = "boom"
    harness.wait_finished("a", timeout=2.0)
    last = harness.events["a"][-1]
    assert (last.finish_reason, last.error) == ("error", "the worker failed: boom")
    assert "b" not in harness.events and harness.num_pending() == 1  # released, not failed
    done = harness.wait_finished("b", timeout=5.0)
    assert harness.server.scheduler is not group
    assert tokens(done["b"]) == expected_output(0, 20, 5)  # the new group's first sequence
    assert [e.error for e in done["b"]] == [None] * 5
    harness.assert_nothing_held()


def test_a_worker_that_exits_mid_step_and_restarts_takes_over(harness):
    old = harness.worker(step_delay_s=0.005)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=400)
    harness.wait_until(lambda: "a" in harness.events, 3.0, "a to start")
    old.mode = "exit"
    old.thread.join(2)
    group = harness.server.scheduler
    new = harness.worker()  # the restarted rank: a new connection, the same hello
    events = harness.wait_finished("a", timeout=3.0)["a"]
    assert (events[-1].finish_reason, events[-1].token_ids) == ("error", [])
    # its connection closed: noticed at once, before the new rank's hello
    assert events[-1].error == "the worker failed: worker rank 0 disconnected (exited, was killed or stopped answering)"
    harness.assert_nothing_held()
    took = harness.wait_until(lambda: harness.server.scheduler not in (None, group), 5.0, "a new group")
    assert took < 1.0 and new.num_hellos == 1  # on its first hello, not on a keep-alive 2 s later

    harness.submit("b", prompt(10), max_tokens=5)
    done = harness.wait_finished("b", timeout=5.0)
    assert tokens(done["b"]) == expected_output(0, 10, 5)
    harness.assert_nothing_held()


def test_a_worker_restarted_while_idle_is_taken_on(harness):
    old = harness.worker()
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=3)
    harness.wait_finished("a")
    group = harness.server.scheduler
    old.mode = "exit"
    old.thread.join(2)
    new = harness.worker()  # a new connection, the same hello
    took = harness.wait_until(lambda: harness.server.scheduler not in (None, group), 5.0, "a new group")
    assert took < 1.0  # on its first hello, not on a keep-alive 2 s later
    harness.submit("b", prompt(10), max_tokens=5)
    done = harness.wait_finished("b", timeout=5.0)
    assert tokens(done["b"]) == expected_output(0, 10, 5)  # a new group: a new scheduler
    assert new.plans and {p.epoch for p in new.plans}.isdisjoint({p.epoch for p in old.plans})
    harness.assert_nothing_held()


def test_a_worker_silent_while_idle_is_given_up(make_harness):
    harness = make_harness(serving={"worker_silence_s": 1.5})
    worker = harness.worker(rehello_s=0.3)
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=3)
    harness.wait_finished("a")
    time.sleep(2.0)  # longer than the silence limit: its hellos keep it on
    assert harness.status().workers_ready and harness.server.scheduler is not None

    worker.mode = "hang"
    took = harness.wait_until(lambda: not harness.status().workers_ready, 4.0, "the status to say no workers")
    assert took < 3.0
    assert harness.server.scheduler is None

    worker.mode = "serve"  # it speaks again: its next hello brings the group back
    harness.wait_until(lambda: harness.status().workers_ready, 3.0, "the status to say workers ready")
    harness.submit("b", prompt(10), max_tokens=3)
    assert tokens(harness.wait_finished("b")["b"]) == expected_output(0, 10, 3)


# ----------------------------------------------------------------------------- shutdown


def test_stopping_the_server_ends_the_requests_in_flight_and_removes_its_status(harness):
    harness.worker(step_delay_s=0.01)
    harness.wait_ready()
    harness.wait_until(lambda: harness.status() is not None, 2.0, "a status")
    harness.submit("a", prompt(10), max_tokens=400)
    harness.submit("b", prompt(20), max_tokens=400)
    harness.wait_until(lambda: "a" in harness.events and "b" in harness.events, 3.0, "a and b to start")
    harness.stop_server()
    done = harness.wait_finished("a", "b", timeout=1.0)

    for events in done.values():
        assert (events[-1].token_ids, events[-1].finish_reason) == ([], "error")
        assert "shutting down" in events[-1].error
        assert len(tokens(events)) < 400
    assert harness.r.exists(streams.status_key(SCHEDULER_ID)) == 0
    harness.assert_nothing_held()


# ----------------------------------------------------------------------------- takeover and drain


def read_as_dead_scheduler(r: redis.Redis, count: int) -> list[bytes]:
    """A scheduler that read `count` requests and died: they stay pending under its name."""
    replies = r.xreadgroup(streams.SCHEDULER_GROUP, "dead-scheduler", {streams.REQUESTS: ">"}, count=count)
    return [entry_id for _, entries in replies for entry_id, _ in entries]


def successor(redis_url: str, r: redis.Redis, claim_idle_ms: int, **engine) -> Harness:
    """A scheduler that takes over entries idle `claim_idle_ms`, started on a group that exists."""
    r.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
    return Harness(redis_url, r, serving={"claim_idle_ms": claim_idle_ms, "claim_interval_s": 0.2}, **engine)


def test_a_dead_schedulers_requests_are_taken_over_and_a_started_one_is_not_repeated(redis_url, r):
    h = successor(redis_url, r, claim_idle_ms=300)
    try:
        h.submit("fresh", prompt(10), max_tokens=4)
        h.submit("streamed", prompt(12), max_tokens=4)
        deleted = h.submit("deleted", prompt(14), max_tokens=4)
        assert len(read_as_dead_scheduler(r, 3)) == 3
        r.xdel(streams.REQUESTS, deleted)  # pending, but gone from the stream: acknowledged, not a crash
        r.hset(streams.STARTED, "streamed", "dead-scheduler")  # it had sent tokens before dying
        h.worker()
        done = h.wait_finished("fresh", "streamed", timeout=5.0)
        assert tokens(done["fresh"]) == expected_output(0, 10, 4)
        assert done["fresh"][-1].finish_reason == "length"
        assert [(e.token_ids, e.finish_reason, e.error) for e in done["streamed"]] == [
            ([], "error", "the scheduler serving this request stopped after it had started streaming")]
        h.assert_nothing_held()
        assert r.hlen(streams.STARTED) == 0
        # the dead scheduler's consumer left the group once its entries were taken over
        h.wait_until(lambda: [c["name"] for c in r.xinfo_consumers(streams.REQUESTS, streams.SCHEDULER_GROUP)]
                     == [SCHEDULER_ID.encode()], 2.0, "the dead consumer to be deleted")
        assert r.xinfo_consumers(streams.REQUESTS, streams.SCHEDULER_GROUP)[0]["pending"] == 0
    finally:
        h.close()


def test_a_dead_schedulers_requests_come_before_newer_ones_under_full_load(redis_url, r):
    """Orphans found while the scheduler is full take the next free room; no newer request is read
    meanwhile (they arrived first). Each request has its own prompt start: its sequence id, given at
    admission, tells the order."""
    r.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
    orphans = {f"orphan-{i}": 100 + 20 * i for i in range(2)}
    fresh = {f"fresh-{i}": 200 + 20 * i for i in range(8)}
    for request_id, start in orphans.items():
        Harness.submit_to(r, request_id, prompt(10, start), max_tokens=4)
    assert len(read_as_dead_scheduler(r, 2)) == 2
    for request_id, start in fresh.items():
        Harness.submit_to(r, request_id, prompt(10, start), max_tokens=200)
    # two run and two wait at once, for 2 s or more each; the orphans are claimable after 1 s
    h = Harness(redis_url, r, serving={"claim_idle_ms": 1000, "claim_interval_s": 0.2}, max_num_seqs=2)
    try:
        worker = h.worker(step_delay_s=0.01)
        done = h.wait_finished(*orphans, timeout=15.0)
        seq_ids = {s.prompt_token_ids[0]: s.seq_id for p in worker.plans for s in p.new_seqs}
        orphan_seq_ids = [seq_ids[start] for start in orphans.values()]
        for (request_id, start), seq_id in zip(orphans.items(), orphan_seq_ids):
            assert tokens(done[request_id]) == expected_output(seq_id, 10, 4)
        admitted_before = [i for i, start in fresh.items() if seq_ids.get(start, 1 << 30) < min(orphan_seq_ids)]
        assert len(admitted_before) <= 4, admitted_before  # only those read before the orphans were found
        for request_id in fresh:
            h.abort(request_id)
        h.wait_finished(*fresh, timeout=5.0)
        assert {h.events[i][-1].finish_reason for i in fresh} <= {"length", "abort"}
        h.assert_nothing_held()
    finally:
        h.close()


def test_takeover_scans_past_live_schedulers_entries_to_the_orphans_behind_them(redis_url, r):
    """XAUTOCLAIM scans at most 10 x COUNT pending entries a call: resuming at its cursor (not at
    0-0) reaches orphans behind 50 entries a live scheduler keeps claiming, with room for one."""
    r.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
    for i in range(50):
        Harness.submit_to(r, f"live-{i}", prompt(4))
    live = r.xreadgroup(streams.SCHEDULER_GROUP, "live-scheduler", {streams.REQUESTS: ">"}, count=50)
    live_ids = [entry_id for _, entries in live for entry_id, _ in entries]
    for i in range(2):
        Harness.submit_to(r, f"orphan-{i}", prompt(4))
    assert len(read_as_dead_scheduler(r, 2)) == 2
    time.sleep(0.3)
    r.xclaim(streams.REQUESTS, streams.SCHEDULER_GROUP, "live-scheduler", 0, live_ids, justid=True)  # alive
    stream = request_stream.RequestStream(ServingConfig(redis_url=redis_url, claim_idle_ms=250), "survivor")
    stream.orphans = True  # as maintain() finds them
    calls, taken = 0, []
    while stream.orphans and calls < 20:
        taken += [a.request.request_id for a in stream.take_over(1)]
        calls += 1
    assert taken == ["orphan-0", "orphan-1"]
    assert calls == 7  # 5 scans of 10 live entries, then one orphan a call (the second call reaches the end)
    assert {p["consumer"] for p in r.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", 100)} == {
        b"live-scheduler", b"survivor"}
    stream.redis.close()


def test_a_request_whose_schedulers_keep_dying_is_not_tried_again(redis_url, r):
    h = successor(redis_url, r, claim_idle_ms=0)
    try:
        h.submit("poison", prompt(10), max_tokens=4)
        h.submit("fine", prompt(12), max_tokens=4)
        entry_ids = read_as_dead_scheduler(r, 2)
        for n in range(inbox.MAX_DELIVERIES):  # taken over, and dying, again and again
            r.xclaim(streams.REQUESTS, streams.SCHEDULER_GROUP, f"dead-{n}", 0, entry_ids[:1])
        h.worker()
        done = h.wait_finished("poison", "fine", timeout=5.0)
        assert [(e.token_ids, e.finish_reason) for e in done["poison"]] == [([], "error")]
        assert done["poison"][0].error == (
            f"the request was taken by {inbox.MAX_DELIVERIES} schedulers that each stopped; "
            "it is not tried again")
        assert tokens(done["fine"]) == expected_output(0, 12, 4)
        h.assert_nothing_held()
    finally:
        h.close()


def test_a_scheduler_that_stalled_drops_what_another_took_over(make_harness):
    harness = make_harness(serving={"claim_interval_s": 0.2})
    harness.worker(step_delay_s=0.01)
    harness.wait_ready()
    entry_id = harness.submit("stolen", prompt(10), max_tokens=400)
    harness.wait_until(lambda: "stolen" in harness.events, 3.0, "stolen to start")
    harness.r.xclaim(streams.REQUESTS, streams.SCHEDULER_GROUP, "other-scheduler", 0, [entry_id])  # as XAUTOCLAIM
    harness.wait_until(lambda: "stolen" not in harness.server.stream.tracked, 3.0, "the request to be dropped here")
    harness.wait_until(lambda: harness.status().num_running == 0, 3.0, "its blocks to be freed")
    sent = len(harness.events["stolen"])
    time.sleep(0.5)
    harness.poll_events()
    assert len(harness.events["stolen"]) == sent and not harness.finished("stolen")  # no word: the other's now
    pending = harness.r.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry_id, b"other-scheduler")]
    harness.r.xack(streams.REQUESTS, streams.SCHEDULER_GROUP, entry_id)
    harness.r.xdel(streams.REQUESTS, entry_id)


def test_a_live_scheduler_renews_its_claims_so_no_one_takes_its_requests(make_harness):
    harness = make_harness(serving={"claim_interval_s": 0.2})
    harness.worker(step_delay_s=0.01)
    harness.wait_ready()
    harness.submit("long", prompt(10), max_tokens=300)
    harness.wait_until(lambda: "long" in harness.events, 3.0, "long to start")
    assert harness.r.hget(streams.STARTED, "long") == SCHEDULER_ID.encode()
    idle = []
    for _ in range(10):
        time.sleep(0.2)
        idle += [e["time_since_delivered"] for e in harness.r.xpending_range(
            streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", 10)]
    assert idle and max(idle) < 1000  # XAUTOCLAIM by another scheduler takes entries idle >= CLAIM_IDLE_MS
    harness.wait_finished("long", timeout=10.0)
    assert harness.r.hlen(streams.STARTED) == 0


def test_drain_finishes_running_requests_and_hands_back_those_not_started(redis_url, r):
    h = Harness(redis_url, r, max_num_seqs=1)
    h.worker(step_delay_s=0.01)
    h.wait_ready()
    h.submit("running", prompt(10), max_tokens=30)
    h.wait_until(lambda: "running" in h.events, 3.0, "running to start")
    h.submit("queued", prompt(12), max_tokens=5)
    h.wait_until(lambda: h.num_pending() == 2, 2.0, "queued to be read")
    h.server.drain(timeout_s=10.0)
    h.thread.join(5)
    assert not h.thread.is_alive(), "the drained server did not stop"
    done = h.wait_finished("running")
    assert tokens(done["running"]) == expected_output(0, 10, 30)  # finished, not cut short
    # handed back unanswered, as a new entry (not a pending one, whose takeover would count a delivery)
    assert "queued" not in h.events and h.num_pending() == 0 and r.xlen(streams.REQUESTS) == 1
    assert r.exists(streams.status_key(SCHEDULER_ID)) == 0
    h.close()

    next_scheduler = Harness(redis_url, r, scheduler_id="successor")
    try:
        next_scheduler.worker()
        next_scheduler.cursor = h.cursor
        done = next_scheduler.wait_finished("queued", timeout=3.0)  # read at once, not taken over
        assert tokens(done["queued"]) == expected_output(0, 12, 5)
        next_scheduler.assert_nothing_held()
    finally:
        next_scheduler.close()


def test_drain_ends_what_cannot_finish_in_time_with_an_error(harness):
    harness.worker(step_delay_s=0.01)
    harness.wait_ready()
    harness.submit("long", prompt(10), max_tokens=400)
    harness.wait_until(lambda: "long" in harness.events, 3.0, "long to start")
    assert harness.status().draining is False
    harness.server.drain(timeout_s=0.5)
    harness.wait_until(lambda: harness.status().draining, 0.4, "the status to say draining (routers pass it over)")
    harness.thread.join(5)
    assert not harness.thread.is_alive()
    events = harness.wait_finished("long")["long"]
    assert (events[-1].finish_reason, events[-1].error) == ("error", "the scheduler is shutting down")
    assert 0 < len(tokens(events)) < 400
    harness.assert_nothing_held()


# ----------------------------------------------------------------------------- redis


def test_the_scheduler_recreates_its_group_when_redis_lost_it(harness):
    """A redis-server restarted without persistence (as `pagoda up` runs it) has no consumer group."""
    harness.worker()
    harness.wait_ready()
    harness.submit("a", prompt(10), max_tokens=3)
    harness.wait_finished("a")
    harness.r.flushdb()
    harness.cursor = b"0-0"
    harness.submit("b", prompt(10), max_tokens=3)
    done = harness.wait_finished("b", timeout=5.0)
    assert tokens(done["b"]) == expected_output(1, 10, 3)
    harness.assert_nothing_held()


def test_the_scheduler_rides_out_a_redis_restart_and_keeps_its_workers():
    port = stable_port()  # restarted on it
    redis_server = RedisServer(port=port).start()
    client = redis.Redis.from_url(redis_server.url)
    h = Harness(redis_server.url, client)
    try:
        h.worker()
        h.wait_ready()
        h.submit("a", prompt(10), max_tokens=3)
        h.wait_finished("a")
        group = h.server.scheduler
        redis_server.stop()
        time.sleep(1.5)
        redis_server = RedisServer(port=port).start()  # empty: no stream, no group, no status
        h.cursor = b"0-0"
        h.submit("b", prompt(10), max_tokens=3)
        done = h.wait_finished("b", timeout=8.0)
        assert tokens(done["b"]) == expected_output(1, 10, 3)
        assert h.server.scheduler is group  # the workers were kept
        h.assert_nothing_held()
        h.wait_until(lambda: h.status() is not None and h.status().workers_ready, 2.0, "the status again")
    finally:
        h.close()
        client.close()
        redis_server.stop()


def test_after_a_redis_restart_the_scheduler_says_which_requests_it_holds_and_finishes_them():
    """The gateway fails only requests no scheduler holds: this one names the two it holds (one
    running, one waiting), then streams both to their end through the new Redis."""
    port = stable_port()  # restarted on it
    redis_server = RedisServer(port=port).start()
    client = redis.Redis.from_url(redis_server.url)
    h = Harness(redis_server.url, client, max_num_seqs=1)
    try:
        h.worker(step_delay_s=0.01)
        h.wait_ready()
        h.submit("running", prompt(10), max_tokens=150)
        h.submit("waiting", prompt(12, start=300), max_tokens=5)
        h.wait_until(lambda: "running" in h.events and h.num_pending() == 2, 3.0, "both to be read")
        held_key = streams.held_key(SCHEDULER_ID)
        assert decode(client.get(held_key)) == HeldRequests(SCHEDULER_ID, [])  # said at its start
        redis_server.stop()
        time.sleep(0.5)
        redis_server = RedisServer(port=port).start()  # empty
        h.cursor = b"0-0"
        h.wait_until(lambda: client.get(held_key) is not None, 3.0, "the held requests to be published")
        assert decode(client.get(held_key)) == HeldRequests(SCHEDULER_ID, ["running", "waiting"])
        done = h.wait_finished("running", "waiting", timeout=10.0)
        assert done["running"][-1].finish_reason == "length"
        assert tokens(done["waiting"]) == expected_output(1, 12, 5)
        h.assert_nothing_held()
    finally:
        h.close()
        client.close()
        redis_server.stop()


def test_after_a_redis_restart_a_scheduler_says_it_holds_the_requests_whose_last_events_wait_in_its_outbox():
    """A request that ended while Redis was down has its last events in the outbox, not yet sent:
    the gateways must not fail it as lost (they would queue an error ahead of its real end)."""
    from scheduler.inbox import Arrival
    from scheduler.outbox import SendEvent
    from scheduler.request_stream import RequestStream

    server = RedisServer().start()
    try:
        rs = RequestStream(ServingConfig(redis_url=server.url), "scheduler-1")
        rs.track(Arrival(b"1-0", GenerateRequest("running-0", [1], SamplingParams(), "pagoda:replies:g", 0.0)))
        rs.publish_status(b"status")
        server.stop()
        rs.outbox.entries.append(SendEvent("pagoda:replies:g", RequestEvent("ended-0", [5], None, "length")))
        server.start()  # empty, a new run_id
        rs.publish_status(b"status")
        client = redis.Redis.from_url(server.url)
        assert decode(client.get(streams.held_key("scheduler-1"))) == HeldRequests("scheduler-1",
                                                                                  ["running-0", "ended-0"])
        client.close()
    finally:
        server.stop()


def test_prompt_logprobs_ride_on_the_requests_first_event_whichever_output_it_is(redis_url):
    """Output 1 has a token in the step that completes the prompt logprobs, output 0 none: output 1's
    event carries them, and no later event does (the gateway gives them to every choice)."""
    from scheduler.inbox import Arrival
    from scheduler.outbox import SendEvent
    from scheduler.request_stream import RequestStream
    from scheduler.sequence import RequestOutput, SequenceOutput

    rs = RequestStream(ServingConfig(redis_url=redis_url), "scheduler-1")
    rs.flush = lambda: None  # keep the outbox to read it
    rs.track(Arrival(b"1-0", GenerateRequest("r-0", [1, 2], SamplingParams(n=2, prompt_logprobs=0),
                                             "pagoda:replies:g", 0.0)))
    scored = [None, [-1.5, 3, []]]

    def step(tokens: dict[int, list[int]]) -> list:
        outputs = [SequenceOutput(i, t, len(t), 0.0, None, None) for i, t in tokens.items()]
        rs.emit([RequestOutput("r-0", [1, 2], outputs, False, 0.0, scored)])
        sent, rs.outbox.entries[:] = [e.event for e in rs.outbox.entries if isinstance(e, SendEvent)], []
        return [(e.index, e.token_ids, e.prompt_logprobs) for e in sent]

    assert step({0: [], 1: [7]}) == [(1, [7], scored)]
    assert step({0: [5], 1: [8]}) == [(0, [5], None), (1, [8], None)]


def test_kv_events_replay_into_the_schedulers_exact_set_of_cached_hashes(make_harness, r):
    """pagoda:kv-events:<engine id> (common/kv_events.py, vLLM's events and layout): a group's first
    batch clears, then come the prefix registry's stores and evictions; replayed, they equal the block
    manager's cached hashes exactly, through evictions from a pool too small for the prompts and
    through a failed group, whose KV is gone (cleared) until its worker is back."""
    from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, replay

    h = make_harness(serving={"engine_id": "7"})
    worker = h.worker(step_delay_s=0.002)
    h.wait_ready()

    def batches():
        return [decode_batch(fields[streams.KV_EVENTS_FIELD]) for _, fields in r.xrange(streams.kv_events_stream("7"))]

    def replayed() -> set[bytes]:
        return replay([event for batch in batches() for event in batch.events])

    prompts = [prompt(400, start=100), prompt(400, start=500), [7] * 400, prompt(400, start=100)]
    for i, ids in enumerate(prompts):  # 3 x 25 full blocks > 63: the first prompt's are evicted
        h.submit(f"p{i}", ids, max_tokens=2)
        h.wait_finished(f"p{i}")
        bm = h.server.scheduler.block_manager
        h.wait_until(lambda: replayed() == set(bm.cached_blocks), 2.0, "the events to reach the registry")
    events = [event for batch in batches() for event in batch.events]
    assert {batch.data_parallel_rank for batch in batches()} == {7}  # vLLM's int rank: the engine id
    assert isinstance(events[0], AllBlocksCleared)
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)) > 0  # evictions were told
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert all(e.block_size == BLOCK_SIZE and e.medium == "GPU" and e.lora_id is None for e in stored)
    assert stored[0].parent_block_hash is None and stored[0].token_ids[:3] == [100, 101, 102]

    # a router that missed events (the cap trimmed them) asks for a snapshot: the stream's last
    # batch and the snapshot after it replay into the registry exactly
    r.xtrim(streams.kv_events_stream("7"), maxlen=1, approximate=False)
    r.set(streams.kv_resync_key("7"), b"1")
    h.wait_until(lambda: len(batches()) == 2 and not r.exists(streams.kv_resync_key("7")), 2.0, "the snapshot")
    assert isinstance(batches()[1].events[0], AllBlocksCleared) and replayed() == set(bm.cached_blocks)

    h.submit("long", prompt(40, start=900), max_tokens=400)
    h.wait_until(lambda: "long" in h.events, 3.0, "the long request to start")
    worker.mode = "boom"
    h.wait_finished("long", timeout=3.0)
    h.wait_until(lambda: h.server.scheduler is not None, 5.0, "the worker's new hello")
    h.submit("after", prompt(40, start=100), max_tokens=2)  # its prefix was cached before: not now
    done = h.wait_finished("after")
    bm = h.server.scheduler.block_manager
    h.wait_until(lambda: replayed() == set(bm.cached_blocks), 2.0, "the new group's events")
    assert len(bm.cached_blocks) == 2  # 39 tokens confirmed, then 1: the first 2 blocks of "after" alone
    assert tokens(done["after"]) == expected_output(0, 40, 2)  # the new group's scheduler numbers from 0
    h.assert_nothing_held()


def test_an_append_only_redis_killed_and_restarted_keeps_the_queue_and_what_each_scheduler_read():
    """pagoda up's private Redis: SIGKILLed (a crash), started again on its directory, it still holds
    every acknowledged entry and the consumer group's pending list: nothing queued is lost, and a
    request a scheduler had read is not delivered to another."""
    server = RedisServer(port=stable_port(), appendonly=True).start()
    client = redis.Redis.from_url(server.url)
    try:
        client.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
        ids = [client.xadd(streams.REQUESTS, {streams.FIELD: b"%d" % i}) for i in range(24)]
        client.xreadgroup(streams.SCHEDULER_GROUP, "scheduler-a", {streams.REQUESTS: ">"}, count=4)
        server.kill()
        server.start()
        assert [entry_id for entry_id, _ in client.xrange(streams.REQUESTS)] == ids
        assert client.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] == 4
        rest = client.xreadgroup(streams.SCHEDULER_GROUP, "scheduler-b", {streams.REQUESTS: ">"})
        assert [entry_id for entry_id, _ in rest[0][1]] == ids[4:]
    finally:
        client.close()
        server.stop()


def test_a_step_of_256_outputs_writes_one_entry_per_reply_stream(redis_url, r):
    """Batch 256 over two gateways: a decode step's flush is one XADD and one EXPIRE per reply
    stream, each entry holding that gateway's events in order; the step that starts the requests
    adds one HSET of their started marks, the step that ends them one XACK and one XDEL of their
    entries and one HDEL of the marks. Nothing else is written."""
    from scheduler.inbox import Arrival
    from scheduler.request_stream import RequestStream
    from scheduler.sequence import RequestOutput, SequenceOutput

    rs = RequestStream(ServingConfig(redis_url=redis_url), "scheduler-1")
    rs.ensure_group()
    gateways = [streams.reply_stream("g0"), streams.reply_stream("g1")]
    entry_ids = [r.xadd(streams.REQUESTS, {streams.FIELD: b"x"}) for _ in range(256)]
    r.xreadgroup(streams.SCHEDULER_GROUP, "scheduler-1", {streams.REQUESTS: ">"})
    for i, entry_id in enumerate(entry_ids):
        rs.track(Arrival(entry_id, GenerateRequest(f"r{i}", [1], SamplingParams(), gateways[i % 2], 0.0)))
    tokens: list[int] = []

    def step(finish: str | None = None) -> dict[str, int]:
        tokens.append(100 + len(tokens))
        outputs = [RequestOutput(f"r{i}", [1], [SequenceOutput(0, list(tokens), 1, 0.0, None, finish)],
                                 finish is not None) for i in range(256)]
        r.config_resetstat()
        rs.emit(outputs)
        stats = r.info("commandstats")
        return {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items() if name != "cmdstat_config"}

    assert step() == {"hset": 1, "xadd": 2, "expire": 2}  # the first token: the started marks
    assert step() == {"xadd": 2, "expire": 2}
    assert step("length") == {"xadd": 2, "expire": 2, "xack": 1, "xdel": 1, "hdel": 1}
    for g, gateway in enumerate(gateways):
        entries = [decode_events(fields[streams.FIELD]) for _, fields in r.xrange(gateway)]
        assert [[(e.request_id, e.token_ids, e.finish_reason, e.seq) for e in events] for events in entries] == [
            [(f"r{i}", [token], finish, seq) for i in range(g, 256, 2)]
            for seq, (token, finish) in enumerate([(100, None), (101, None), (102, "length")], 1)]
    assert r.hlen(streams.STARTED) == 0 and r.xlen(streams.REQUESTS) == 0
    assert r.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"] == 0 and rs.tracked == {}
    rs.redis.close()
