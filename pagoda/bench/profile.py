"""`pagoda bench profile`: where the time of a steady decode step goes, under torch.profiler.

The in-process offline engine (pagoda.offline.LLM: the real Scheduler, Executor, model, sampler,
CUDA graphs) gets `--batch-size` requests with distinct prompts of `--context-len` tokens (greedy,
ignore_eos, max_tokens past the run). It steps until a plan decodes one token for every sequence
(prefill done), runs `--warmup-steps` more, then profiles `--steps` calls of `engine.step()` with
torch.profiler (CPU and CUDA activities), each inside a record_function range `pagoda step I`, and
writes the Chrome trace (`--trace`, default beside `--output`). Everything under `gpu` is computed
from that trace file:

    busy_fraction     the union of the device's kernel, memcpy and memset intervals (overlaps
                      merged) over the profiled window (first step's start to last step's end)
    device_ms_by_kind device time per kind (`kernel_kind`: gemm, attention, norm_rope_activation,
                      sampler, copy, collective, other); a kernel launched inside the sampler's
                      range (`pagoda sampler`) counts as sampler whatever its name, one named like
                      a sampler op outside it (the MoE router's top-k) as other
    gaps              holes in the device timeline inside the window longer than `--gap-threshold-us`:
                      count, total, largest; and the median from the last device interval of one
                      step to the first of the next (steps: the `pagoda step I` ranges)
    steps             per step: wall time (its range) and device time (union of its intervals)
    top_kernels       the kernels that took the most device time, with their kind

`roofline`: what a memory-bound decode step cannot beat, `(weight bytes + KV bytes) / copy
bandwidth`: the weight bytes of the model's parameters, the KV bytes the step reads (batch x the
mean tokens per sequence over the profiled steps x layers x 2 x kv_heads x head_dim x the KV
dtype's bytes), and a device-to-device copy's (read + write) bandwidth measured in this process
before the model loads (pagoda.bench.kernels.copy_bandwidth); `step_over_roofline` is the median
step wall time over it. `goals` holds the targets: busy >= 95%, step <= 1.25 x roofline.

`host` (CPU and CUDA): the host time by part of the profiled steps, through pagoda bench step's
clocks (pagoda.bench.step.PartClock, TimedProxy, step_parts) over the in-process engine: schedule,
apply, prepare, sampler, execute_other, update, and the model's forward (on CUDA mostly the time
to launch it; on CPU the computation itself). Without CUDA there is no device timeline: the result
says so, and holds the host parts, the step wall times and the trace (CPU ops).

    pagoda bench profile --model dummy:worker/configs/llama-3.1-8b.json --device cuda --dtype bfloat16 \\
        --batch-size 256 --context-len 1024 --output profile.json   # profile.trace.json beside it
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagoda.bench.common import add_engine_arguments, command_words, emit, header, log, model_keys
from pagoda.bench.timing import median_ms
from pagoda.bench.step import (
    Measurement, PartClock, RowSpec, TimedProxy, distinct_prompt, is_steady_decode, sampling_params, step_parts,
)

KINDS = ("gemm", "attention", "norm_rope_activation", "sampler", "copy", "collective", "other")
STEP_RANGE = "pagoda step "  # + the profiled step's index: one record_function range per engine.step()
SAMPLER_RANGE = "pagoda sampler"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# pagoda bench step's host parts less the wire's (no codec in process), and the model's forward (real here)
IN_PROCESS_PARTS = ("schedule", "apply", "prepare", "sampler", "execute_other", "update", "forward")
BUSY_GOAL = 0.95
ROOFLINE_GOAL = 1.25
MAX_PREFILL_STEPS = 100_000

# (kind, substrings of the lower-cased name), first match wins: collectives and copies first,
# attention before GEMMs (FlashAttention's kernels name cutlass types), the sampler's ops last.
_NAME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")),
    ("copy", ("memcpy", "memset", "_copy_blocks_kernel", "direct_copy_kernel", "copy_kernel", "swap_blocks")),
    ("attention", ("_attention_kernel", "_reduce_splits_kernel", "_write_kv_kernel", "flash_fwd", "flash::",
                   "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "gemv", "xmma", "cutlass", "splitkreduce", "cublas", "matmul", "_moe_gemm")),
    ("norm_rope_activation", ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "rms_norm", "rmsnorm",
                              "layer_norm", "layernorm", "rotary", "silu", "gelu")),
    ("sampler", ("softmax", "topk", "top_k", "sort", "argmax", "multinomial", "exponential", "cumsum", "scan",
                 "distribution_", "logsumexp")),
)


def kernel_kind(name: str) -> str:
    """The kind of a device event by its name: one of KINDS. Triton kernels carry their Python
    function's name (`_attention_kernel`, `_rms_norm_kernel`); cuBLAS/CUTLASS GEMMs `sm90_xmma_gemm_...`,
    `nvjet_...`, `ampere_bf16_s16816gemm...`; torch's sampler ops `cunn_SoftMaxForward`,
    `gatherTopK`, `ArgMaxOps`, `DeviceRadixSort...`; memcpy and memset events `Memcpy DtoD ...`."""
    lower = name.lower()
    for kind, needles in _NAME_RULES:
        if any(n in lower for n in needles):
            return kind
    return "other"


# ----------------------------------------------------------------------------- intervals


Interval = tuple[float, float]  # [start, end), microseconds


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (touching ones joined)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered(merged: Sequence[Interval], start: float, end: float) -> float:
    """How much of [start, end) the disjoint `merged` intervals cover."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in merged)


