"""Cache-aware routing: the gateway's router (gateway/router.py) over KV events in a
real redis-server, and a scheduler's side of the per-group streams (scheduler/request_stream.py):
its own stream first, then the shared one, stealing what a busy group left unread, taking over a
dead scheduler's requests from any stream. The real stack's tests are in tests/test_data_parallel.py."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import redis
import redis.asyncio as aioredis

from common import streams
from common.block_hash import lora_salt, prompt_block_hashes
from common.config import ServingConfig
from common.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch, encode_batch
from common.protocol import GenerateRequest, LoRARequest, SamplingParams, SchedulerStatus, encode
from gateway.router import PrefixRouter
from scheduler import inbox, request_stream
from scheduler.block_manager import BlockManager
from scheduler.sequence import RequestOutput

BLOCK = 16
SYSTEM_A = list(range(1000, 1000 + 3 * BLOCK))  # 3 full blocks
SYSTEM_B = list(range(5000, 5000 + 3 * BLOCK))


def status(engine: str, running: int = 0, waiting: int = 0, ready: bool = True, draining: bool = False
           ) -> SchedulerStatus:
    return SchedulerStatus(
        scheduler_id=f"sched-{engine}", model="m", max_model_len=4096, block_size=BLOCK, max_request_tokens=10_000,
        max_num_seqs=8, max_num_batched_tokens=2048, enable_chunked_prefill=True, num_gpu_blocks=100,
        workers_ready=ready, num_running=running, num_waiting=waiting, num_swapped=0, kv_cache_usage=0.0,
        num_preemptions_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0, updated_at=time.time(),
        engine=engine, draining=draining)


def request(request_id: str, tokens: list[int], lora: LoRARequest | None = None) -> GenerateRequest:
    return GenerateRequest(request_id, tokens, SamplingParams(max_tokens=4), "replies", time.time(), lora)


def cache(r: redis.Redis, engine: str, tokens: list[int], salt: bytes | None = None) -> list[bytes]:
    """The KV events a scheduler of `engine` publishes after computing `tokens`: its block manager's own."""
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True)
    bm.record_kv_events()
    bm.allocate(1, len(tokens), token_ids=tokens, salt=salt)
    bm.register_computed(1, tokens, len(tokens))
    events = bm.take_kv_events()[1:]  # after the AllBlocksCleared a new scheduler starts with
    r.xadd(streams.kv_events_stream(engine), {streams.KV_EVENTS_FIELD: encode_batch(KVEventBatch(0.0, events, engine))})
    return [h for e in events for h in e.block_hashes]


def route(router: PrefixRouter, req: GenerateRequest, statuses: list[SchedulerStatus]) -> str:
    router._events_read_at = 0.0  # read the events now
    return router.loop.run_until_complete(router.route(req, statuses))


@pytest.fixture
def make_router(redis_url, r):
    """Routers on one event loop (the Redis client's connections belong to it)."""
    loop = asyncio.new_event_loop()
    client = aioredis.from_url(redis_url)

    def make(mode: str = "cache_aware", margin: int = 2) -> PrefixRouter:
        router = PrefixRouter(client, mode, margin)
        router.loop = loop
        return router

    yield make
    loop.run_until_complete(client.aclose())
    loop.close()


@pytest.fixture
def router(make_router):
    return make_router()


def test_the_gateways_block_hashes_are_the_schedulers(r):
    """The router hashes a prompt as the scheduler's registry keys it, also under a LoRA adapter's salt."""
    tokens = SYSTEM_A + [7, 8, 9]  # a partial last block is never cached
    assert cache(r, "0", tokens) == prompt_block_hashes(tokens, BLOCK)
    salt = lora_salt(3, "/adapters/sql")
    assert cache(r, "0", tokens, salt) == prompt_block_hashes(tokens, BLOCK, salt)
    assert prompt_block_hashes(tokens, BLOCK, salt) != prompt_block_hashes(tokens, BLOCK)
    assert len(prompt_block_hashes(tokens, BLOCK)) == 3


