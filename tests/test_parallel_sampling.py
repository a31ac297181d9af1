"""Parallel sampling (n > 1 without best_of) as one sequence group: the samples fork from the
prompt's blocks copy-on-write, stream and finish each on its own, and a stop string the gateway
finds in one of them ends that sample alone (a per-sequence abort), online as offline.

Everything runs on a tiny random Llama on the CPU (fast): the offline engine, and an API request
through the real gateway, Redis, SchedulerServer and the worker's Executor behind ZeroMQ, all in
this process so the scheduler's block manager can be read exactly while the worker runs a step.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest
import redis
import uvicorn

from common import streams
from common.config import EngineConfig, GatewayConfig, ServingConfig
from common.protocol import GenerateRequest, SamplingParams, StepPlan, decode, decode_events, encode, sample_seed
from common.redis_server import RedisServer, free_port
from common.tokenizer import load_tokenizer
from common.transport import SchedulerLink
from gateway.app import create_app
from gateway.detokenizer import IncrementalDetokenizer
from pagoda.up import healthy
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from scheduler.server import SchedulerServer

BLOCK_SIZE = 8
MODEL = "SmolLM2-135M-Instruct"  # the gateway's tokenizer and name; the tiny Llama's vocabulary is its first 512 ids


@pytest.fixture(scope="module")
def tiny_dir(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from pagoda.offline import LLM

    return LLM(str(tiny_dir), skip_tokenizer_init=True, device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks=128,
               num_cpu_blocks=64)


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def assert_no_block_held(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    bm.check_integrity()
    assert not bm.block_tables and not bm.cpu_tables
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks


# ----------------------------------------------------------------------------- the scheduler, offline


def test_aborting_one_sample_frees_its_blocks_and_the_others_go_on(tiny_llm):
    tiny_llm.reset(async_scheduling=False)  # it schedules and updates by hand between engine steps
    scheduler, engine = tiny_llm.scheduler, tiny_llm.engine
    prompt = random_prompt(5, 2 * BLOCK_SIZE + 3)  # two full blocks and a partial one
    scheduler.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
    engine.step()  # the prompt, and the first token drawn 3 times: the samples fork
    group = scheduler.groups["r"]
    assert [(s.index, s.sampling_params.seed) for s in group.seqs] == [(i, sample_seed(11, i)) for i in range(3)]
    bm = scheduler.block_manager
    prompt_blocks = bm.block_table(group.seqs[0].seq_id)[:3]
    assert all(bm.block_table(s.seq_id)[:3] == prompt_blocks for s in group.seqs)
    assert [bm.ref_counts[b] for b in prompt_blocks] == [3, 3, 3]  # the partial block too, until written
    engine.step()
    aborted = group.seqs[1]
    assert scheduler.abort_sequence("r", 1) is False  # the request goes on
    assert aborted.status is SequenceStatus.FINISHED_ABORTED and aborted.seq_id not in bm.block_tables
    assert [bm.ref_counts[b] for b in prompt_blocks[:2]] == [2, 2]
    assert scheduler.abort_sequence("r", 1) is False and scheduler.abort_sequence("r", 9) is False  # no-ops
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == [aborted.seq_id]  # the workers drop it
    assert sorted(s.seq_id for s in plan.cached_seqs) == [group.seqs[0].seq_id, group.seqs[2].seq_id]
    scheduler.update(tiny_llm.executor.execute(decode(encode(plan))))
    done = {}
    while scheduler.has_unfinished_requests():
        for out in engine.step():
            done = {o.index: (len(o.token_ids), o.finish_reason) for o in out.outputs}
    assert done == {0: (6, "length"), 1: (2, "abort"), 2: (6, "length")}
    assert_no_block_held(scheduler)


def test_aborting_the_last_running_sample_ends_the_request(tiny_llm):
    tiny_llm.reset()
    scheduler, engine = tiny_llm.scheduler, tiny_llm.engine
    scheduler.add_request("r", random_prompt(6, 9), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8))
    engine.step()
    assert scheduler.abort_sequence("r", 0) is False
    assert scheduler.abort_sequence("r", 1) is True
    assert not scheduler.has_unfinished_requests() and scheduler.abort_sequence("r", 0) is False
    scheduler.schedule()
    assert_no_block_held(scheduler)


def test_a_best_of_request_has_no_sample_to_abort(tiny_llm):
    """Its outputs are chosen at the end, best first: an index names no running sample."""
    tiny_llm.reset()
    scheduler, engine = tiny_llm.scheduler, tiny_llm.engine
    scheduler.add_request("r", random_prompt(7, 9), SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=4))
    engine.step()
    assert scheduler.abort_sequence("r", 0) is False
    assert [s.status for s in scheduler.groups["r"].seqs] == [SequenceStatus.RUNNING] * 3
    scheduler.abort_request("r")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_sample_aborted_while_its_group_is_preempted_stays_out(tiny_llm, mode):
    """The group is preempted as one unit; a sample aborted meanwhile frees its swap blocks (or
    is simply left out of the recompute) and the others resume as they would have run."""
    prompt = random_prompt(8, BLOCK_SIZE + 4)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    tiny_llm.reset()
    alone = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs
    # the serial loop: the pool is sized so that it preempts the group; planning ahead, the
    # scheduler knows the first request ends at its max_tokens and the group waits a step instead
    tiny_llm.reset(num_gpu_blocks=21, num_cpu_blocks=32, preemption_mode=mode, async_scheduling=False)
    scheduler, engine = tiny_llm.scheduler, tiny_llm.engine
    scheduler.add_request("first", random_prompt(9, 20), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    scheduler.add_request("group", prompt, params)
    group = scheduler.groups["group"]
    preempted_queue = scheduler.swapped if mode == "swap" else scheduler.waiting
    outputs, aborted_while_preempted = {}, False
    while scheduler.has_unfinished_requests():
        if group in preempted_queue and len(group.seqs) == 3 and not aborted_while_preempted:
            cpu_free = scheduler.block_manager.num_free_cpu_blocks
            own = (len(scheduler.block_manager.cpu_tables[group.seqs[1].seq_id]) - 1) if mode == "swap" else 0
            assert scheduler.abort_sequence("group", 1) is False
            assert scheduler.block_manager.num_free_cpu_blocks == cpu_free + own  # all but the shared prompt block
            aborted_while_preempted = True
        for out in engine.step():
            if out.request_id == "group":
                outputs = {o.index: (list(o.token_ids), o.finish_reason) for o in out.outputs}
        scheduler.block_manager.check_integrity()
    assert aborted_while_preempted, "the group was never preempted: the pool is too large for this test"
    assert outputs[1][1] == "abort"
    assert [outputs[i] for i in (0, 2)] == [(alone[i].token_ids, "length") for i in (0, 2)]
    assert_no_block_held(scheduler)


# ----------------------------------------------------------------------------- through the API


@dataclass
class Observation:
    """The scheduler's view of the request while the worker ran one step (the scheduler waits)."""

    running: list[int]  # indexes of the group's running samples
    prompt_refs: list[int]  # reference counts of the prompt's full blocks
    shared: bool  # every running sample's table starts with the same prompt blocks
    copies: list[list[int]] = field(default_factory=list)  # the plan's copy-on-write pairs


