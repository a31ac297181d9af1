"""The memory page's data from the real Scheduler: scheduler/memory_view.py's snapshot, through the
wire (encode/decode) and common/memory_snapshot.py's JSON, against the block manager it reads.

A hypothesis model drives random workloads (samples n > 1 and best_of, beam search, shared
prefixes with prefix caching, preemption by swap and by recompute in a small pool, aborts, serial
and overlapped steps) through schedule() / update() with pagoda/bench/publish.py's model-free
executor, and after every step checks the snapshot against the scheduler and the events against
the plans.
"""
from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import EngineConfig
from common.memory_snapshot import check_snapshot, pack_ints, pack_raw, snapshot_json, unpack_ints
from common.protocol import NULL_BLOCK, SamplingParams, StepPlan, decode, encode
from pagoda.bench.publish import EOS_TOKEN_IDS, ModelFreeExecutor
from scheduler import memory_view
from scheduler.memory_view import PackedTables, build_snapshot, memory_version, status_counters
from scheduler.preemption import PreemptionCosts
from scheduler.scheduler import RequestRejected, Scheduler

BLOCK_SIZE = 8
MAX_MODEL_LEN = 128


# ----------------------------------------------------------------------------- the workload


@st.composite
def requests(draw) -> dict:
    kind = draw(st.sampled_from(["single", "single", "parallel", "best_of", "beam"]))
    width = draw(st.integers(2, 4))
    params = {
        "single": SamplingParams(temperature=1.0, max_tokens=draw(st.integers(1, 32))),
        "parallel": SamplingParams(n=width, temperature=1.0, seed=draw(st.integers(0, 99)),
                                   max_tokens=draw(st.integers(1, 24))),
        "best_of": SamplingParams(n=1, best_of=width, temperature=1.0, max_tokens=draw(st.integers(1, 16))),
        "beam": SamplingParams(beam_width=width, n=width, temperature=0.0, max_tokens=draw(st.integers(1, 12))),
    }[kind]
    return {
        "prefix": draw(st.sampled_from([None, 0, 1, 0, 1])),  # one of two shared prefixes (24 tokens: 3 blocks)
        "prompt_len": draw(st.integers(1, 40)),
        "params": params,
        "arrival": draw(st.integers(0, 16)),  # the step it is added at
        "abort": draw(st.one_of(st.none(), st.integers(0, 30))),  # steps after its arrival
    }


WORKLOADS = st.fixed_dictionaries({
    "requests": st.lists(requests(), min_size=2, max_size=12),
    "num_gpu_blocks": st.integers(20, 40),
    "num_cpu_blocks": st.sampled_from([0, 16, 40, 40]),
    "preemption_mode": st.sampled_from(["swap", "recompute", "auto"]),
    "enable_prefix_caching": st.booleans(),
    "cpu_prefix_cache": st.booleans(),  # on only with prefix caching and a swap pool
    "async_scheduling": st.booleans(),
    "eos_rate": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(0, 2**16),
    "publish_every": st.integers(2, 9),  # steps between a second publisher's snapshots
    "sliding_window": st.sampled_from([None, None, 8, 12, 24]),  # tables with null entries
})