def test_a_prompt_goes_to_the_group_holding_its_longest_cached_prefix(router, r):
    cache(r, "0", SYSTEM_A[:BLOCK])  # one block of A
    cache(r, "1", SYSTEM_A)  # all three
    groups = [status("0"), status("1")]
    assert route(router, request("a", SYSTEM_A + [1, 2]), groups) == "pagoda:requests:1"
    assert router.routed == {("1", "cache_hit"): 1} and router.outstanding == {"1": 1}
    router.finished("a")
    assert router.outstanding["1"] == 0
    # a LoRA adapter's prompt shares no block with the base model's: no hit, the group holding
    # fewer blocks (1 against 3), though it is the busier
    lora = LoRARequest("sql", 3, "/adapters/sql")
    assert route(router, request("b", SYSTEM_A, lora), [status("0", running=1), status("1")]) == "pagoda:requests:0"
    assert router.routed[("0", "smallest_cache")] == 1


def test_a_busy_group_with_the_prefix_is_passed_over_beyond_the_margin(router, r):
    cache(r, "1", SYSTEM_A)
    within = [status("0"), status("1", running=2)]  # 2 more than the least loaded: the margin
    assert route(router, request("a", SYSTEM_A), within) == "pagoda:requests:1"
    beyond = [status("0"), status("1", running=2, waiting=1)]
    assert route(router, request("b", SYSTEM_A), beyond) == "pagoda:requests:0"
    assert router.routed == {("1", "cache_hit"): 1, ("0", "least_loaded"): 1}


def test_a_burst_sharing_a_new_prefix_follows_the_first_request_before_any_event(router, r):
    """No group holds A or B yet: A's first request goes to group 0 (both empty and idle), and so
    do the next ones of A (their blocks are expected there); B's first goes to group 1, which holds
    fewer blocks; every later request of either follows its first."""
    groups = [status("0"), status("1")]
    streams_of = [route(router, request(f"r{i}", (SYSTEM_A if i % 2 == 0 else SYSTEM_B) + [i]), groups)
                  for i in range(6)]
    assert streams_of == ["pagoda:requests:0", "pagoda:requests:1"] * 3
    assert router.routed == {("0", "smallest_cache"): 1, ("1", "smallest_cache"): 1, ("0", "cache_hit"): 2,
                             ("1", "cache_hit"): 2}


def test_a_group_that_cleared_its_cache_no_longer_attracts_the_prefix(router, r):
    cache(r, "1", SYSTEM_A)
    groups = [status("0"), status("1")]
    assert route(router, request("a", SYSTEM_A), groups) == "pagoda:requests:1"
    router.expected.clear()  # as after EXPECTED_TTL_S
    r.xadd(streams.kv_events_stream("1"),
           {streams.KV_EVENTS_FIELD: encode_batch(KVEventBatch(0.0, [AllBlocksCleared()], "1"))})  # restarted
    router.finished("a")
    assert route(router, request("b", SYSTEM_A), [status("0", running=1), status("1")]) == "pagoda:requests:1"
    assert router.routed[("1", "smallest_cache")] == 1  # both empty: there by load, not by cache
    assert router.cached["1"] == set()


def test_pull_routing_and_a_single_group_use_the_shared_stream(make_router, r):
    cache(r, "1", SYSTEM_A)
    pull, auto = make_router("pull"), make_router("auto")
    assert route(pull, request("a", SYSTEM_A), [status("0"), status("1")]) == streams.REQUESTS
    assert route(auto, request("b", SYSTEM_A), [status("1")]) == streams.REQUESTS  # one group: nothing to choose
    assert route(auto, request("c", SYSTEM_A), [status("0"), status("1", ready=False)]) == streams.REQUESTS
    assert route(auto, request("d", SYSTEM_A), [status("0"), status("1")]) == "pagoda:requests:1"
    assert pull.routed == {("", "pull"): 1} and auto.routed == {("", "pull"): 2, ("1", "cache_hit"): 1}


# ----------------------------------------------------------------------------- the scheduler's side


def submit(r: redis.Redis, stream: str, request_id: str) -> bytes:
    return r.xadd(stream, {streams.FIELD: encode(request(request_id, [1, 2, 3]))})


