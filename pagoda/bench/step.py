"""`pagoda bench step`: the host side of a decode step, through the real code, the GPU replaced by a sleep.

The real Scheduler plans each step in one thread; the plan crosses to a second thread as bytes
(common.protocol `encode`/`decode`, as over ZeroMQ), where the real worker Executor applies it
(PlanState), builds the step's tensors (ModelRunner.prepare), "runs" the model and samples (Sampler);
the result crosses back as bytes and the Scheduler takes it (`update`). Only the model's forward is
replaced: it sleeps `--simulated-forward-ms` (releasing the GIL, as a GPU leaves the host free) and
returns float32 logits [num_sampled, vocab] sliced from a preallocated random tensor, so it costs
nothing itself. The model is a one-layer dummy with the default model's vocabulary (49,152).

With asynchronous scheduling (EngineConfig.async_scheduling, unless `--no-async-scheduling`) the
scheduler plans step N+1 while step N runs, one plan in flight ahead; without it each step is
schedule -> execute -> update.

Each row: `batch` requests with distinct prompts of `context` tokens (ignore_eos, max_tokens past
the run) are prefilled untimed; from the first step in which every sequence decodes one token,
`--warmup-steps` steps run untimed, then `--steps` steps are measured. Its keys:

    batch, context, sampling, simulated_forward_ms   the workload (sampling: greedy or random)
    async_scheduling  whether plans were made one step ahead
    steps             steps measured
    decode_tokens     tokens the scheduler appended in them (batch x steps)
    step_ms           median period between two results reaching the scheduler
    host_ms           median over steps of the host work of a step: the sum of the parts below
    forward_ms        median of the simulated forward (the sleep; not host work)
    breakdown_ms      median of each part: schedule, encode_plan (scheduler thread); decode_plan,
                      apply (PlanState), prepare, sampler, execute_other (the rest of
                      Executor.execute: swaps, rows, results), encode_result (worker thread);
                      decode_result, update (scheduler thread)
    load_1m           the host's 1-minute load average when the row started (shared machines)

    pagoda bench step --output result.json   # OMP_NUM_THREADS=1 for the committed CPU figures
"""
from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from common.config import EngineConfig
from common.models import resolve_model
from common.protocol import SamplingParams, StepPlan, decode, encode
from pagoda.bench.common import command_words, header, write_result
from scheduler.scheduler import Scheduler

SAMPLINGS = ("greedy", "random")
SCHEDULER_PARTS = ("schedule", "encode_plan", "decode_result", "update")
WORKER_PARTS = ("decode_plan", "apply", "prepare", "sampler", "execute_other", "encode_result")
HOST_PARTS = ("schedule", "encode_plan", "decode_plan", "apply", "prepare", "sampler", "execute_other",
              "encode_result", "decode_result", "update")
ROW_KEYS = ("batch", "context", "sampling", "simulated_forward_ms", "async_scheduling", "steps", "decode_tokens",
            "step_ms", "host_ms", "forward_ms", "breakdown_ms", "load_1m")
RESULT_TIMEOUT_S = 120.0


def sampling_params(sampling: str, index: int, max_tokens: int) -> SamplingParams:
    """greedy, or random: temperature 0.8, top-p 0.95, top-k 50, penalties 0.5, a seed per request."""
    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if sampling == "random":
        return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.5, presence_penalty=0.5,
                              seed=index, max_tokens=max_tokens, ignore_eos=True)
    raise ValueError(f"unknown sampling {sampling!r}: expected one of {', '.join(SAMPLINGS)}")