class RecordingExecutor(ModelFreeExecutor):
    """Keeps the plans it has run since the test last took them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan):
        self.plans.append(plan)
        return super().execute(plan)


def make_scheduler(w: dict) -> tuple[Scheduler, RecordingExecutor]:
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=96,
                          max_model_len=MAX_MODEL_LEN,
                          enable_prefix_caching=w["enable_prefix_caching"], async_scheduling=w["async_scheduling"],
                          preemption_mode=w["preemption_mode"], cpu_prefix_cache=w.get("cpu_prefix_cache", False))
    # the measured rates `auto` compares: swapping and recomputing cost alike, so both happen
    costs = PreemptionCosts(kv_bytes_per_block=1000, host_bandwidth=1e6, prefill_tokens_per_s=2000.0)
    window = w.get("sliding_window")
    scheduler = Scheduler(config, w["num_gpu_blocks"], MAX_MODEL_LEN, EOS_TOKEN_IDS, w["num_cpu_blocks"], costs,
                          sliding_window=window)
    return scheduler, RecordingExecutor(BLOCK_SIZE, w["seed"], w["eos_rate"], window)


# ----------------------------------------------------------------------------- the checks


def check_against_scheduler(scheduler: Scheduler, snapshot: dict) -> None:
    bm = scheduler.block_manager
    assert check_snapshot(snapshot) == []
    assert snapshot["ref_counts"] == bm.ref_counts
    assert snapshot["cpu_ref_counts"] == bm.cpu_ref_counts
    assert (snapshot["num_gpu_blocks"], snapshot["num_cpu_blocks"]) == (bm.num_blocks, bm.num_cpu_blocks)
    # every cached block is one the prefix cache can hand out on a hit or evict: registered, unheld
    assert sorted(snapshot["cached"]) == sorted(bm.evictable)
    for block in snapshot["cached"]:
        key = bm.block_key[block]
        assert key is not None and bm.cached_blocks[key] == block and bm.ref_counts[block] == 0
    assert sorted(snapshot["cpu_cached"]) == sorted(bm.cpu_cached.values())  # the CPU tier's
    assert bm.enable_cpu_tier == (scheduler.config.cpu_prefix_cache and bm.enable_prefix_caching
                                  and bm.num_cpu_blocks > 0)
    expected = []
    for pool, tables in (("gpu", bm.block_tables), ("cpu", bm.cpu_tables)):
        for seq_id, table in tables.items():
            seq = scheduler._seqs[seq_id]
            expected.append({"request_id": scheduler._group_of_seq[seq_id].request_id, "seq_id": seq_id,
                             "status": seq.status.value, "num_tokens": seq.num_tokens,
                             "num_slots": bm.num_slots[seq_id], "pool": pool, "block_table": table})
    assert snapshot["sequences"] == expected
    check_gauges(scheduler, snapshot)


def check_gauges(scheduler: Scheduler, snapshot: dict) -> None:
    """The gauges against a count block by block (memory_view counts per table, in C)."""
    bm, bs = scheduler.block_manager, BLOCK_SIZE
    fill: dict[int, int] = {}  # device block -> slots holding token states, the most any holder fills
    for seq_id, table in bm.block_tables.items():
        for i, block in enumerate(table):
            if block != NULL_BLOCK:  # an entry outside the sliding window holds nothing
                filled = min(bs, bm.num_slots[seq_id] - i * bs)
                fill[block] = max(fill.get(block, 0), filled)
    stats = snapshot["stats"]
    assert stats["allocated_slots"] == len(fill) * bs
    assert stats["token_slots"] == sum(fill.values())
    assert stats["num_shared_blocks"] == sum(1 for count in bm.ref_counts if count > 1)
    logical = sum(len(table) - table.count(NULL_BLOCK) for table in bm.block_tables.values())
    assert stats["blocks_saved_by_sharing"] == logical - len(fill)
    assert bm.sharing_stats() == (logical, bm.num_total_blocks - bm.num_free_blocks)
    assert stats["num_cached_blocks"] == len(bm.evictable)
    assert stats["num_free_blocks"] == len(bm.free_queue)
    assert (stats["num_running"], stats["num_waiting"], stats["num_swapped"]) == (
        len(scheduler.running), len(scheduler.waiting), len(scheduler.swapped))
    counters = status_counters(scheduler)
    assert (counters["num_shared_blocks"], counters["num_blocks_saved_by_sharing"]) == (
        stats["num_shared_blocks"], stats["blocks_saved_by_sharing"])
    assert counters["num_cow_copies_total"] == stats["num_cow_copies"] == scheduler.num_cow_copies


def check_events(events: list[dict], plans: list[StepPlan]) -> None:
    """The plans' copies and swaps are the events of their steps, in order; an event keeps the
    first MAX_EVENT_BLOCKS of its blocks and counts them all."""
    for e in events:
        assert len(e["blocks"]) == min(e["num_blocks"], memory_view.MAX_EVENT_BLOCKS)
    for plan in plans:
        of_step = [e for e in events if e["step"] == plan.step]
        assert [e["blocks"] for e in of_step if e["kind"] == "cow"] == plan.blocks_to_copy
        # a group's swaps, then the CPU tier's copies (--cpu-prefix-cache)
        check_blocks([e for e in of_step if e["kind"] in ("swap_out", "tier_store")],
                     [gpu for gpu, _ in plan.blocks_to_swap_out])
        check_blocks([e for e in of_step if e["kind"] in ("swap_in", "tier_load")],
                     [gpu for _, gpu in plan.blocks_to_swap_in])
        for e in of_step:
            if e["kind"] == "recompute":  # its sequences leave the workers in that plan
                assert e["blocks"]
            assert NULL_BLOCK not in e["blocks"]  # every event names device blocks held or let go, never the null block
        assert len([e for e in of_step if e["kind"] == "window"]) <= 1  # one per step, of every sequence


def check_blocks(events: list[dict], blocks: list[int]) -> None:
    """`blocks`, in order, are those of `events`, each event's first ones kept."""
    start = 0
    for e in events:
        assert e["blocks"] == blocks[start:start + e["num_blocks"]][:memory_view.MAX_EVENT_BLOCKS]
        start += e["num_blocks"]
    assert start == len(blocks)


