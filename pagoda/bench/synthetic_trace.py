"""A synthetic memory trace of a large pool, to time the memory page's drawing (docs/dashboard.md):

    python -m pagoda.bench.synthetic_trace --num-blocks 100000 --output big.jsonl
    pagoda bench memory --replay big.jsonl --output big.html
    chromium --headless --window-size=1440,1000 --dump-dom "file://$PWD/big.html#timings" | grep -o 'drew [0-9][^<]*'

The page opened at `#timings` draws every snapshot once and writes the median draw times into its
status line. Each snapshot agrees with itself (common.memory_snapshot.check_snapshot) and looks like
a busy engine: requests of 1 to 4 samples sharing their prompt's blocks, system prompts shared across
requests (as the prefix cache shares them), some requests swapped out to the CPU pool, blocks held
only by the prefix cache, free blocks, and every sequence gaining a token per snapshot.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field

BLOCK_SIZE = 16
MAX_EVENT_BLOCKS = 32  # an event lists at most its first 32 blocks (num_blocks counts them all)


@dataclass(slots=True)
class _Seq:
    request_id: str
    seq_id: int
    pool: str
    block_table: list[int]
    num_slots: int
    status: str = "running"


@dataclass(slots=True)
class _Pool:
    """What the synthetic engine holds; allocate() pops a shuffled free list."""

    rng: random.Random
    num_blocks: int
    num_cpu_blocks: int
    free: list[int] = field(default_factory=list)
    cpu_free: list[int] = field(default_factory=list)
    seqs: list[_Seq] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    next_event_id: int = 1

    def __post_init__(self) -> None:
        self.free = list(range(1, self.num_blocks))  # block 0: the null block
        self.cpu_free = list(range(self.num_cpu_blocks))
        self.rng.shuffle(self.free)
        self.rng.shuffle(self.cpu_free)

    def allocate(self, n: int, pool: str = "gpu") -> list[int]:
        free = self.free if pool == "gpu" else self.cpu_free
        return [free.pop() for _ in range(n)]

    def record(self, step: int, time: float, kind: str, request_id: str, seq_id: int, blocks: list[int]) -> None:
        self.events.append({"id": self.next_event_id, "step": step, "time": time, "kind": kind, "request_id": request_id,
                            "seq_id": seq_id, "blocks": blocks[:MAX_EVENT_BLOCKS], "num_blocks": len(blocks)})
        self.next_event_id += 1
        del self.events[:-256]


def _fill(pool: _Pool, step: int, time: float) -> None:
    """Requests until 60% of the device pool is in tables, then 5% of it cached."""
    rng, bs = pool.rng, BLOCK_SIZE
    system_prompts = [pool.allocate(rng.randint(8, 32)) for _ in range(4)]
    seq_id, target = 0, int(0.6 * pool.num_blocks)
    held = sum(map(len, system_prompts))
    while held < target:
        request_id = f"cmpl-{rng.getrandbits(64):016x}-0"
        n = rng.choice((1, 1, 1, 2, 4))
        swapped = rng.random() < 0.1 and len(pool.cpu_free) > 200
        where = "cpu" if swapped else "gpu"
        prefix = [] if swapped or rng.random() < 0.5 else rng.choice(system_prompts)
        prompt = prefix + pool.allocate(rng.randint(4, 48), where)
        for sample in range(n):
            own = pool.allocate(rng.randint(1, 6), where)
            pool.seqs.append(_Seq(request_id, seq_id, where, prompt + own, (len(prompt) + len(own) - 1) * bs
                                  + rng.randint(1, bs), "swapped" if swapped else "running"))
            if sample:
                pool.record(step, time, "fork", request_id, seq_id, prompt)
            seq_id += 1
            held += 0 if swapped else len(own)
        held += 0 if swapped else len(prompt) - len(prefix)
        if prefix:
            pool.record(step, time, "prefix_hit", request_id, -1, prefix)
        if swapped:
            pool.record(step, time, "swap_out", request_id, -1, rng.sample(range(1, pool.num_blocks), len(prompt)))
    pool.cached = sorted(pool.allocate(pool.num_blocks // 20))


def _advance(pool: _Pool, step: int, time: float) -> None:
    """Every running sequence writes one token (a new block when its last is full), a request's blocks
    evicted from the prefix cache now and then."""
    for seq in pool.seqs:
        if seq.pool == "gpu":
            if seq.num_slots == len(seq.block_table) * BLOCK_SIZE:
                seq.block_table = seq.block_table + pool.allocate(1)
            seq.num_slots += 1
    evicted = pool.cached[:pool.rng.randint(1, 40)]
    del pool.cached[:len(evicted)]
    pool.free.extend(evicted)
    pool.record(step, time, "prefix_evict", "", -1, evicted)


def _snapshot(pool: _Pool, index: int, step: int, time: float) -> dict:
    counts = {"gpu": [0] * pool.num_blocks, "cpu": [0] * pool.num_cpu_blocks}
    last_fill: dict[int, int] = {}
    logical = 0
    for seq in pool.seqs:
        pool_counts = counts[seq.pool]
        for block in seq.block_table:
            pool_counts[block] += 1
        if seq.pool == "gpu":
            logical += len(seq.block_table)
            fill = seq.num_slots - (len(seq.block_table) - 1) * BLOCK_SIZE
            last_fill[seq.block_table[-1]] = max(last_fill.get(seq.block_table[-1], 0), fill)
    ref_counts = counts["gpu"]
    held = len(ref_counts) - ref_counts.count(0)
    running = {s.request_id for s in pool.seqs if s.status == "running"}
    return {
        "engine": "0", "scheduler_id": "synthetic", "time": time, "step": step, "version": index + 1,
        "block_size": BLOCK_SIZE, "num_gpu_blocks": pool.num_blocks, "num_cpu_blocks": pool.num_cpu_blocks,
        "ref_counts": ref_counts, "cpu_ref_counts": counts["cpu"], "cached": sorted(pool.cached),
        "sequences": [{"request_id": s.request_id, "seq_id": s.seq_id, "status": s.status, "num_tokens": s.num_slots,
                       "num_slots": s.num_slots, "pool": s.pool, "block_table": s.block_table} for s in pool.seqs],
        "events": list(pool.events),
        "stats": {
            "num_running": len(running), "num_waiting": 0,
            "num_swapped": len({s.request_id for s in pool.seqs} - running), "num_preemptions": 0,
            "allocated_slots": held * BLOCK_SIZE,
            "token_slots": held * BLOCK_SIZE - sum(BLOCK_SIZE - fill for fill in last_fill.values()),
            "num_free_blocks": pool.num_blocks - 1 - held - len(pool.cached), "num_cached_blocks": len(pool.cached),
            "num_used_blocks": held, "num_shared_blocks": held - ref_counts.count(1),
            "blocks_saved_by_sharing": logical - held, "num_cow_copies": 0, "num_swapped_out_blocks": 0,
            "num_swapped_in_blocks": 0, "num_prefix_evictions": 0,
        },
    }


def synthetic_trace(num_blocks: int = 100_000, num_snapshots: int = 10, seed: int = 0) -> list[dict]:
    """`num_snapshots` engine snapshots (the JSON of common/memory_snapshot.py) of a pool of `num_blocks`
    device blocks (the null block included), each a step on from the last."""
    if num_blocks < 1000:
        raise ValueError(f"--num-blocks {num_blocks}: at least 1000 (the requests need room)")
    pool = _Pool(random.Random(seed), num_blocks, max(256, num_blocks // 16))
    snapshots, step, time = [], 1, 1_764_000_000.0
    _fill(pool, step, time)
    for index in range(num_snapshots):
        if index:
            step, time = step + 4, time + 0.25
            _advance(pool, step, time)
        snapshots.append(_snapshot(pool, index, step, time))
    return snapshots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench.synthetic_trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=100_000, help="device blocks, the null block included")
    parser.add_argument("--num-snapshots", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="the trace, JSON Lines (`pagoda bench memory --replay` reads it)")
    args = parser.parse_args(argv)
    snapshots = synthetic_trace(args.num_blocks, args.num_snapshots, args.seed)
    with open(args.output, "w", encoding="utf-8") as out:
        for snapshot in snapshots:
            out.write(json.dumps(snapshot, separators=(",", ":")) + "\n")
    print(f"wrote {args.output}: {len(snapshots)} snapshots of {args.num_blocks} blocks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
