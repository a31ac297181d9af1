"""`pagoda bench publish`: what publishing the memory page's snapshot costs the scheduler.

Runs on CPU, with no model: the real Scheduler and BlockManager (prefix caching on, a swap pool)
are driven through schedule() / update() by ModelFreeExecutor, which follows the plans' diffs as
a worker would (common/plan_state.py) and samples seeded random tokens, with top-k candidates so
beam search runs. The workload fills a pool of `--num-blocks` blocks with a realistic mix: many
requests (prompts of 200 to 3,000 tokens), a few system prompts shared through the prefix cache,
parallel sampling (n=4) and beam search (width 4) forking shared blocks, all decoding past the
measured steps (ignore_eos) until the pool is full and preemption sets in.

Once `--fill` of the pool is held, `--publishes` publishes are measured, each after the steps
that take `--interval-s` at the measured step time (or `--publish-every` steps), as the server
publishes at most every 0.25 s. Every step: its host work (schedule + update and the plan's and
result's msgpack; the executor stands for the GPU and is not counted), then the flush of its token
events to a private redis-server (or `--redis-url`), as the server sends them. Every publish, as
scheduler/server.py makes it: build_snapshot (with its PackedTables) + encode, and the write,
which rides in the next flush of the step's events (the SET of the snapshot less a SET of a few
bytes: what it adds to that round trip). The result:

    publish_ms              median cost of one publish, and its parts (build, encode, redis)
    publish_cold_ms         the first publish, which packs every block table
    scheduler_step_ms       median host work of a step (schedule + update, msgpack), no model
    share_at_interval       publish_ms / max(interval, step): the share of the scheduler's time
                            spent publishing at most every `--interval-s` (0.25 s), as it does
    share_every_step        publish_ms / scheduler_step_ms: were it published after every step
    snapshot_bytes          the encoded snapshot's size

Step time here is the scheduler's own work alone, the smallest a real step can be (a step on a
GPU also runs the model), so both shares are upper bounds. The load average before the run is in
`load_1m`: on a shared machine every figure grows with it.

    pagoda bench publish --output benchmarks/results/2026-11-25-cpu-publish-overhead.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from common import streams
from common.config import EngineConfig
from common.plan_state import HeldSequence, PlanState
from common.protocol import RequestEvent, SampledToken, SamplingParams, StepPlan, StepResult, decode, encode
from pagoda.bench.common import command_words, header, log, write_result
from pagoda.bench.timing import median_ms, percentile
from scheduler.memory_view import PackedTables, build_snapshot
from scheduler.scheduler import Scheduler

EOS_TOKEN_IDS = [0, 2]
REPLIES = "pagoda:replies:bench-publish"
VOCAB = 49_152
NUM_CANDIDATES = 16  # top logprobs sent with each sample: enough for beam search of width 4


# ----------------------------------------------------------------------------- the executor


@dataclass
class ModelFreeExecutor:
    """A worker without a model that lets sequences share blocks: applies each plan's diffs
    (PlanState, as strict as the worker) and samples a seeded random token per sample, never an
    EOS token unless `eos_rate` > 0, with NUM_CANDIDATES top logprobs (beam search reads them)."""

    block_size: int
    seed: int = 0
    eos_rate: float = 0.0
    sliding_window: int | None = None  # the model's: the null block may stand where the window skips
    state: PlanState = field(init=False)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.state = PlanState(self.block_size, sliding_window=self.sliding_window)
        self.rng = random.Random(self.seed)

    @property
    def seqs(self) -> dict[int, HeldSequence]:
        return self.state.seqs

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.state.apply(plan)
        sampled = [self._sample(s.seq_id) for s in scheduled for _ in range(s.num_samples)]
        self.state.record_sampled(sampled)
        return StepResult(plan.step, plan.epoch, sampled)

    def _sample(self, seq_id: int) -> SampledToken:
        rng = self.rng
        first = EOS_TOKEN_IDS[0] if self.eos_rate and rng.random() < self.eos_rate else rng.randrange(3, VOCAB)
        tokens = [first] + rng.sample(range(3, VOCAB), NUM_CANDIDATES - 1)
        logprobs = sorted((-rng.expovariate(1.0) for _ in tokens), reverse=True)
        top = [[token, logprob] for token, logprob in zip(tokens, logprobs)]
        return SampledToken(seq_id, first, logprobs[0], top)


# ----------------------------------------------------------------------------- the workload


def add_mixed_requests(scheduler: Scheduler, count: int, rng: random.Random, max_tokens: int,
                       prompt_lens: tuple[int, int] = (64, 1200), system_prompts: int = 4,
                       system_len: int = 384) -> None:
    """`count` requests: a quarter open with one of `system_prompts` shared system prompts (the
    prefix cache shares their blocks), one in eight asks n=4 samples, one in sixteen beam search
    of width 4; the rest sample once. Prompt lengths are uniform in `prompt_lens`."""
    systems = [[rng.randrange(3, VOCAB) for _ in range(system_len)] for _ in range(system_prompts)]
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt_lens))]
        if i % 4 == 0:
            prompt = systems[i // 4 % system_prompts] + prompt
        if i % 16 == 1:
            params = SamplingParams(beam_width=4, n=4, temperature=0.0, max_tokens=max_tokens)
        elif i % 8 == 3:
            params = SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(f"r{i}", prompt, params)


def engine_config(num_blocks: int, block_size: int = 16) -> EngineConfig:
    """As a server runs: prefix caching and asynchronous scheduling on, 256 sequences a step."""
    return EngineConfig(block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=256,
                        max_num_batched_tokens=8192, max_model_len=8192)


# ----------------------------------------------------------------------------- the measurement


@dataclass
class Loop:
    """The scheduler process's step, one plan ahead (scheduler/server.py), the executor in process:
    each step's host work is schedule + encode the plan + decode the result + update. With a
    `stream`, each step's token events then go to Redis in one flush, as the server sends them."""

    scheduler: Scheduler
    executor: ModelFreeExecutor
    stream: object | None = None  # a scheduler/request_stream.RequestStream
    results: list[bytes] = field(default_factory=list)  # encoded, of the plans in flight

    def step(self) -> dict[str, float]:
        s, times = self.scheduler, {}
        while len(self.results) < 2:  # (the first step sends two plans)
            start = time.perf_counter()
            data = encode(s.schedule())
            times["schedule"] = times.get("schedule", 0.0) + time.perf_counter() - start
            self.results.append(encode(self.executor.execute(decode(data))))  # the GPU's part: not timed
        start = time.perf_counter()
        outputs = s.update(decode(self.results.pop(0)))
        times["update"] = time.perf_counter() - start
        if self.stream is not None:
            from scheduler.outbox import SendEvent  # (redis: not for the model-free executor's users)

            self.stream.outbox.entries += [
                SendEvent(REPLIES, RequestEvent(out.request_id, seq.new_token_ids, None, seq.finish_reason, None,
                                                seq.index))
                for out in outputs for seq in out.outputs if seq.num_new_tokens]
        return times

    def flush(self) -> float:
        """Send the step's events (and a snapshot if one waits); the seconds it took."""
        start = time.perf_counter()
        self.stream.flush()
        return time.perf_counter() - start