def scheduler_stream(redis_url: str, engine: str, consumer: str, **serving) -> request_stream.RequestStream:
    s = request_stream.RequestStream(ServingConfig(redis_url=redis_url, engine_id=engine, **serving), consumer)
    s.ensure_group()
    return s


def finish(s: request_stream.RequestStream, arrival: inbox.Arrival) -> None:
    s.track(arrival)
    s.emit([RequestOutput(arrival.request.request_id, [], [], True)])


def test_a_scheduler_reads_its_own_stream_first_then_the_shared_one(redis_url, r):
    s = scheduler_stream(redis_url, "0", "sched-0")
    submit(r, streams.REQUESTS, "shared-1")
    submit(r, "pagoda:requests:0", "own-1")
    submit(r, "pagoda:requests:0", "own-2")
    assert [(a.request.request_id, a.stream) for a in s.read(2, block=False)] == [
        ("own-1", "pagoda:requests:0"), ("own-2", "pagoda:requests:0")]
    assert [a.request.request_id for a in s.read(5, block=False)] == ["shared-1"]
    assert (s.num_routed, s.num_shared, s.num_stolen) == (2, 1, 0)
    s.redis.close()


def test_an_idle_group_steals_what_a_busy_group_left_unread_and_acks_it_there(redis_url, r):
    """Stealing is for a scheduler with nothing to run (`read(block=True)`), from a group with no
    room (here: its status says 8 wait in it), of what waited unread steal_after_ms."""
    busy = scheduler_stream(redis_url, "1", "sched-1")
    r.set(streams.status_key("sched-1"), encode(status("1", running=8, waiting=8)))  # alive, no room
    idle = scheduler_stream(redis_url, "0", "sched-0", steal_after_ms=300)
    assert idle.inbox.others == ["pagoda:requests:1"]
    submit(r, "pagoda:requests:1", "waited")
    assert idle.read(4, block=True) == []  # fresh: its group may still read it
    time.sleep(0.35)
    submit(r, "pagoda:requests:1", "fresh")
    idle.inbox._last_steal = 0.0
    assert idle.read(4, block=False) == []  # busy itself: it steals nothing from a live group
    idle.inbox._last_steal = 0.0
    stolen = idle.read(4, block=True)
    assert [(a.request.request_id, a.stream) for a in stolen] == [
        ("waited", "pagoda:requests:1"), ("fresh", "pagoda:requests:1")]  # the oldest waited: the rest come along
    assert idle.num_stolen == 2 and busy.read(4, block=False) == []  # delivered once
    for arrival in stolen:
        finish(idle, arrival)
    assert r.xpending("pagoda:requests:1", streams.SCHEDULER_GROUP)["pending"] == 0
    assert r.xlen("pagoda:requests:1") == 0
    busy.redis.close()
    idle.redis.close()


def test_a_dead_schedulers_requests_are_taken_over_from_its_groups_stream(redis_url, r):
    dead = scheduler_stream(redis_url, "1", "dead-sched-1")
    submit(r, "pagoda:requests:1", "held-by-the-dead")
    assert len(dead.read(4, block=False)) == 1  # read, never acked: pending under its name
    survivor = scheduler_stream(redis_url, "0", "sched-0", claim_idle_ms=200)
    time.sleep(0.25)
    survivor.maintain(draining=False)
    assert survivor.orphans
    taken = survivor.take_over(4)
    assert [(a.request.request_id, a.stream) for a in taken] == [("held-by-the-dead", "pagoda:requests:1")]
    finish(survivor, taken[0])
    assert r.xpending("pagoda:requests:1", streams.SCHEDULER_GROUP)["pending"] == 0
    survivor.maintain(draining=False)
    assert not survivor.orphans
    assert [c["name"] for c in r.xinfo_consumers("pagoda:requests:1", streams.SCHEDULER_GROUP)] == [b"sched-0"]
    dead.redis.close()
    survivor.redis.close()