class ObservedWorker:
    """worker/server.py's loop in a thread around the real Executor, reading the scheduler's block
    manager at each plan (the scheduler waits for the result meanwhile). Like a slow model, it
    holds a plan once sample `hold[0]` of a group has `hold[1]` tokens, until the gateway has sent
    the abort of that sample, so the abort reaches the scheduler while the others still run."""

    def __init__(self, executor, address: str, server: SchedulerServer, r: redis.Redis) -> None:
        self.executor = executor
        self.server = server
        self.r = r
        self.observations: list[Observation] = []
        self.hold: tuple[int, int] | None = None
        self.error: BaseException | None = None
        self._stop = False
        self.link = SchedulerLink(address)
        self.link.hello(executor.hello())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        epoch = None
        try:
            while not self._stop:
                plan = self.link.recv_plan(timeout_ms=50)
                if plan is None:
                    continue
                if plan.epoch != epoch:
                    self.executor.reset()
                    epoch = plan.epoch
                self._observe(plan)
                self.link.send_result(self.executor.execute(plan))
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.link.close()

    def _observe(self, plan: StepPlan) -> None:
        scheduler = self.server.scheduler
        for group in list(scheduler.groups.values()):
            running = [s for s in group.seqs if s.status is SequenceStatus.RUNNING]
            if len(group.seqs) < 2 or not running:
                continue
            bm = scheduler.block_manager
            num_full = len(group.prompt_token_ids) // bm.block_size
            tables = [bm.block_table(s.seq_id)[:num_full] for s in running]
            self.observations.append(Observation(
                sorted(s.index for s in running), [bm.ref_counts[b] for b in tables[0]],
                all(t == tables[0] for t in tables), [list(pair) for pair in plan.blocks_to_copy]))
            if self.hold is not None:
                index, num_tokens = self.hold
                (seq,) = [s for s in group.seqs if s.index == index]
                if len(seq.output_token_ids) >= num_tokens:
                    self._wait_for_abort(group.request_id, index)
                    self.hold = None

    def _wait_for_abort(self, request_id: str, index: int) -> None:
        wanted = {streams.ABORT_FIELD: request_id.encode(), streams.ABORT_INDEX_FIELD: str(index).encode()}
        deadline = time.monotonic() + 30
        while not any(fields == wanted for _, fields in self.r.xrange(streams.ABORTS)):
            assert time.monotonic() < deadline, f"no abort of output {index} of {request_id} within 30 s"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop = True
        self.thread.join(10)