def publish_once(scheduler: Scheduler, stream, tables: PackedTables) -> tuple[dict[str, float], bytes]:
    """Build and encode a snapshot as scheduler/server.py does, and queue it for the next flush;
    its parts' seconds and the bytes."""
    t0 = time.perf_counter()
    snapshot = build_snapshot(scheduler, "0", stream.consumer, tables)
    t1 = time.perf_counter()
    data = encode(snapshot)
    stream.publish_memory(data)
    return {"build": t1 - t0, "encode": time.perf_counter() - t1}, data


def snapshot_write_cost(stream) -> float:
    """What writing the waiting snapshot adds to the flush it rides in (Outbox.flush sends it
    with the step's events, in their one round trip): a SET of it less a SET of a few bytes, back to
    back. The snapshot is written."""
    key, ttl_ms = streams.memory_key(stream.consumer), int(streams.STATUS_TTL_S * 1000)
    data, stream.outbox.memory = stream.outbox.memory, None
    start = time.perf_counter()
    stream.redis.set(key, data, px=ttl_ms)
    middle = time.perf_counter()
    stream.redis.set(key + ":probe", b"x", px=ttl_ms)
    return max(0.0, (middle - start) - (time.perf_counter() - middle))


def fill(loop: Loop, share: float, max_steps: int = 20_000) -> int:
    """Step until `share` of the pool is held (or nothing waits); returns the steps taken."""
    bm = loop.scheduler.block_manager
    for steps in range(max_steps):
        held = bm.num_total_blocks - bm.num_free_blocks
        if held >= share * bm.num_total_blocks or not loop.scheduler.waiting:
            return steps
        loop.step()
    raise RuntimeError(f"the pool was not {share:.0%} full after {max_steps} steps")