def test_a_status_carries_where_the_requests_came_from():
    fields = {f.name for f in dataclasses.fields(SchedulerStatus)}
    assert {"num_routed_total", "num_shared_total", "num_stolen_total"} <= fields


def test_a_stream_whose_group_redis_lost_is_still_stolen_from(redis_url, r):
    """Redis restarted empty and a gateway queued a request again on group 1's stream before group
    1's scheduler (gone for good) made the consumer group: another group makes it, and steals."""
    idle = scheduler_stream(redis_url, "0", "sched-0", steal_after_ms=0)
    submit(r, "pagoda:requests:1", "orphaned")
    idle.inbox._find_others()
    assert [a.request.request_id for a in idle.read(4, block=True)] == ["orphaned"]
    assert idle.num_stolen == 1
    idle.redis.close()


def test_what_a_group_with_room_left_unread_is_not_stolen(redis_url, r):
    """A stale entry in group 1's stream is stolen only while group 1's status says max_num_seqs
    requests wait in it (or it has no live scheduler): else it is between steps and reads it."""
    idle = scheduler_stream(redis_url, "0", "sched-0", steal_after_ms=0)
    submit(r, "pagoda:requests:1", "queued")
    r.set(streams.status_key("sched-1"), encode(status("1", running=8, waiting=7)))  # max_num_seqs 8
    idle.inbox._find_others()
    assert idle.read(4, block=True) == []
    r.set(streams.status_key("sched-1"), encode(status("1", running=8, waiting=8)))
    idle.inbox._last_steal = 0.0
    assert [a.request.request_id for a in idle.read(4, block=True)] == ["queued"]
    idle.redis.close()


def test_a_busy_scheduler_steals_only_from_a_group_with_no_live_scheduler(redis_url, r):
    """Busy itself (`read(block=False)`), a scheduler leaves a full group's stale entries to the
    idle ones, but takes a dead group's: else they would wait while every live group is busy."""
    busy = scheduler_stream(redis_url, "0", "sched-0", steal_after_ms=0)
    submit(r, "pagoda:requests:1", "stranded")
    r.set(streams.status_key("sched-1"), encode(status("1", running=8, waiting=8)))  # alive, no room
    busy.inbox._find_others()
    assert busy.read(4, block=False) == []
    r.delete(streams.status_key("sched-1"))  # its status expired: dead
    busy.inbox._last_steal = 0.0
    assert [a.request.request_id for a in busy.read(4, block=False)] == ["stranded"]
    busy.redis.close()


def test_a_new_prefix_goes_to_the_emptier_group_only_within_the_margin(router, r):
    cache(r, "1", SYSTEM_A)  # group 1 holds 3 blocks, group 0 none
    assert route(router, request("a", SYSTEM_B), [status("0", running=2), status("1")]) == "pagoda:requests:0"
    assert route(router, request("b", SYSTEM_B[:16] + [9] * 40), [status("0", running=3), status("1")]) == (
        "pagoda:requests:1")  # group 0 is 3 past the least loaded: over the margin of 2
    # a prompt nothing matches: group 0 holds fewer blocks (3 expected against 3 cached + 3 expected),
    # but is 4 past the least loaded: the emptier group within the margin is group 1
    assert route(router, request("c", [11] * 48), [status("0", running=5), status("1")]) == "pagoda:requests:1"
    assert router.routed == {("0", "smallest_cache"): 1, ("1", "least_loaded"): 1, ("1", "smallest_cache"): 1}


def test_a_stream_without_its_group_loses_nothing_read_from_the_others(redis_url, r):
    """Redis restarted empty and a gateway queued a request again on this group's stream: the shared
    stream has no consumer group yet. The request read from the own stream is kept, and the missing
    group is made for the next read."""
    s = scheduler_stream(redis_url, "0", "sched-0")
    r.xgroup_destroy(streams.REQUESTS, streams.SCHEDULER_GROUP)
    submit(r, "pagoda:requests:0", "queued-again")
    assert [a.request.request_id for a in s.read(4, block=False)] == ["queued-again"]
    assert [g["name"] for g in r.xinfo_groups(streams.REQUESTS)] == [b"schedulers"]
    s.redis.close()