@dataclass(frozen=True, slots=True)
class RowSpec:
    batch: int
    context: int
    sampling: str
    simulated_forward_ms: float
    steps: int = 30
    warmup_steps: int = 3
    async_scheduling: bool = True  # when the scheduler supports it
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    device: str = "cpu"

    @property
    def max_tokens(self) -> int:
        """Past the last measured step: chunked prefill lets the first sequences decode while the
        last ones prefill, for at most the steps the whole batch's prompts take."""
        prefill_steps = -(-self.batch * self.context // (self.max_num_batched_tokens - self.batch))
        return prefill_steps + self.warmup_steps + self.steps + 16


def scheduler_supports_async() -> bool:
    """Whether EngineConfig has the async_scheduling field (contract 1 of the overlap work)."""
    return "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}


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
    fields = dict(model=f"dummy:{model_path}", device=spec.device, dtype="float32", block_size=spec.block_size,
                  num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, max_num_seqs=spec.batch,
                  max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=max_model_len)
    if scheduler_supports_async():
        fields["async_scheduling"] = spec.async_scheduling
    return EngineConfig(**fields)


# ----------------------------------------------------------------------------- timing


class PartClock:
    """Seconds per step and part, written by one thread (each thread has its own clock)."""

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
    """ModelRunner.forward's stand-in: sleeps, then returns [num_sampled, vocab] float32 logits."""

    def __init__(self, runner, max_rows: int, simulated_forward_ms: float, clock: PartClock, seed: int = 0) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        vocab_size = int(runner.hf_config.vocab_size)
        self.logits = torch.randn((max_rows, vocab_size), generator=generator).to(runner.device)
        self.checksum = float(self.logits.double().sum())
        self.seconds = simulated_forward_ms / 1e3
        self.clock = clock

    def __call__(self, step):
        start = time.perf_counter()
        if self.seconds:
            time.sleep(self.seconds)
        logits = self.logits[: step.logits_indices.shape[0]]
        self.clock.add(self.clock.step, "forward", time.perf_counter() - start)
        return logits

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


# ----------------------------------------------------------------------------- the two threads


class WorkerThread(threading.Thread):
    """The worker side: plans in as bytes, results out as bytes, as behind ZeroMQ."""

    def __init__(self, executor, clock: PartClock, profile: bool) -> None:
        super().__init__(name="bench-step-worker", daemon=True)
        self.executor = executor
        self.clock = clock
        self.plans: queue.Queue[bytes | None] = queue.Queue()
        self.results: queue.Queue[bytes | BaseException] = queue.Queue()
        self.profile_steps: range = range(0)  # set by the scheduler before it sends the first of them
        self.profiler = cProfile.Profile() if profile else None

    def run(self) -> None:
        try:
            while (data := self.plans.get()) is not None:
                self.results.put(self._step(data))
        except BaseException as exc:  # noqa: BLE001 - handed to the scheduler thread, which raises it
            self.results.put(exc)

    def _step(self, data: bytes) -> bytes:
        clock = self.clock
        start = time.perf_counter()
        plan = decode(data)
        clock.step = plan.step
        profiling = self.profiler is not None and plan.step in self.profile_steps
        if profiling and plan.step == self.profile_steps[0]:  # then on until the last one's result is encoded
            self.profiler.enable()
        decoded = time.perf_counter()
        result = self.executor.execute(plan)
        executed = time.perf_counter()
        out = encode(result)
        end = time.perf_counter()
        if profiling and plan.step == self.profile_steps[-1]:
            self.profiler.disable()
        clock.add(plan.step, "decode_plan", decoded - start)
        clock.add(plan.step, "execute", executed - decoded)
        clock.add(plan.step, "encode_result", end - executed)
        return out


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

    def __init__(self, scheduler: Scheduler, worker: WorkerThread, spec: RowSpec, depth: int, profile: bool) -> None:
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
        if self.measured is None and is_steady_decode(plan, self.spec.batch):
            first = plan.step + self.spec.warmup_steps
            self.measured = self.worker.profile_steps = range(first, first + self.spec.steps)
        elif self.measured is None and plan.step > 100_000:
            raise RuntimeError("the batch never reached steady decode")
        elif self.measured is not None and plan.step in self.measured and not is_steady_decode(plan, self.spec.batch):
            raise RuntimeError(f"measured step {plan.step} is not one decode token per sequence (a preemption?)")
        data = encode(plan)
        clock.add(plan.step, "schedule", scheduled - start)
        clock.add(plan.step, "encode_plan", time.perf_counter() - scheduled)
        self.worker.plans.put(data)
        return plan.step

    def _receive(self) -> None:
        data = self.worker.results.get(timeout=RESULT_TIMEOUT_S)
        arrived = time.perf_counter()
        if isinstance(data, BaseException):
            raise RuntimeError("the worker thread failed") from data
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
        """Profile the scheduler thread from the first measured plan's schedule() on (`measure` stops it)."""
        if self.profiler is not None and self.measured is not None and step == self.measured[0]:
            self.profiler.enable()


# ----------------------------------------------------------------------------- one row


def measure(spec: RowSpec, model_path: Path, profile_prefix: Path | None = None) -> tuple[dict, Measurement]:
    """Run one row; returns it and what it was computed from."""
    from worker.executor import Executor

    config = engine_config(spec, model_path)
    executor = Executor(config)
    worker_clock = PartClock()
    instrument(executor, worker_clock, spec.batch, spec.simulated_forward_ms)
    runner = executor.runner
    scheduler = Scheduler(config, runner.num_gpu_blocks, runner.max_model_len, executor.eos_token_ids)
    vocab_size = int(runner.hf_config.vocab_size)
    for i in range(spec.batch):  # distinct prompts: no prefix is shared
        prompt = [(i * 7919 + j * 104729) % (vocab_size - 3) + 3 for j in range(spec.context)]
        scheduler.add_request(f"bench-{i}", prompt, sampling_params(spec.sampling, i, spec.max_tokens))
    depth = 2 if getattr(config, "async_scheduling", False) else 1
    load = os.getloadavg()[0]
    worker = WorkerThread(executor, worker_clock, profile_prefix is not None)
    loop = SchedulerLoop(scheduler, worker, spec, depth, profile_prefix is not None)
    worker.start()
    try:
        steps = loop.run()
        if loop.profiler is not None:
            loop.profiler.disable()
    finally:
        worker.plans.put(None)
        worker.join(timeout=RESULT_TIMEOUT_S)
    runner.forward.check_untouched()
    if profile_prefix is not None:
        loop.profiler.dump_stats(f"{profile_prefix}-scheduler.pstats")
        worker.profiler.dump_stats(f"{profile_prefix}-worker.pstats")
    run = Measurement(scheduler, steps, loop.clock.times, worker_clock.times, loop.arrivals, loop.decode_tokens)
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
    ms = lambda values: round(statistics.median(values) * 1e3, 4)  # noqa: E731
    per_step = [step_parts(run, step) for step in run.steps]
    row = {
        "batch": spec.batch, "context": spec.context, "sampling": spec.sampling,
        "simulated_forward_ms": spec.simulated_forward_ms, "async_scheduling": async_scheduling,
        "steps": len(run.steps), "decode_tokens": sum(run.decode_tokens[step] for step in run.steps),
        "step_ms": ms([run.arrivals[step] - run.arrivals[step - 1] for step in run.steps]),
        "host_ms": ms([sum(parts.values()) for parts in per_step]),
        "forward_ms": ms([run.worker_times[step].get("forward", 0.0) for step in run.steps]),
        "breakdown_ms": {name: ms([parts[name] for parts in per_step]) for name in HOST_PARTS},
        "load_1m": round(load, 2),
    }
    assert tuple(row) == ROW_KEYS
    return row


# ----------------------------------------------------------------------------- the command


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def row_specs(args) -> list[RowSpec]:
    samplings = [s.strip() for s in args.sampling.split(",") if s.strip()]
    for s in samplings:
        sampling_params(s, 0, 1)  # an unknown one is a ValueError now, not after the first rows
    if args.steps < 1 or args.warmup_steps < 1:
        raise ValueError("--steps and --warmup-steps must be >= 1 (a step's period needs the result before it)")
    if max(_ints(args.batch_sizes)) >= args.max_num_batched_tokens:
        raise ValueError("--max-num-batched-tokens must be larger than every batch size (one decode token each)")
    return [
        RowSpec(batch, context, sampling, sim, args.steps, args.warmup_steps, not args.no_async_scheduling,
                args.block_size, args.max_num_batched_tokens, args.device)
        for batch in _ints(args.batch_sizes) for context in _ints(args.context_lens)
        for sampling in samplings for sim in _floats(args.simulated_forward_ms)
    ]


def print_row(row: dict) -> None:
    parts = " ".join(f"{k}={v:.3f}" for k, v in row["breakdown_ms"].items())
    print(f"batch {row['batch']:4d} context {row['context']:5d} {row['sampling']:6s} "
          f"forward {row['simulated_forward_ms']:g} ms: step {row['step_ms']:.3f} ms, host {row['host_ms']:.3f} ms "
          f"({parts})", file=sys.stderr, flush=True)


def run(args) -> int:
    """The `pagoda bench step` command."""
    import torch

    specs = row_specs(args)
    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-step-") as tmp:
        max_positions = max(spec.context + spec.max_tokens for spec in specs)
        model_path = dummy_model_config(Path(tmp), max_positions)
        if args.profile_dir:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        for spec in specs:
            name = f"b{spec.batch}-c{spec.context}-{spec.sampling}-f{spec.simulated_forward_ms:g}"
            prefix = Path(args.profile_dir) / name if args.profile_dir else None
            row, _ = measure(spec, model_path, prefix)
            print_row(row)
            rows.append(row)
    result = {
        **header("step", command_words("step", args), args.device),
        "model": "one-layer dummy Llama (hidden 8) with the default model's vocabulary; forward simulated",
        "vocab_size": int(json.loads(resolve_model("dummy:smollm2-135m.json").path.read_text())["vocab_size"]),
        "async_scheduling_supported": scheduler_supports_async(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_num_threads": torch.get_num_threads(),
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "profiled": bool(args.profile_dir),
        "rows": rows,
    }
    write_result(result, args.output)
    print(json.dumps(rows, indent=2))
    return 0