@dataclass
class Publishes:
    """What the publishes and the steps between them cost, in seconds, part by part."""
    cold: dict[str, float]  # the first publish, which packs every table
    step_parts: list[dict[str, float]] = field(default_factory=list)
    publish_parts: list[dict[str, float]] = field(default_factory=list)  # build, encode, redis
    sizes: list[int] = field(default_factory=list)  # the snapshots' bytes
    flushes: list[float] = field(default_factory=list)


def bench_publish(num_blocks: int, num_requests: int, publishes: int, share: float = 0.9, interval_s: float = 0.25,
                  publish_every: int = 0, seed: int = 0, redis_url: str | None = None, log=None) -> dict:
    """Fill a pool, then measure `publishes` publishes, each after `publish_every` steps (0: as many
    as take `interval_s` at the measured step time, as the server publishes), and every step."""
    config = engine_config(num_blocks)
    scheduler = Scheduler(config, num_blocks, config.max_model_len, EOS_TOKEN_IDS, num_blocks // 8)
    add_mixed_requests(scheduler, num_requests, random.Random(seed), max_tokens=4000, prompt_lens=(200, 3000))
    loop = Loop(scheduler, ModelFreeExecutor(config.block_size, seed))
    start = time.perf_counter()
    fill_steps = fill(loop, share)
    warm_ms = median_ms([sum(loop.step().values()) for _ in range(20)])
    publish_every = publish_every or max(1, round(interval_s * 1000 / warm_ms))
    if log:
        log(f"filled {share:.0%} of {num_blocks} blocks in {fill_steps} steps ({time.perf_counter() - start:.1f} s); "
            f"a step takes {warm_ms:.2f} ms: a publish every {publish_every} steps")
    measured = measure_publishes(loop, scheduler, publishes, publish_every, redis_url)
    return publish_result(scheduler, fill_steps, measured, publishes, publish_every, interval_s)


def measure_publishes(loop: Loop, scheduler: Scheduler, publishes: int, publish_every: int,
                      redis_url: str | None) -> Publishes:
    """One cold publish, then `publishes` publishes `publish_every` steps apart, to `redis_url` (else
    a private Redis)."""
    from common.config import ServingConfig
    from common.redis_server import RedisServer
    from scheduler.request_stream import RequestStream

    server = None if redis_url else RedisServer().start()
    try:
        loop.stream = stream = RequestStream(ServingConfig(redis_url=redis_url or server.url), "bench-publish")
        tables = PackedTables()
        cold, _ = publish_once(scheduler, stream, tables)  # the first packs every table
        loop.flush()
        measured = Publishes(cold)
        for _ in range(publishes):
            for _ in range(publish_every):
                measured.step_parts.append(loop.step())
                measured.flushes.append(loop.flush())
            parts, data = publish_once(scheduler, stream, tables)
            parts["redis"] = snapshot_write_cost(stream)
            measured.publish_parts.append(parts)
            measured.sizes.append(len(data))
        key = streams.memory_key(stream.consumer)
        stream.redis.delete(REPLIES, key, key + ":probe")
    finally:
        if server is not None:
            server.stop()
    return measured


def publish_result(scheduler: Scheduler, fill_steps: int, measured: Publishes, publishes: int, publish_every: int,
                   interval_s: float) -> dict:
    """The pool's state, the publishes' and the steps' times in ms, and the share of the scheduler's
    time publishing takes."""
    step_parts, publish_parts = measured.step_parts, measured.publish_parts
    snapshot = build_snapshot(scheduler)
    step_ms = median_ms([sum(p.values()) for p in step_parts])
    publish_ms = median_ms([sum(p.values()) for p in publish_parts])
    return {
        "fill_steps": fill_steps,
        "state": {
            "sequences": len(snapshot.sequences), "requests_running": len(scheduler.running),
            "requests_swapped": len(scheduler.swapped), "requests_waiting": len(scheduler.waiting),
            "blocks_in_tables": sum(map(len, scheduler.block_manager.block_tables.values())),
            "events_in_snapshot": len(snapshot.events), **{k: snapshot.stats[k] for k in (
                "num_used_blocks", "num_shared_blocks", "blocks_saved_by_sharing", "num_cached_blocks",
                "num_free_blocks", "num_cow_copies", "num_preemptions")},
        },
        "publishes": publishes,
        "publish_every_steps": publish_every,
        "steps": len(step_parts),
        "publish_ms": publish_ms,
        "publish_p90_ms": round(percentile([sum(p.values()) for p in publish_parts], 90) * 1e3, 4),
        "publish_parts_ms": {k: median_ms([p[k] for p in publish_parts]) for k in ("build", "encode", "redis")},
        "flush_ms": median_ms(measured.flushes),
        "publish_cold_ms": round(sum(measured.cold.values()) * 1000, 4),
        "scheduler_step_ms": step_ms,
        "scheduler_step_parts_ms": {k: median_ms([p[k] for p in step_parts]) for k in ("schedule", "update")},
        "interval_s": interval_s,
        "share_at_interval": round(publish_ms / max(interval_s * 1000, step_ms), 5),
        "share_every_step": round(publish_ms / step_ms, 4),
        "snapshot_bytes": int(statistics.median(measured.sizes)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench publish`'s flags."""
    parser.add_argument("--num-blocks", type=int, default=30_000, help="the KV pool, in blocks")
    parser.add_argument("--num-requests", type=int, default=300, help="requests of the mixed workload")
    parser.add_argument("--fill", type=float, default=0.9, help="share of the pool held before measuring")
    parser.add_argument("--publishes", type=int, default=30, help="publishes measured")
    parser.add_argument("--interval-s", type=float, default=0.25, help="the server's publishing interval")
    parser.add_argument("--publish-every", type=int, default=0,
                        help="steps between two publishes (0: those that take --interval-s at the measured step time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", help="publish to this Redis (default: a private redis-server)")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench publish` command."""
    load_1m = os.getloadavg()[0]  # a shared machine's load, before the run
    measured = bench_publish(args.num_blocks, args.num_requests, args.publishes, args.fill, args.interval_s,
                             args.publish_every, args.seed, args.redis_url, log)
    result = {
        **header("publish", command_words("publish", args)),
        "load_1m": round(load_1m, 2),
        "model": "none (ModelFreeExecutor: seeded random tokens with 16 candidates)",
        "workload": {
            "num_blocks": args.num_blocks, "block_size": 16, "num_cpu_blocks": args.num_blocks // 8,
            "num_requests": args.num_requests, "prompt_tokens": "uniform in [200, 3000]",
            "mix": "1/4 open with one of 4 shared 384-token system prompts (prefix cache); 1/8 n=4; 1/16 beam "
                   "search width 4; the rest one sample; all decode past the measured steps",
            "engine": "max_num_seqs 256, max_num_batched_tokens 8192, prefix caching, async scheduling",
            "filled": f"{args.fill:.0%} of the pool held before measuring",
        },
        "metrics_doc": {
            "publish_ms": "median of build_snapshot + encode + its Redis write (a private redis-server), one "
                          "publish every publish_every_steps steps (the steps of interval_s at the measured step "
                          "time); the write rides in the flush of the step's events: its cost is a SET of the "
                          "snapshot less a SET of a few bytes, back to back",
            "flush_ms": "median flush of a step's token events (not counted in the step, nor in the publish)",
            "publish_cold_ms": "the first publish, which packs every block table (later ones pack what changed)",
            "scheduler_step_ms": "median host work of a step: schedule + encode plan + decode result + update "
                                 "(no model: a real step is longer, so the shares are upper bounds)",
            "share_at_interval": "publish_ms / max(interval, step): the server publishes at most every interval_s",
            "share_every_step": "publish_ms / scheduler_step_ms, were it published after every step",
        },
        **measured,
    }
    write_result(result, args.output)
    print(f"publish {result['publish_ms']:.3f} ms (build {result['publish_parts_ms']['build']:.3f}, encode "
          f"{result['publish_parts_ms']['encode']:.3f}, redis {result['publish_parts_ms']['redis']:.3f}); "
          f"scheduler step {result['scheduler_step_ms']:.3f} ms; share at {args.interval_s:g} s: "
          f"{result['share_at_interval']:.3%}, every step: {result['share_every_step']:.1%}")
    return 0