def take_snapshot(scheduler: Scheduler, tables: PackedTables) -> dict:
    """Through the wire, its block tables packed by what `tables` packed before (as the server does)."""
    return snapshot_json(decode(encode(build_snapshot(scheduler, "0", "test", tables))))


# ----------------------------------------------------------------------------- the property


def run_workload(w: dict) -> set[str]:
    """Drive the workload to its end, checking after every step; returns the kinds of events seen."""
    scheduler, executor = make_scheduler(w)
    rng = random.Random(w["seed"])
    prefixes = [[rng.randrange(3, 1000) for _ in range(24)] for _ in range(2)]
    pending = sorted(enumerate(w["requests"]), key=lambda item: item[1]["arrival"])
    aborts: dict[int, list[str]] = {}
    results, last_event_id, kinds, tables, sparse_tables = [], 0, set(), PackedTables(), PackedTables()
    for step in range(400):
        while pending and pending[0][1]["arrival"] <= step:
            i, r = pending.pop(0)
            prompt = (prefixes[r["prefix"]] if r["prefix"] is not None else []) + [
                rng.randrange(3, 1000) for _ in range(r["prompt_len"])]
            try:
                scheduler.add_request(f"r{i}", prompt, r["params"])
            except RequestRejected:
                continue
            if r["abort"] is not None:
                aborts.setdefault(step + r["abort"], []).append(f"r{i}")
        for request_id in aborts.pop(step, []):
            scheduler.abort_request(request_id)
        if not (scheduler.has_unfinished_requests() or pending or results):
            break
        version = memory_version(scheduler)
        if scheduler.has_unfinished_requests():
            while len(results) < (2 if w["async_scheduling"] else 1):
                results.append(executor.execute(decode(encode(scheduler.schedule()))))
            scheduler.update(results.pop(0))
            assert memory_version(scheduler) != version  # a step changes the version the server compares
        elif results:  # every request ended with a plan in flight: its result comes all the same
            scheduler.update(results.pop(0))
        scheduler.block_manager.check_integrity()
        snapshot = take_snapshot(scheduler, tables)
        check_against_scheduler(scheduler, snapshot)
        if step % w["publish_every"] == 0:  # what changed over several steps is packed right too
            assert take_snapshot(scheduler, sparse_tables)["sequences"] == snapshot["sequences"]
        new_events = [e for e in snapshot["events"] if e["id"] > last_event_id]
        assert [e["id"] for e in new_events] == list(range(last_event_id + 1, last_event_id + 1 + len(new_events)))
        check_events(new_events, executor.plans)
        executor.plans.clear()
        kinds.update(e["kind"] for e in new_events)
        last_event_id = new_events[-1]["id"] if new_events else last_event_id
    else:
        raise AssertionError("the workload did not end in 400 steps")
    snapshot = take_snapshot(scheduler, tables)
    assert snapshot["sequences"] == [] and set(snapshot["ref_counts"]) == {0}
    return kinds


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WORKLOADS)
def test_the_snapshot_agrees_with_the_scheduler_and_the_events_with_the_plans(w):
    run_workload(w)