@dataclass
class InProcessStack:
    server: SchedulerServer
    worker: ObservedWorker
    client: openai.OpenAI
    tokenizer: object
    errors: list = field(default_factory=list)


@pytest.fixture(scope="module")
def stack(tiny_dir):
    redis_server = RedisServer().start()
    # the serial loop: ObservedWorker reads the scheduler's state while it waits for the result
    config = EngineConfig(model=str(tiny_dir), device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks=64,
                          num_cpu_blocks=16, async_scheduling=False)
    from worker.executor import Executor

    executor = Executor(config)
    address = f"tcp://127.0.0.1:{free_port()}"
    server = SchedulerServer(config, ServingConfig(redis_url=redis_server.url, zmq_address=address,
                                                   step_timeout_s=60, scheduler_id="parallel-sampling"))
    errors = []

    def serve() -> None:
        try:
            server.serve_forever()
        except BaseException as exc:  # reported at teardown
            errors.append(exc)

    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()
    worker = ObservedWorker(executor, address, server, redis.Redis.from_url(redis_server.url))
    tokenizer = load_tokenizer("default")
    gateway_config = GatewayConfig(redis_url=redis_server.url, port=free_port(), request_timeout_s=120)
    app = create_app(gateway_config, tokenizer=tokenizer)
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=gateway_config.port, log_level="warning"))
    http_thread = threading.Thread(target=http.run, daemon=True)
    http_thread.start()
    deadline = time.monotonic() + 60
    # /health is 200 once the scheduler's status says its workers are ready (the gateway admits then)
    while not (http.started and healthy(f"http://127.0.0.1:{gateway_config.port}")):
        assert time.monotonic() < deadline and not errors, f"the stack did not start: {errors}"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_config.port}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    yield InProcessStack(server, worker, client, tokenizer, errors)
    http.should_exit = True
    http_thread.join(10)
    server.stopping = True
    server_thread.join(10)
    worker.stop()
    worker.r.close()
    redis_server.stop()
    assert errors == [] and worker.error is None