def test_prompts_shorter_than_a_block_spread_by_load_then_in_turn(router, r):
    """No block to place: neither group's cache matters (group 1 holds 3 blocks, group 0 none).
    In flight together they alternate by load; one at a time (equal loads), by turn."""
    cache(r, "1", SYSTEM_A)
    groups = [status("0"), status("1")]
    together = [route(router, request(f"t{i}", [40 + i] * 6), groups) for i in range(6)]
    assert together == ["pagoda:requests:0", "pagoda:requests:1"] * 3
    assert router.outstanding == {"0": 3, "1": 3}
    one_at_a_time = []
    for i in range(4):
        one_at_a_time.append(route(router, request(f"o{i}", [60 + i] * 6), groups))
        router.finished(f"o{i}")
    assert sorted(one_at_a_time) == ["pagoda:requests:0"] * 2 + ["pagoda:requests:1"] * 2
    assert one_at_a_time[0] != one_at_a_time[1] and one_at_a_time[2] != one_at_a_time[3]
    # a busier group is passed over whatever the turn
    assert [route(router, request(f"b{i}", [80 + i] * 6), [status("0", running=9), status("1")])
            for i in range(2)] == ["pagoda:requests:1"] * 2
    assert router.routed == {("0", "least_loaded"): 5, ("1", "least_loaded"): 7}


def test_a_draining_group_takes_nothing_even_holding_the_prefix(make_router, r):
    cache(r, "1", SYSTEM_A)
    router = make_router()
    assert route(router, request("a", SYSTEM_A), [status("0"), status("1", draining=True)]) == "pagoda:requests:0"
    assert router.routed == {("0", "smallest_cache"): 1}
    auto = make_router("auto")  # one group left to route to: the shared stream, which the others read
    assert route(auto, request("b", SYSTEM_A), [status("0"), status("1", draining=True)]) == streams.REQUESTS


def test_a_router_whose_cursor_fell_behind_the_cap_forgets_and_asks_for_a_snapshot(router, r):
    """Group 1 stores A, then removes it; the stream is trimmed past the removal before the router
    reads again. It must not keep A: it forgets what it held, replays what the stream still has, and
    asks the scheduler for a snapshot (streams.kv_resync_key), once."""
    stream = streams.kv_events_stream("1")
    r.xadd(stream, {streams.KV_EVENTS_FIELD: encode_batch(KVEventBatch(0.0, [AllBlocksCleared()], "1"))})
    hashes = cache(r, "1", SYSTEM_A)
    groups = [status("0"), status("1")]
    assert route(router, request("a", SYSTEM_A), groups) == "pagoda:requests:1"
    assert router.num_resyncs == 0 and r.get(streams.kv_resync_key("1")) is None
    router.expected.clear()
    r.xadd(stream, {streams.KV_EVENTS_FIELD: encode_batch(KVEventBatch(0.0, [BlockRemoved(hashes)], "1"))})
    cache(r, "1", SYSTEM_B)
    r.xtrim(stream, maxlen=1, approximate=False)  # the removal went with the cap
    assert route(router, request("b", SYSTEM_A), groups) == "pagoda:requests:0"
    assert router.cached["1"] == set(prompt_block_hashes(SYSTEM_B, BLOCK))
    assert router.num_resyncs == 1 and r.get(streams.kv_resync_key("1")) == b"1"
    assert route(router, request("c", SYSTEM_B), groups) == "pagoda:requests:1"  # read on: no second ask
    assert router.num_resyncs == 1


def test_a_router_started_on_a_trimmed_stream_asks_for_a_snapshot(make_router, r):
    cache(r, "1", SYSTEM_A)  # the stream does not begin with its scheduler's AllBlocksCleared
    router = make_router()
    route(router, request("a", SYSTEM_B), [status("0"), status("1")])
    assert router.num_resyncs == 1 and r.get(streams.kv_resync_key("1")) == b"1"
    assert router.cached["1"] == set(prompt_block_hashes(SYSTEM_A, BLOCK))  # what the stream has, meanwhile
