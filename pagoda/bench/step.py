"""`pagoda bench step`: the host side of a decode step, through the real code, the GPU replaced by a sleep.

The real Scheduler plans each step in this process; the plan crosses as bytes (common.protocol
`encode`/`decode`) over a ZeroMQ socket to a worker process of its own (spawned, as when serving:
neither side waits for the other's GIL), where the real worker Executor applies it (PlanState),
builds the step's tensors (ModelRunner.prepare), "runs" the model and samples (Sampler); the result
crosses back as bytes and the Scheduler takes it (`update`). The worker times its parts and sends
them (msgpack) at the end of each row. Only the model's forward is replaced: it sleeps
`--simulated-forward-ms` on a simulated device (SimulatedForward: the call returns at once, the
step's tokens reach the host once the device is done with it, as on a GPU) and returns float32
logits [num_sampled, vocab] sliced from a preallocated random tensor, so it costs nothing itself. The
model is a one-layer dummy with the default model's vocabulary (49,152). The worker process runs
with the parent's OMP_NUM_THREADS and torch thread count.

With asynchronous scheduling (EngineConfig.async_scheduling, unless `--no-async-scheduling`) the
scheduler plans step N+1 while step N runs, one plan in flight ahead, and the worker launches N+1
before it finishes N (the device-side token feed); without it each step is schedule -> execute
-> update.

Each row: `batch` requests with distinct prompts of `context` tokens (ignore_eos, max_tokens past
the run) are prefilled untimed; from the first step in which every sequence decodes one token,
`--warmup-steps` steps run untimed, then `--steps` steps are measured. Its keys:

    batch, context, sampling, simulated_forward_ms   the workload (sampling: greedy or random)
    async_scheduling  whether plans were made one step ahead
    steps             steps measured
    decode_tokens     tokens the scheduler appended in them (batch x steps)
    step_ms           mean period between two results reaching the scheduler (the measured steps'
                      span over their count: with steps overlapped, results may come in pairs,
                      which a median of the periods would hide)
    host_ms           median over steps of the host work of a step: the sum of the parts below
    host_max_ms       the worst step's host work (a collection of the oldest generation lands in one)
    gc_freeze         whether each process froze its startup heap (common/gc_heap.py), as the servers do
    forward_ms        median of the simulated forward (device time; not host work)
    breakdown_ms      median of each part: schedule, encode_plan (scheduler process); decode_plan,
                      apply (PlanState), prepare, sampler, execute_other (the rest of
                      Executor.launch and finish: swaps, rows, results), encode_result (worker process);
                      decode_result, update (scheduler process)
    load_1m           the host's 1-minute load average when the row started (shared machines)

    pagoda bench step --output result.json   # OMP_NUM_THREADS=1 for the committed CPU figures
    pagoda bench step --profile-dir prof     # cProfile of the measured steps: one file per row and process
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import zmq

from common.config import EngineConfig
from common.gc_heap import freeze_startup_heap
from common.models import resolve_model
from common.protocol import SamplingParams, StepPlan, decode, encode
from pagoda.bench.common import command_words, header, names, numbers, write_result
from pagoda.bench.timing import median_ms
from scheduler.preemption import recurrent
from scheduler.scheduler import Scheduler

SAMPLINGS = ("greedy", "random")
SCHEDULER_PARTS = ("schedule", "encode_plan", "decode_result", "update")
WORKER_PARTS = ("decode_plan", "apply", "prepare", "sampler", "execute_other", "encode_result")
HOST_PARTS = ("schedule", "encode_plan", "decode_plan", "apply", "prepare", "sampler", "execute_other",
              "encode_result", "decode_result", "update")
RESULT_TIMEOUT_S = 120.0


def sampling_params(sampling: str, index: int, max_tokens: int) -> SamplingParams:
    """greedy, or random: temperature 0.8, top-p 0.95, top-k 50, penalties 0.5, a seed per request."""
    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if sampling == "random":
        return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.5, presence_penalty=0.5,
                              seed=index, max_tokens=max_tokens, ignore_eos=True)
    raise ValueError(f"unknown sampling {sampling!r}: expected one of {', '.join(SAMPLINGS)}")


def distinct_prompt(i: int, length: int, vocab_size: int) -> list[int]:
    """Request i's prompt of `length` token ids (no special ones): no two requests share a prefix."""
    return [(i * 7919 + j * 104729) % (vocab_size - 3) + 3 for j in range(length)]