def detokenized(tokenizer, token_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    pieces = [detokenizer.add(t) for t in token_ids]
    pieces[-1] += detokenizer.flush()
    return pieces


def pick_stop(texts: list[str], index: int, pieces: list[str]) -> tuple[str, int]:
    """A stop string found only in sample `index`: the text of two of its tokens, the first of
    them at least 3 tokens in; returns it and how many tokens the sample has when it completes."""
    for j in range(3, len(pieces) - 12):
        stop = pieces[j] + pieces[j + 1]
        before = "".join(pieces[:j])
        if pieces[j] and len(stop.strip()) >= 2 and "\ufffd" not in stop and stop not in before + pieces[j] and all(
                stop not in text for i, text in enumerate(texts) if i != index):
            return stop, j + 2
    raise AssertionError("no stop string sets this sample apart: change the seed")


def test_an_api_request_with_n_4_is_one_group_sharing_the_prompt_and_one_sample_stops_alone(stack, tiny_llm):
    prompt = random_prompt(12, 2 * BLOCK_SIZE + 5)  # two full blocks and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    tiny_llm.reset()
    offline = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs  # the seed rule: the same samples
    tokenizer = stack.tokenizer
    pieces = [detokenized(tokenizer, s.token_ids) for s in offline]  # the text each token adds, as the gateway sees it
    texts = ["".join(p) for p in pieces]
    assert len(set(texts)) == 4
    stop, stop_tokens = pick_stop(texts, 2, pieces[2])
    stack.worker.observations.clear()
    stack.worker.hold = (2, stop_tokens)
    response = stack.client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=24, temperature=1.0, seed=1234, stop=[stop],
        extra_body={"ignore_eos": True})
    assert stack.worker.error is None and stack.errors == []
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [
        (i, texts[i][:texts[i].index(stop)] if i == 2 else texts[i], "stop" if i == 2 else "length")
        for i in range(4)]
    assert response.usage.completion_tokens == 3 * 24 + stop_tokens
    seen = stack.worker.observations
    # one group: after its prompt step, all four samples share the prompt's full blocks ...
    four = [o for o in seen if o.running == [0, 1, 2, 3]]
    assert four and all(o.prompt_refs == [4, 4] and o.shared for o in four)
    # ... and the partial one until each writes into it: three copies of that one block
    first_decode = four[0].copies
    assert len(first_decode) == 3 and len({src for src, _ in first_decode}) == 1
    # the stop string ends sample 2 alone: its blocks go, the others run on to max_tokens
    three = [o for o in seen if o.running == [0, 1, 3]]
    assert three and all(o.prompt_refs == [3, 3] and o.shared for o in three)
    assert seen.index(three[0]) > seen.index(four[-1])
    deadline = time.monotonic() + 10
    while stack.server.stream.tracked and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not stack.server.stream.tracked and not stack.server.scheduler.has_unfinished_requests()
    assert_no_block_held(stack.server.scheduler)


def test_an_abort_of_one_output_is_never_kept_for_a_request_not_yet_read(stack):
    """Unlike a whole-request abort (kept until its request arrives), an abort of one output is
    sent only after that output streamed: one for a request this scheduler does not hold is dropped."""
    r = stack.worker.r
    r.xadd(streams.ABORTS, {streams.ABORT_FIELD: b"later-0", streams.ABORT_INDEX_FIELD: b"0"})
    time.sleep(0.3)  # the scheduler reads the aborts stream between steps, and idles in 50 ms reads
    replies = streams.reply_stream("parallel-sampling-test")
    request = GenerateRequest("later-0", random_prompt(13, 5), SamplingParams(n=2, temperature=0, max_tokens=3),
                              replies, time.time())
    r.xadd(streams.REQUESTS, {streams.FIELD: encode(request)})
    events, cursor, deadline = [], b"0-0", time.monotonic() + 30
    while sum(e.finish_reason is not None for e in events) < 2:
        assert time.monotonic() < deadline, f"the request did not finish: {events}"
        for _, entries in r.xread({replies: cursor}, block=100) or []:
            for cursor, fields in entries:
                events += decode_events(fields[streams.FIELD])
    assert {(e.index, e.finish_reason) for e in events if e.finish_reason} == {(0, "length"), (1, "length")}
    assert sum(len(e.token_ids) for e in events) == 2 * 3
    assert "later-0" not in stack.server.stream.early_aborts