def holes(merged: Sequence[Interval], start: float, end: float) -> list[float]:
    """The lengths of the parts of [start, end) that the disjoint, sorted `merged` intervals leave
    uncovered, in order (the edges of the window included)."""
    out, cursor = [], start
    for s, e in merged:
        if s > cursor and cursor < end:
            out.append(min(s, end) - cursor)
        cursor = max(cursor, e)
    if cursor < end:
        out.append(end - cursor)
    return out


def gap_stats(gaps: Sequence[float], threshold: float) -> dict:
    """The gaps longer than `threshold`: their count, total and largest (0 when none)."""
    long = [g for g in gaps if g > threshold]
    return {"count": len(long), "total": sum(long), "largest": max(long, default=0.0)}


# ----------------------------------------------------------------------------- the trace


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    name: str
    start: float  # us, on the trace's clock
    end: float
    kind: str


@dataclass(frozen=True, slots=True)
class Timeline:
    """What the analysis reads of a Chrome trace: the profiled steps' ranges, in order, and the device's events."""

    steps: list[Interval]
    events: list[DeviceEvent]


def read_timeline(trace: dict) -> Timeline:
    """The `pagoda step I` ranges (by I) and every kernel, memcpy and memset of a torch.profiler
    Chrome trace, each of a kind. Where the trace holds `pagoda sampler` ranges they decide what
    the sampler ran: a kernel launched inside one (its runtime or driver call, of the same
    correlation id) is of kind sampler, memcpy and memset aside; one named like a sampler op
    launched outside them (the MoE router's top-k) is other."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((int(e["name"][len(STEP_RANGE):]), e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_RANGE))
    sampler = merge_intervals((e["ts"], e["ts"] + e["dur"]) for e in events
                              if e.get("cat") == "user_annotation" and e["name"] == SAMPLER_RANGE)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}

    def kind(e: dict) -> str:
        by_name = kernel_kind(e["name"])
        if not sampler or e["cat"] != "kernel":
            return by_name
        launched = launches.get(e.get("args", {}).get("correlation"))
        if launched is not None and any(s <= launched < t for s, t in sampler):
            return "sampler"
        return "other" if by_name == "sampler" else by_name

    device = [DeviceEvent(e["name"], e["ts"], e["ts"] + e["dur"], kind(e)) for e in events
              if e.get("cat") in DEVICE_CATEGORIES]
    return Timeline([(s, t) for _, s, t in steps], sorted(device, key=lambda d: d.start))


def events_by_step(timeline: Timeline) -> list[list[DeviceEvent]]:
    """Each device event to the last step that started before it did (the GPU runs behind the
    host); events before the first step are left out."""
    starts = [s for s, _ in timeline.steps]
    out: list[list[DeviceEvent]] = [[] for _ in starts]
    i = -1
    for event in timeline.events:  # sorted by start
        while i + 1 < len(starts) and starts[i + 1] <= event.start:
            i += 1
        if i >= 0:
            out[i].append(event)
    return out


def analyze(timeline: Timeline, gap_threshold_us: float, top: int = 15) -> dict:
    """The `gpu` section of the result (times in ms, the busy fraction a share of the window)."""
    if not timeline.steps:
        raise ValueError("the trace holds no `pagoda step I` range")
    window = (timeline.steps[0][0], timeline.steps[-1][1])
    inside = [e for e in timeline.events if e.end > window[0] and e.start < window[1]]
    merged = merge_intervals((e.start, e.end) for e in inside)
    busy = covered(merged, *window)
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[str, list] = {}
    for e in inside:
        by_kind[e.kind] += min(e.end, window[1]) - max(e.start, window[0])
        entry = by_name.setdefault(e.name, [e.kind, 0, 0.0])
        entry[1] += 1
        entry[2] += e.end - e.start
    per_step = events_by_step(Timeline(timeline.steps, inside))
    between = [nxt[0].start - max(e.end for e in cur) for cur, nxt in zip(per_step, per_step[1:]) if cur and nxt]
    gaps = gap_stats(holes(merged, *window), gap_threshold_us)
    wall = [t - s for s, t in timeline.steps]
    device = [sum(t - s for s, t in merge_intervals((e.start, e.end) for e in events)) for events in per_step]
    ms = lambda us: round(us / 1e3, 4)  # noqa: E731
    kernel_total = sum(by_kind.values())
    return {
        "window_ms": ms(window[1] - window[0]),
        "busy_ms": ms(busy),
        "busy_fraction": round(busy / (window[1] - window[0]), 4),
        "device_events": len(inside),
        "device_ms_by_kind": {k: ms(v) for k, v in by_kind.items()},
        "device_share_by_kind": {k: round(v / kernel_total, 4) if kernel_total else 0.0 for k, v in by_kind.items()},
        "gaps": {"threshold_us": gap_threshold_us, "count": gaps["count"], "total_ms": ms(gaps["total"]),
                 "largest_ms": ms(gaps["largest"]),
                 "between_steps_median_us": round(statistics.median(between), 2) if between else None},
        "steps": {"wall_ms": ms(statistics.median(wall)), "device_ms": ms(statistics.median(device)),
                  "wall_ms_each": [ms(w) for w in wall], "device_ms_each": [ms(d) for d in device]},
        "top_kernels": [{"name": name, "kind": kind, "count": count, "total_ms": ms(total)}
                        for name, (kind, count, total) in sorted(by_name.items(), key=lambda x: -x[1][2])[:top]],
    }


# ----------------------------------------------------------------------------- the engine


class PlanRecorder:
    """Stands in for the engine's executor: launches and finishes each plan on the real one (the
    engine overlaps them as it does the executor's), keeps it, and times both on `clock` as
    pagoda bench step's worker does (the step set first, for the parts inside). On CUDA a finish
    includes the wait for the device."""

    def __init__(self, executor, clock: PartClock) -> None:
        self.executor = executor
        self.clock = clock
        self.plans = []
        self.in_flight: list[int] = []
        self.most_in_flight = 0  # 2 once the engine launched a plan behind another

    def launch(self, plan) -> None:
        self.plans.append(plan)
        self.in_flight.append(plan.step)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self._timed(plan.step, self.executor.launch, plan)

    def finish(self):
        return self._timed(self.in_flight.pop(0), self.executor.finish)

    def execute(self, plan):
        self.launch(plan)
        return self.finish()

    def _timed(self, step: int, fn, *args):
        self.clock.step = step
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.clock.add(step, "execute", time.perf_counter() - start)


def instrument(llm, clock: PartClock) -> PlanRecorder:
    """Time the in-process engine's parts on `clock` (pagoda bench step's, forward real) and record its plans."""
    executor, scheduler = llm.executor, llm.engine.scheduler
    runner = executor.runner
    runner.prepare = clock.timed(runner.prepare, "prepare")
    runner.forward = clock.timed(runner.forward, "forward")
    executor.state = TimedProxy(executor.state, clock, "apply")
    executor.sampler = TimedProxy(InRange(executor.sampler, SAMPLER_RANGE), clock, "sampler")
    schedule, update = scheduler.schedule, scheduler.update

    def timed_schedule():
        start = time.perf_counter()
        plan = schedule()
        clock.add(plan.step, "schedule", time.perf_counter() - start)
        return plan

    def timed_update(result):
        start = time.perf_counter()
        try:
            return update(result)
        finally:
            clock.add(result.step, "update", time.perf_counter() - start)

    scheduler.schedule, scheduler.update = timed_schedule, timed_update
    recorder = PlanRecorder(llm.engine.executor, clock)
    llm.engine.executor = recorder
    return recorder


class InRange:
    """`target` (the sampler), each call of it or of its `sample` (what the executor launches: the
    draws stay on the device) inside a record_function range `name`; other attributes pass through."""

    __slots__ = ("_target", "_name")

    def __init__(self, target, name: str) -> None:
        self._target = target
        self._name = name

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        with record_function(self._name):
            return self._target(*args, **kwargs)

    def sample(self, *args, **kwargs):
        with record_function(self._name):
            return self._target.sample(*args, **kwargs)


def add_requests(llm, spec: RowSpec) -> None:
    """`batch` greedy requests with distinct prompts of `context` tokens (no prefix is shared), as
    pagoda bench step's rows, past the last profiled step."""
    vocab_size = int(llm.executor.runner.hf_config.vocab_size)
    for i in range(spec.batch):
        llm.engine.add_request(f"profile-{i}", distinct_prompt(i, spec.context, vocab_size),
                               sampling_params(spec.sampling, i, spec.max_tokens))


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokens_per_seq(scheduler) -> float:
    """The mean KV tokens a running sequence holds."""
    from scheduler.sequence import SequenceStatus

    held = [seq.num_computed_tokens for g in scheduler.running for seq in g.seqs_with(SequenceStatus.RUNNING)]
    return statistics.mean(held) if held else 0.0