@dataclass(frozen=True, slots=True)
class RowSpec:
    batch: int
    context: int
    sampling: str
    simulated_forward_ms: float
    steps: int = 30
    warmup_steps: int = 3
    async_scheduling: bool = True
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    device: str = "cpu"
    gc_freeze: bool = True  # each process freezes its startup heap, as the servers do

    @property
    def max_tokens(self) -> int:
        """Past the last measured step: chunked prefill lets the first sequences decode while the
        last ones prefill, for at most the steps the whole batch's prompts take."""
        prefill_steps = -(-self.batch * self.context // (self.max_num_batched_tokens - self.batch))
        return prefill_steps + self.warmup_steps + self.steps + 16


def dummy_model_config(directory: Path, max_positions: int) -> Path:
    """A one-layer, 8-wide Llama with the default model's vocabulary and EOS: cheap to build, and
    its KV pool holds batch x context tokens in a few hundred MiB at most."""
    config = json.loads(resolve_model("dummy:smollm2-135m.json").path.read_text())
    config.update(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=max_positions)
    path = directory / "bench-step-model.json"
    path.write_text(json.dumps(config))
    return path


def engine_config(spec: RowSpec, model_path: Path) -> EngineConfig:
    max_model_len = spec.context + spec.max_tokens
    blocks_per_seq = -(-max_model_len // spec.block_size)
    num_gpu_blocks = spec.batch * blocks_per_seq * 102 // 100 + 2  # the null block and the 1% watermark
    return EngineConfig(model=f"dummy:{model_path}", device=spec.device, dtype="float32", block_size=spec.block_size,
                        num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, max_num_seqs=spec.batch,
                        max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=max_model_len,
                        async_scheduling=spec.async_scheduling)


# ----------------------------------------------------------------------------- timing


class PartClock:
    """Seconds per step and part, written by one process (each has its own clock)."""

    def __init__(self) -> None:
        self.step = 0  # the step the worker is executing
        self.times: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, step: int, part: str, seconds: float) -> None:
        self.times[step][part] += seconds

    def timed(self, fn, part: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[self.step][part] += time.perf_counter() - start
        return call


class TimedProxy:
    """Stands in for one of the Executor's parts (its PlanState, its Sampler): every method called
    on it, and a call of it, runs the real one and is timed as `part`; other attributes pass through."""

    __slots__ = ("_target", "_clock", "_part")

    def __init__(self, target, clock: PartClock, part: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_clock", clock)
        object.__setattr__(self, "_part", part)

    def __getattr__(self, name: str):
        attr = getattr(self._target, name)
        return self._clock.timed(attr, self._part) if callable(attr) else attr

    def __setattr__(self, name: str, value) -> None:
        setattr(self._target, name, value)

    def __call__(self, *args, **kwargs):
        return self._clock.timed(self._target, self._part)(*args, **kwargs)


class SimulatedForward:
    """ModelRunner.forward's stand-in: a device that runs each forward for `simulated_forward_ms`,
    one after another, while the host goes on. A call returns at once float32 logits
    [num_sampled, vocab] (sliced from a preallocated random tensor, so they cost nothing) and
    queues the forward on the simulated device; the step's tokens reach the host (`wait`, before
    the executor's `finish`) once its forward is done there, as on a GPU."""

    def __init__(self, runner, max_rows: int, simulated_forward_ms: float, clock: PartClock, seed: int = 0) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        vocab_size = int(runner.hf_config.vocab_size)
        self.logits = torch.randn((max_rows, vocab_size), generator=generator).to(runner.device)
        self.checksum = float(self.logits.double().sum())
        self.seconds = simulated_forward_ms / 1e3
        self.clock = clock
        self.device_free_at = 0.0  # when the simulated device finishes what it was given
        self.done_at: dict[int, float] = {}  # step -> when its forward is done

    def __call__(self, step):
        start = time.perf_counter()
        self.device_free_at = max(start, self.device_free_at) + self.seconds
        self.done_at[self.clock.step] = self.device_free_at
        logits = self.logits[: step.logits_indices.shape[0]]
        self.clock.add(self.clock.step, "forward", time.perf_counter() - start)
        self.clock.add(self.clock.step, "device", self.seconds)
        return logits

    def ready_at(self, step: int) -> float:
        return self.done_at.get(step, 0.0)

    def wait(self, step: int) -> float:
        """Sleep until the step's forward is done; returns the seconds waited."""
        left = self.done_at.pop(step, 0.0) - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return max(left, 0.0)

    def check_untouched(self) -> None:
        """The same logits serve every step: a sampler that wrote into them would skew the run."""
        if float(self.logits.double().sum()) != self.checksum:
            raise RuntimeError("the sampler wrote into the model's logits in place: SimulatedForward must hand "
                               "out a fresh tensor each step (a copy, inside the simulated time)")


def instrument(executor, clock: PartClock, max_rows: int, simulated_forward_ms: float) -> None:
    """Time the Executor's parts and replace its model's forward (the hook this benchmark needs)."""
    runner = executor.runner
    runner.prepare = clock.timed(runner.prepare, "prepare")
    runner.forward = SimulatedForward(runner, max_rows, simulated_forward_ms, clock)
    executor.state = TimedProxy(executor.state, clock, "apply")
    executor.sampler = TimedProxy(executor.sampler, clock, "sampler")


# ----------------------------------------------------------------------------- the two processes
#
# One PAIR socket joins them (TCP on 127.0.0.1, as serving's default address), every message one
# multipart frame: a kind, then msgpack bytes (plans and results: common.protocol's, as over
# serving's sockets). Nothing is pickled but the worker process's start arguments.
#
#   scheduler -> worker: ROW {spec, model_path, profile_path}; MEASURE [first, stop]; PLAN plan; END; EXIT
#   worker -> scheduler: HELLO {pid, threads}; READY {blocks, ...}; RESULT result; TIMES {step: {part: s}}; ERROR text

HELLO, ROW, READY, MEASURE, PLAN, RESULT, END, TIMES, EXIT, ERROR = (
    b"hello", b"row", b"ready", b"measure", b"plan", b"result", b"end", b"times", b"exit", b"error")
STARTUP_TIMEOUT_S = 120.0  # the spawned interpreter imports torch
LIVENESS_POLL_MS = 1000  # how often a wait for the worker checks that its process is still alive
WORKER_LINGER_MS = 2000  # the worker's last message (its error) is delivered before it exits


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class WorkerSocket:
    """The scheduler's end of the worker's socket; `alive` tells whether the worker can still answer."""

    def __init__(self, socket: zmq.Socket, alive: Callable[[], bool] = lambda: True) -> None:
        self.socket = socket
        self.alive = alive

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        """A PAIR socket blocks a send while its peer is gone: wait for room, and surface the
        worker's error (sent before it exited) or its death instead of hanging."""
        while not self.socket.poll(LIVENESS_POLL_MS, zmq.POLLOUT):  # no peer: the worker is gone
            while self.socket.poll(0, zmq.POLLIN):  # what it sent before it went, its error last
                frames = self.socket.recv_multipart()
                if frames[0] == ERROR:
                    raise RuntimeError(f"the bench worker failed:\n{frames[-1].decode()}")
            if not self.alive():
                raise RuntimeError("the bench worker process exited")
        self.socket.send_multipart([kind, payload])

    def recv(self, expected: bytes, timeout_s: float = RESULT_TIMEOUT_S) -> bytes:
        """The payload of the worker's next message, which must be of kind `expected`; the worker's
        error, its process's death or the timeout is a RuntimeError."""
        deadline = time.monotonic() + timeout_s
        while not self.socket.poll(LIVENESS_POLL_MS):
            if not self.alive():
                raise RuntimeError("the bench worker process exited")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {expected.decode()} from the bench worker in {timeout_s:g} s")
        frames = self.socket.recv_multipart()
        if len(frames) != 2:
            raise RuntimeError(f"the bench worker sent {len(frames)} frames, expected a kind and a payload")
        kind, payload = frames
        if kind == ERROR:
            raise RuntimeError(f"the bench worker failed:\n{payload.decode()}")
        if kind != expected:
            raise RuntimeError(f"the bench worker sent {kind.decode()}, expected {expected.decode()}")
        return payload


class WorkerProcess:
    """The worker in a process of its own ("spawn": a fresh interpreter, as when serving), started
    once and running every row given to it; with the parent's torch thread count (its environment,
    OMP_NUM_THREADS included, is inherited). `setup` (picklable by reference) runs first in it:
    tests patch the worker's parts with it."""

    def __init__(self, torch_num_threads: int | None = None, setup: Callable[[], None] | None = None) -> None:
        socket = zmq.Context.instance().socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        self.process = multiprocessing.get_context("spawn").Process(
            target=worker_main, args=(f"tcp://127.0.0.1:{port}", torch_num_threads, setup),
            name="pagoda-bench-step-worker", daemon=True)
        self.socket = WorkerSocket(socket, self.process.is_alive)
        self.process.start()
        try:
            self.hello = unpack(self.socket.recv(HELLO, STARTUP_TIMEOUT_S))
            threads = (self.hello["omp_num_threads"], self.hello["torch_num_threads"])
            expected = (os.environ.get("OMP_NUM_THREADS"), torch_num_threads or threads[1])
            if threads != expected:
                raise RuntimeError(f"the bench worker runs with (OMP_NUM_THREADS, torch threads) {threads}, "
                                   f"not {expected}")
        except BaseException:
            self.close()
            raise

    def start_row(self, spec: RowSpec, model_path: Path, profile_path: str | None) -> dict:
        """Build the row's Executor there; returns what the scheduler needs of it (WorkerHello's fields)."""
        self.socket.send(ROW, pack({"spec": dataclasses.asdict(spec), "model_path": str(model_path),
                                    "profile_path": profile_path}))
        return unpack(self.socket.recv(READY))

    def end_row(self) -> dict[int, dict[str, float]]:
        """After the row's last result: the worker's seconds per step and part."""
        self.socket.send(END)
        return unpack(self.socket.recv(TIMES))

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.socket.socket.send_multipart([EXIT, b""], zmq.NOBLOCK)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.socket.socket.close(0)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def worker_main(address: str, torch_num_threads: int | None, setup: Callable[[], None] | None) -> None:
    """The worker process: one Executor per row, plans in and results out as bytes, as behind ZeroMQ."""
    if setup is not None:
        setup()
    import torch

    if torch_num_threads is not None:
        torch.set_num_threads(torch_num_threads)
    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.setsockopt(zmq.LINGER, WORKER_LINGER_MS)
    socket.connect(address)
    socket.send_multipart([HELLO, pack({"pid": os.getpid(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                        "torch_num_threads": torch.get_num_threads()})])
    try:
        while (frames := socket.recv_multipart())[0] == ROW:
            serve_row(socket, unpack(frames[1]))
        if frames[0] != EXIT:
            raise RuntimeError(f"the bench worker got {frames[0].decode()} between rows")
    except BaseException:  # noqa: BLE001 - the scheduler raises it; this process ends
        socket.send_multipart([ERROR, traceback.format_exc().encode()])
    finally:
        socket.close()


def serve_row(socket: zmq.Socket, row: dict) -> None:
    """Build the row's Executor, answer its plans until END, then send the part times."""
    from worker.executor import Executor

    spec = RowSpec(**row["spec"])
    executor = Executor(engine_config(spec, Path(row["model_path"])))
    clock = PartClock()
    instrument(executor, clock, spec.batch, spec.simulated_forward_ms)
    runner = executor.runner
    if spec.gc_freeze:
        freeze_startup_heap("bench worker")  # as worker/server.py does once its Executor is built
    try:
        socket.send_multipart([READY, pack({
            "num_gpu_blocks": runner.num_gpu_blocks, "max_model_len": runner.max_model_len,
            "eos_token_ids": executor.eos_token_ids, "vocab_size": int(runner.hf_config.vocab_size),
            # how its memory is paged (WorkerHello's): windows, KV cache groups, recurrent state
            "sliding_window": runner.sliding_window,
            "kv_groups": runner.kv_groups.hello if runner.kv_groups is not None else [],
            "recurrent_state": runner.recurrent is not None,
            "state_checkpoints": runner.recurrent.checkpoints if runner.recurrent is not None else 0})])
        server = RowServer(socket, executor, clock, profile=row["profile_path"] is not None)
        server.serve()
        runner.forward.check_untouched()
        if server.profiler is not None:
            server.profiler.dump_stats(row["profile_path"])
    finally:
        gc.unfreeze()  # the next row builds its own Executor: this one may go
    socket.send_multipart([TIMES, pack({step: dict(parts) for step, parts in clock.times.items()})])


class RowServer:
    """The worker side of one row: plans in as bytes, results out as bytes, until END. As the
    worker process serves (worker/server.py), each plan is launched behind the step in flight
    (fed its tokens on the device) and a step's result is sent once the next plan is launched or
    its forward is done on the simulated device."""

    def __init__(self, socket: zmq.Socket, executor, clock: PartClock, profile: bool) -> None:
        self.socket = socket
        self.executor = executor
        self.forward: SimulatedForward = executor.runner.forward
        self.clock = clock
        self.in_flight: list[int] = []  # launched steps, oldest first
        self.profile_steps: range = range(0)  # the scheduler sends them before the first of their plans
        self.profiler = cProfile.Profile() if profile else None

    def serve(self) -> None:
        while True:
            if self.in_flight:
                left_ms = (self.forward.ready_at(self.in_flight[0]) - time.perf_counter()) * 1e3
                if not self.socket.poll(max(int(left_ms + 1), 0)):
                    self._finish()
                    continue
            kind, payload = self.socket.recv_multipart()
            if kind == PLAN:
                self._launch(payload)
                while len(self.in_flight) > 1:
                    self._finish()
            elif kind == MEASURE:
                self.profile_steps = range(*unpack(payload))
            elif kind == END:
                return
            else:
                raise RuntimeError(f"the bench worker got {kind.decode()} during a row")

    def _launch(self, data: bytes) -> None:
        clock = self.clock
        start = time.perf_counter()
        plan = decode(data)
        clock.step = plan.step
        if self.profiler is not None and self.profile_steps and plan.step == self.profile_steps[0]:  # on until the last result is encoded
            self.profiler.enable()
        decoded = time.perf_counter()
        self.executor.launch(plan)
        clock.add(plan.step, "decode_plan", decoded - start)
        clock.add(plan.step, "execute", time.perf_counter() - decoded)
        self.in_flight.append(plan.step)

    def _finish(self) -> None:
        clock = self.clock
        step = clock.step = self.in_flight.pop(0)
        clock.add(step, "wait", self.forward.wait(step))
        start = time.perf_counter()
        result = self.executor.finish()
        executed = time.perf_counter()
        out = encode(result)
        end = time.perf_counter()
        if self.profiler is not None and self.profile_steps and step == self.profile_steps[-1]:
            self.profiler.disable()
        clock.add(step, "execute", executed - start)
        clock.add(step, "encode_result", end - executed)
        self.socket.send_multipart([RESULT, out])


@dataclass(slots=True)
class Measurement:
    """What one row's run recorded, by step number, and its scheduler (for checks)."""

    scheduler: Scheduler
    steps: range  # the measured ones
    scheduler_times: dict[int, dict[str, float]]
    worker_times: dict[int, dict[str, float]]
    arrivals: dict[int, float] = field(default_factory=dict)  # when the step's result reached the scheduler
    decode_tokens: dict[int, int] = field(default_factory=dict)  # tokens update() appended


def is_steady_decode(plan: StepPlan, batch: int) -> bool:
    """Every sequence of the batch decodes exactly one token, none is new."""
    return not plan.new_seqs and len(plan.cached_seqs) == batch and plan.num_scheduled_tokens == batch


class SchedulerLoop:
    """The scheduler side: up to `depth` plans in flight (2: planned one step ahead), as when serving."""

    def __init__(self, scheduler: Scheduler, worker: WorkerSocket, spec: RowSpec, depth: int, profile: bool) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.spec = spec
        self.depth = depth
        self.clock = PartClock()
        self.profiler = cProfile.Profile() if profile else None
        self.measured: range | None = None
        self.arrivals: dict[int, float] = {}
        self.decode_tokens: dict[int, int] = {}

    def run(self) -> range:
        """Prefill, warm up, measure; returns the measured steps once their results are in."""
        in_flight, last_sent = 0, 0
        while True:
            while in_flight < self.depth and (self.measured is None or last_sent < self.measured[-1]):
                last_sent = self._send()
                in_flight += 1
            if in_flight == 0:
                return self.measured
            self._receive()
            in_flight -= 1

    def _send(self) -> int:
        clock, start = self.clock, time.perf_counter()
        self._profile(self.scheduler.step + 1)
        plan = self.scheduler.schedule()
        scheduled = time.perf_counter()
        self._check(plan)
        encoding = time.perf_counter()
        data = encode(plan)
        clock.add(plan.step, "schedule", scheduled - start)
        clock.add(plan.step, "encode_plan", time.perf_counter() - encoding)
        self.worker.send(PLAN, data)
        return plan.step

    def _check(self, plan: StepPlan) -> None:
        """Find the measured steps (and tell the worker, before their first plan), and check them."""
        if self.measured is None and is_steady_decode(plan, self.spec.batch):
            first = plan.step + self.spec.warmup_steps
            self.measured = range(first, first + self.spec.steps)
            self.worker.send(MEASURE, pack([self.measured.start, self.measured.stop]))
        elif self.measured is None and plan.step > 100_000:
            raise RuntimeError("the batch never reached steady decode")
        elif self.measured is not None and plan.step in self.measured and not is_steady_decode(plan, self.spec.batch):
            raise RuntimeError(f"measured step {plan.step} is not one decode token per sequence (a preemption?)")

    def _receive(self) -> None:
        data = self.worker.recv(RESULT)
        arrived = time.perf_counter()
        result = decode(data)
        decoded = time.perf_counter()
        outputs = self.scheduler.update(result)
        end = time.perf_counter()
        step = result.step
        self.arrivals[step] = arrived
        self.decode_tokens[step] = sum(o.num_new_tokens for out in outputs for o in out.outputs)
        self.clock.add(step, "decode_result", decoded - arrived)
        self.clock.add(step, "update", end - decoded)

    def _profile(self, step: int) -> None:
        """Profile the scheduler process from the first measured plan's schedule() on (`measure` stops it)."""
        if self.profiler is not None and self.measured is not None and step == self.measured[0]:
            self.profiler.enable()


# ----------------------------------------------------------------------------- one row


def measure(spec: RowSpec, model_path: Path, profile_prefix: Path | None = None,
            worker: WorkerProcess | None = None) -> tuple[dict, Measurement]:
    """Run one row (in `worker`, else in a worker process of its own); returns it and what it was computed from."""
    if worker is None:
        with WorkerProcess() as own:
            return measure(spec, model_path, profile_prefix, own)
    config = engine_config(spec, model_path)
    profile_path = f"{profile_prefix}-worker.pstats" if profile_prefix is not None else None
    hello = worker.start_row(spec, model_path, profile_path)
    if hello["recurrent_state"]:
        config = recurrent(config, hello["state_checkpoints"])
    scheduler = Scheduler(config, hello["num_gpu_blocks"], hello["max_model_len"], hello["eos_token_ids"],
                          sliding_window=hello["sliding_window"], kv_groups=hello["kv_groups"],
                          recurrent_state=hello["recurrent_state"], state_checkpoints=hello["state_checkpoints"])
    if spec.gc_freeze:
        freeze_startup_heap("bench scheduler")  # as scheduler/server.py does before it serves
    loop = None
    try:
        vocab_size = hello["vocab_size"]
        for i in range(spec.batch):
            scheduler.add_request(f"bench-{i}", distinct_prompt(i, spec.context, vocab_size),
                                  sampling_params(spec.sampling, i, spec.max_tokens))
        depth = 2 if getattr(config, "async_scheduling", False) else 1
        load = os.getloadavg()[0]
        loop = SchedulerLoop(scheduler, worker.socket, spec, depth, profile_prefix is not None)
        steps = loop.run()
    except BaseException:
        worker.close()  # it is mid-row, plans in flight: of no use to another row
        raise
    finally:
        if loop is not None and loop.profiler is not None:
            loop.profiler.disable()
        gc.unfreeze()
    worker_times = worker.end_row()  # the worker checked its logits were untouched, and wrote its profile
    if profile_prefix is not None:
        loop.profiler.dump_stats(f"{profile_prefix}-scheduler.pstats")
    run = Measurement(scheduler, steps, loop.clock.times, worker_times, loop.arrivals, loop.decode_tokens)
    return summarize(spec, run, depth == 2, load), run


def step_parts(run: Measurement, step: int) -> dict[str, float]:
    """Seconds of each host part of one step (execute_other: execute less its timed parts)."""
    sched, work = run.scheduler_times[step], run.worker_times[step]
    parts = {name: sched.get(name, 0.0) for name in SCHEDULER_PARTS}
    parts.update({name: work.get(name, 0.0) for name in WORKER_PARTS if name != "execute_other"})
    timed_inside = sum(work.get(name, 0.0) for name in ("apply", "prepare", "sampler", "forward"))
    parts["execute_other"] = work.get("execute", 0.0) - timed_inside
    return parts


def summarize(spec: RowSpec, run: Measurement, async_scheduling: bool, load: float) -> dict:
    per_step = [step_parts(run, step) for step in run.steps]
    row = {
        "batch": spec.batch, "context": spec.context, "sampling": spec.sampling,
        "simulated_forward_ms": spec.simulated_forward_ms, "async_scheduling": async_scheduling,
        "steps": len(run.steps), "decode_tokens": sum(run.decode_tokens[step] for step in run.steps),
        "step_ms": round((run.arrivals[run.steps[-1]] - run.arrivals[run.steps[0] - 1]) / len(run.steps) * 1e3, 4),
        "host_ms": median_ms([sum(parts.values()) for parts in per_step]),
        "host_max_ms": round(max(sum(parts.values()) for parts in per_step) * 1e3, 4),
        "gc_freeze": spec.gc_freeze,
        "forward_ms": median_ms([run.worker_times[step].get("device", 0.0) for step in run.steps]),
        "breakdown_ms": {name: median_ms([parts[name] for parts in per_step]) for name in HOST_PARTS},
        "load_1m": round(load, 2),
    }
    return row


# ----------------------------------------------------------------------------- the command


def row_specs(args) -> list[RowSpec]:
    samplings = names(args.sampling)
    for s in samplings:
        sampling_params(s, 0, 1)  # an unknown one is a ValueError now, not after the first rows
    if args.steps < 1 or args.warmup_steps < 1:
        raise ValueError("--steps and --warmup-steps must be >= 1 (a step's period needs the result before it)")
    batches, contexts = numbers(args.batch_sizes, "--batch-sizes"), numbers(args.context_lens, "--context-lens")
    gc_freezes = [{"on": True, "off": False}[value] for value in names(args.gc_freeze) if value in ("on", "off")]
    if len(gc_freezes) != len(names(args.gc_freeze)):
        raise ValueError("--gc-freeze takes on, off or both (comma-separated)")
    if max(batches) >= args.max_num_batched_tokens:
        raise ValueError("--max-num-batched-tokens must be larger than every batch size (one decode token each)")
    return [
        RowSpec(batch, context, sampling, sim, args.steps, args.warmup_steps, not args.no_async_scheduling,
                args.block_size, args.max_num_batched_tokens, args.device, freeze)
        for batch in batches for context in contexts
        for sampling in samplings for sim in numbers(args.simulated_forward_ms, "--simulated-forward-ms", float)
        for freeze in gc_freezes
    ]


def print_row(row: dict) -> None:
    parts = " ".join(f"{k}={v:.3f}" for k, v in row["breakdown_ms"].items())
    print(f"batch {row['batch']:4d} context {row['context']:5d} {row['sampling']:6s} "
          f"forward {row['simulated_forward_ms']:g} ms{'' if row['gc_freeze'] else ' gc-unfrozen'}: "
          f"step {row['step_ms']:.3f} ms, host {row['host_ms']:.3f} ms (worst {row['host_max_ms']:.3f}) "
          f"({parts})", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench step`'s flags."""
    parser.add_argument("--batch-sizes", default="64,256", help="running sequences, comma-separated")
    parser.add_argument("--context-lens", default="1024,4096", help="prompt tokens of each sequence, comma-separated")
    parser.add_argument("--sampling", default="greedy,random",
                        help="greedy, random (temperature 0.8, top-p 0.95, top-k 50, penalties 0.5, seeded), comma-separated")
    parser.add_argument("--simulated-forward-ms", default="0,5", help="the model forward's stand-in sleeps this long")
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured per row")
    parser.add_argument("--warmup-steps", type=int, default=3, help="decode steps run first, untimed")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="serial steps, even where the scheduler can plan one step ahead")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill chunk (prefill is untimed)")
    parser.add_argument("--device", default="cpu", help="where the worker's tensors live (cpu, cuda, cuda:N)")
    parser.add_argument("--gc-freeze", default="on",
                        help="on: each process freezes its startup heap out of the garbage collector, as the servers "
                             "do; off: as before they did (on,off: both, for the worst step's figure)")
    parser.add_argument("--profile-dir", help="cProfile the measured steps: one .pstats per row and process (slows them)")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench step` command."""
    import torch

    specs = row_specs(args)
    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-step-") as tmp, contextlib.ExitStack() as workers:
        worker = None  # the frozen rows' worker process, started for the first of them
        max_positions = max(spec.context + spec.max_tokens for spec in specs)
        model_path = dummy_model_config(Path(tmp), max_positions)
        if args.profile_dir:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        for spec in specs:
            name = f"b{spec.batch}-c{spec.context}-{spec.sampling}-f{spec.simulated_forward_ms:g}"
            prefix = Path(args.profile_dir) / name if args.profile_dir else None
            if spec.gc_freeze and worker is None:
                worker = workers.enter_context(WorkerProcess(torch.get_num_threads()))
            # an unfrozen row runs in a worker process of its own: one that froze and unfroze its heap
            # counts its objects as a collector that never froze does not
            row, _ = measure(spec, model_path, prefix, worker if spec.gc_freeze else None)
            print_row(row)
            rows.append(row)
    result = {
        **header("step", command_words("step", args), args.device),
        "model": "one-layer dummy Llama (hidden 8) with the default model's vocabulary; forward simulated",
        "vocab_size": int(json.loads(resolve_model("dummy:smollm2-135m.json").path.read_text())["vocab_size"]),
        "async_scheduling_supported": True,  # every scheduler can now; the key stays for the results' readers
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_num_threads": torch.get_num_threads(),
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "profiled": bool(args.profile_dir),
        "rows": rows,
    }
    write_result(result, args.output)
    print(json.dumps(rows, indent=2))
    return 0