def crowded(mode: str, sliding_window: int | None = None) -> dict:
    """Eight requests sharing a prefix, with samples and beams, in a pool too small for them
    (sixteen with a sliding window, which gives blocks back)."""
    kinds = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20),
             SamplingParams(beam_width=3, n=3, temperature=0.0, max_tokens=12),
             SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)]
    return {
        "requests": [{"prefix": i % 2, "prompt_len": 5 + 3 * (i % 8), "params": kinds[i % 3], "arrival": i // 2,
                      "abort": 9 if i == 5 else None} for i in range(8 if sliding_window is None else 16)],
        "num_gpu_blocks": 24, "num_cpu_blocks": 48, "preemption_mode": mode, "enable_prefix_caching": True,
        "async_scheduling": True, "eos_rate": 0.0, "seed": 7, "publish_every": 5, "sliding_window": sliding_window,
    }


@pytest.mark.parametrize("mode, window, expected", [
    ("swap", None, {"fork", "cow", "swap_out", "swap_in", "prefix_hit", "prefix_evict"}),
    ("recompute", None, {"fork", "cow", "recompute", "prefix_hit", "prefix_evict"}),
    ("swap", 8, {"fork", "cow", "swap_out", "swap_in", "prefix_hit", "prefix_evict", "window"}),  # 16 requests
    ("recompute", 8, {"fork", "cow", "recompute", "prefix_hit", "prefix_evict", "window"}),
    ("recompute", "cpu-tier", {"fork", "cow", "recompute", "prefix_hit", "prefix_evict", "tier_store", "tier_load"}),
])
def test_a_crowded_pool_shows_every_kind_of_event(mode, window, expected, monkeypatch):
    """The property's checks do meet each kind of event (a random workload may miss some), with
    events of more blocks than an event keeps (3 here, 32 in earnest), and tables with null
    entries (a sliding window of 8 tokens, one block), and the copies of the prefix cache's CPU tier."""
    monkeypatch.setattr(memory_view, "MAX_EVENT_BLOCKS", 3)
    tier = window == "cpu-tier"
    workload = crowded(mode, None if tier else window)
    workload["cpu_prefix_cache"] = tier
    assert run_workload(workload) == expected