@dataclass(slots=True)
class Profiled:
    plans: list  # the profiled steps' plans
    tokens_per_seq: float  # the mean KV tokens of a sequence over the profiled steps


def profile_steps(llm, recorder: PlanRecorder, spec: RowSpec, trace: Path) -> Profiled:
    """Prefill, warm up, then profile `steps` engine steps into the Chrome trace at `trace`."""
    engine, device = llm.engine, llm.executor.runner.device
    while not (recorder.plans and is_steady_decode(recorder.plans[-1], spec.batch)):
        if engine.num_steps > MAX_PREFILL_STEPS or not engine.has_unfinished_requests():
            raise RuntimeError("the batch never reached steady decode (one token for every sequence): give the "
                               "engine room for it (--max-num-seqs, --num-gpu-blocks)")
        engine.step()
    for _ in range(spec.warmup_steps):
        engine.step()
    synchronize(device)
    first, held_before = len(recorder.plans), tokens_per_seq(engine.scheduler)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(spec.steps):
            with record_function(f"{STEP_RANGE}{i}"):
                engine.step()
        synchronize(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    plans = recorder.plans[first:]
    if len(plans) != spec.steps or not all(is_steady_decode(p, spec.batch) for p in plans):
        raise RuntimeError(f"the {spec.steps} profiled steps ran {len(plans)} plans, not each one decode token "
                           "per sequence (a preemption? give the engine more KV blocks: --num-gpu-blocks)")
    return Profiled(plans, (held_before + tokens_per_seq(engine.scheduler)) / 2)


# ----------------------------------------------------------------------------- roofline


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_step(model, batch: int, tokens_per_seq: float) -> int:
    """The KV a decode step reads: batch x tokens x layers x 2 (K, V) x kv_heads x head_dim x bytes."""
    layers = model.attention_layers()
    attn = layers[0]
    return int(batch * tokens_per_seq * len(layers) * 2 * attn.num_kv_heads * attn.head_dim
               * attn.kv_cache.element_size())


def roofline(weights: int, kv: int, tokens_per_seq: float, copy_GBps: float | None, step_ms: float) -> dict:
    out = {"weight_bytes": weights, "kv_bytes": kv, "kv_tokens_per_seq": tokens_per_seq,
           "copy_bandwidth_GBps": copy_GBps, "roofline_ms": None, "step_ms": step_ms, "step_over_roofline": None}
    if copy_GBps:
        out["roofline_ms"] = round((weights + kv) / (copy_GBps * 1e9) * 1e3, 4)
        out["step_over_roofline"] = round(step_ms / out["roofline_ms"], 4)
    return out


# ----------------------------------------------------------------------------- the command


def default_trace(output: str | None) -> Path:
    """Beside --output (its name with .trace.json), else pagoda-profile.trace.json here."""
    if output:
        path = Path(output)
        return path.with_name(path.name.removesuffix(".json") + ".trace.json")
    return Path("pagoda-profile.trace.json")


def host_section(clock: PartClock, llm, plans) -> dict:
    steps = [p.step for p in plans]
    run = Measurement(llm.engine.scheduler, steps, clock.times, clock.times)
    per_step = [{**step_parts(run, s), "forward": clock.times[s].get("forward", 0.0)} for s in steps]
    return {"host_ms": median_ms([sum(v for k, v in parts.items() if k != "forward") for parts in per_step]),
            "breakdown_ms": {name: median_ms([parts[name] for parts in per_step]) for name in IN_PROCESS_PARTS}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench profile`'s flags."""
    add_engine_arguments(parser, device_help="auto, cpu, cuda or cuda:N (the device timeline needs CUDA)")
    parser.add_argument("--batch-size", type=int, default=256, help="sequences decoding together")
    parser.add_argument("--context-len", type=int, default=1024, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    parser.add_argument("--warmup-steps", type=int, default=5, help="decode steps run first, unprofiled")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: --batch-size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill chunk (prefill is unprofiled)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="the KV pool, in blocks (default: what fits)")
    parser.add_argument("--enforce-eager", action="store_true", help="decode steps without CUDA graphs")
    parser.add_argument("--gap-threshold-us", type=float, default=20.0,
                        help="an idle stretch of the device timeline longer than this counts as a gap")
    parser.add_argument("--output", help="write the result JSON here")
    parser.add_argument("--trace", help="write the Chrome trace here (default: beside --output, .trace.json; "
                                        "else pagoda-profile.trace.json)")


def run(args) -> int:
    """The `pagoda bench profile` command."""
    from pagoda.offline import LLM
    from worker.model_runner import resolve_device

    if args.steps < 2 or args.warmup_steps < 0:
        raise ValueError("--steps must be >= 2 (gaps between steps need two) and --warmup-steps >= 0")
    if args.batch_size >= args.max_num_batched_tokens:
        raise ValueError("--max-num-batched-tokens must be larger than --batch-size (one decode token each)")
    device = resolve_device(args.device)
    copy = None
    if device.type == "cuda":  # before the model: its KV pool takes the rest of the memory
        from pagoda.bench.kernels import copy_bandwidth

        copy = copy_bandwidth(device)
        torch.cuda.empty_cache()
    spec = RowSpec(args.batch_size, args.context_len, "greedy", 0.0, args.steps, args.warmup_steps,
                   max_num_batched_tokens=args.max_num_batched_tokens, device=str(device))
    llm = LLM(args.model, skip_tokenizer_init=True, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs or args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks=args.num_gpu_blocks, enforce_eager=args.enforce_eager)
    try:
        runner = llm.executor.runner
        clock = PartClock()
        recorder = instrument(llm, clock)
        add_requests(llm, spec)
        trace = Path(args.trace) if args.trace else default_trace(args.output)
        log(f"profiling {args.steps} decode steps of batch {args.batch_size}, context {args.context_len} "
            f"on {runner.device} ({runner.num_gpu_blocks} KV blocks)")
        profiled = profile_steps(llm, recorder, spec, trace)
        timeline = read_timeline(json.loads(trace.read_text()))
        result = profile_result(args, llm, device, copy, clock, profiled, timeline, trace)
    finally:
        llm.close()
    emit(result, args.output)
    print_summary(result)
    return 0


def profile_result(args, llm, device, copy: dict | None, clock: PartClock, profiled: Profiled, timeline: Timeline,
                   trace: Path) -> dict:
    """The result JSON: the run, step times, host time by part, the device timeline's analysis and the
    roofline (CUDA), and the goals met; without CUDA, a note on what is missing."""
    runner = llm.executor.runner
    wall = [t - s for s, t in timeline.steps]
    step_ms = round(statistics.median(wall) / 1e3, 4)
    result = {
        **header("profile", command_words("profile", args), str(runner.device)),
        **model_keys(runner), "torch": torch.__version__,
        "batch": args.batch_size, "context": args.context_len, "steps": len(profiled.plans),
        "warmup_steps": args.warmup_steps, "decode_tokens": sum(p.num_scheduled_tokens for p in profiled.plans),
        "engine": {"max_num_seqs": llm.config.max_num_seqs,
                   "max_num_batched_tokens": llm.config.max_num_batched_tokens,
                   "num_gpu_blocks": runner.num_gpu_blocks, "async_scheduling": llm.config.async_scheduling,
                   "cuda_graphs": runner.device.type == "cuda" and runner.decode_runner is not None},
        "trace": str(trace),
        "step_ms": step_ms,
        "step_ms_each": [round(w / 1e3, 4) for w in wall],
        "host": {"note": "host time by part of the profiled steps (pagoda bench step's parts, in process: no "
                         "wire; forward is the model's real call, on CUDA mostly its launch)",
                 **host_section(clock, llm, profiled.plans)},
        "gpu": analyze(timeline, args.gap_threshold_us) if device.type == "cuda" else None,
        "roofline": roofline(weight_bytes(runner.model),
                             kv_bytes_per_step(runner.model, args.batch_size, profiled.tokens_per_seq),
                             profiled.tokens_per_seq, copy and round(copy["bandwidth_GBps"], 1), step_ms),
    }
    if result["gpu"] is not None:
        result["goals"] = {
            f"busy_fraction >= {BUSY_GOAL}": result["gpu"]["busy_fraction"] >= BUSY_GOAL,
            f"step_over_roofline <= {ROOFLINE_GOAL}": result["roofline"]["step_over_roofline"] <= ROOFLINE_GOAL,
        }
    else:
        result["note"] = ("no CUDA device: no device timeline, busy fraction or roofline; this run reports the "
                          "host time by part (as pagoda bench step does) and the step wall times, and the trace "
                          "holds the CPU ops")
    return result


def print_summary(result: dict) -> None:
    host = " ".join(f"{k}={v:.3f}" for k, v in result["host"]["breakdown_ms"].items())
    log(f"step {result['step_ms']:.3f} ms (median of {result['steps']}); host {result['host']['host_ms']:.3f} ms "
        f"({host}); trace {result['trace']}")
    gpu = result["gpu"]
    if gpu is None:
        log("no CUDA device: host time by part only (no device timeline)")
        return
    kinds = " ".join(f"{k}={v:.3f}" for k, v in gpu["device_ms_by_kind"].items())
    roof = result["roofline"]
    log(f"GPU busy {gpu['busy_fraction']:.1%} of {gpu['window_ms']:.1f} ms; device ms by kind: {kinds}; "
        f"gaps > {gpu['gaps']['threshold_us']:g} us: {gpu['gaps']['count']} ({gpu['gaps']['total_ms']:.3f} ms, "
        f"largest {gpu['gaps']['largest_ms']:.3f} ms), between steps {gpu['gaps']['between_steps_median_us']} us; "
        f"roofline {roof['roofline_ms']} ms, step / roofline {roof['step_over_roofline']}")