def test_a_copy_on_write_of_a_request_that_fails_while_planned_is_neither_counted_nor_logged():
    """Scheduler._fail takes a failed group's copies out of the plan: its counter and events follow."""
    config = EngineConfig(block_size=16, async_scheduling=False)
    scheduler = Scheduler(config, 64, 512, EOS_TOKEN_IDS)
    scheduler.isolate_failures = True
    executor = ModelFreeExecutor(16, seed=1)
    scheduler.add_request("n2", list(range(3, 43)), SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    scheduler.add_request("solo", list(range(50, 90)), SamplingParams(max_tokens=8, ignore_eos=True))
    scheduler.update(executor.execute(scheduler.schedule()))  # prefilled; n2 forked, sharing its 3 blocks
    add_to_plan = scheduler._add_to_plan

    def fail_n2(seqs, *args):
        if scheduler._group_of_seq[seqs[0].seq_id].request_id == "n2":
            raise RuntimeError("planned to fail")
        return add_to_plan(seqs, *args)

    scheduler._add_to_plan = fail_n2  # after _grow copied n2's shared last block on write
    plan = scheduler.schedule()
    assert [(f.request_id, f.error) for f in scheduler.take_failed()] == [("n2", "RuntimeError: planned to fail")]
    assert plan.blocks_to_copy == [] and scheduler.num_cow_copies == 0
    assert [e.kind for e in scheduler.memory_events.events] == ["fork"]
    del scheduler._add_to_plan
    scheduler.update(executor.execute(plan))
    scheduler.add_request("n2-again", list(range(3, 43)), SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    for _ in range(2):
        scheduler.update(executor.execute(scheduler.schedule()))
    cows = [e for e in scheduler.memory_events.events if e.kind == "cow"]
    assert len(cows) == scheduler.num_cow_copies == 1  # a copy the plan makes is counted and logged


@pytest.mark.parametrize("data, message", [
    (b"", "packed ints are bytes starting with their width, not bytes b''"),
    ([1, 2], "packed ints are bytes starting with their width, not list [1, 2]"),
    (b"\x03\x01\x02\x03", "packed ints of width 3: 1, 2 or 4 expected"),
    (b"\x00", "packed ints of width 0: 1, 2 or 4 expected"),
    (b"\x02\x01\x02\x03", "bytes length not a multiple of item size"),
])
def test_ints_that_pack_ints_did_not_make_are_a_value_error(data, message):
    """What the gateway skips, per key, in a malformed snapshot (gateway/engine_client.py)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        unpack_ints(data)


@pytest.mark.parametrize("values, width", [
    ([], 1), ([0, 1, 255], 1), ([0, 1, 300, 2], 2), ([7, 65535], 2), ([65536, 3], 4), ([2**32 - 1], 4),
])
def test_ints_travel_in_the_narrowest_width_that_holds_them(values, width):
    packed = pack_ints(values)
    assert packed[0] == width and len(packed) == 1 + width * len(values)
    assert unpack_ints(packed) == values
    assert unpack_ints(packed[:1] + pack_raw(values, width)) == values


def test_a_table_that_gains_a_wider_block_id_is_packed_again():
    tables, table = PackedTables(), [1, 2]
    assert tables.pack([(0, table)]) == [pack_ints([1, 2])]
    table += [3, 70_000]
    assert tables.pack([(0, table)]) == [pack_ints([1, 2, 3, 70_000])] and pack_ints(table)[0] == 4
    table[-1] = 9  # copy-on-write of the last block
    assert tables.pack([(0, table)]) == [pack_ints([1, 2, 3, 9])]


def test_a_contiguous_allocator_is_drawn_from_its_tables():
    """The Orca-style baselines (`--allocator orca-*`) keep no reference counts: they are counted."""
    config = EngineConfig(block_size=BLOCK_SIZE, allocator="orca-max", enable_prefix_caching=False,
                          async_scheduling=False, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(config, 64, MAX_MODEL_LEN, EOS_TOKEN_IDS)
    executor = ModelFreeExecutor(BLOCK_SIZE, seed=3)
    for i in range(2):
        scheduler.add_request(f"r{i}", list(range(3, 23 + i)), SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        scheduler.update(executor.execute(scheduler.schedule()))
    snapshot = take_snapshot(scheduler, PackedTables())
    bm = scheduler.block_manager
    assert check_snapshot(snapshot) == [] and snapshot["cached"] == [] and snapshot["cpu_ref_counts"] == []
    assert [(s["request_id"], s["block_table"]) for s in snapshot["sequences"]] == [
        (f"r{i}", bm.block_tables[seq_id]) for i, seq_id in enumerate(bm.block_tables)]
    assert sum(snapshot["ref_counts"]) == sum(map(len, bm.block_tables.values())) == 6  # 3 blocks of 8 each
    assert status_counters(scheduler)["num_shared_blocks"] == 0
