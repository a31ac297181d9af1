"""Cache-aware routing over engine groups (`--routing cache_aware`): SGLang's cache-aware router's
rule, fed by the schedulers' KV events instead of an approximate tree of its own.

    request ─▶ its prompt's block hashes (the schedulers' own: common/block_hash.py, salted by
               its LoRA adapter) ─▶ per ready engine group, how many leading hashes it holds
       ├─ the longest match, if any and its group's load is within `margin` of the least loaded's
       │                                                   ─▶ XADD pagoda:requests:<that engine>
       ├─ no match: of the groups within `margin` of the least loaded, the one holding the fewest
       │  blocks (the most room for a new prefix)          ─▶ XADD pagoda:requests:<that engine>
       └─ a match too busy, or a prompt shorter than a block: the least loaded group
                                                           ─▶ XADD pagoda:requests:<that engine>
    Ties break by load, then round-robin; a group whose scheduler is draining takes nothing.

What a group holds is the replay of its KV event stream (`pagoda:kv-events:<engine>`, read here
from its start, common/kv_events.py), plus the hashes of the prompts this router sent it in the
last EXPECTED_TTL_S: their blocks are cached once its scheduler runs them, and a burst of
requests sharing a new prefix must follow the first one before any event says so. A group's load
is the larger of the requests this gateway has sent it that have not ended and what its status
says it runs and holds (other gateways send it requests too). The scheduler of a busy group leaves
what it has no room for (max_num_seqs waiting) in its stream, and an idle group steals it once it
has waited `--steal-after-ms` (scheduler/request_stream.py): routing never strands a request.

`--routing pull` (and a single engine group) puts every request on the shared stream, which every
scheduler reads, as before routing existed.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from common import kv_events, streams
from common.block_hash import lora_salt, prompt_block_hashes
from common.protocol import GenerateRequest, SchedulerStatus

log = logging.getLogger(__name__)

EXPECTED_TTL_S = 30.0  # a routed prompt's hashes count as its group's this long without an event
EVENTS_READ_INTERVAL_S = 0.05  # the KV event streams are read at most this often
EVENTS_READ_COUNT = 1000


class PrefixRouter:
    def __init__(self, redis: aioredis.Redis, mode: str, margin: int) -> None:
        self.redis = redis
        self.mode = mode  # "auto" (cache-aware when more than one engine group is ready), "cache_aware", "pull"
        self.margin = margin
        self.cached: dict[str, set[bytes]] = {}  # per engine: its KV events replayed
        # per engine: hash -> until when (monotonic), oldest first: expired from the front as routes come
        self.expected: dict[str, OrderedDict[bytes, float]] = {}
        self.outstanding: Counter[str] = Counter()  # per engine: this gateway's requests routed there, not ended
        self.routed: Counter[tuple[str, str]] = Counter()  # (engine, reason) -> requests
        self._engine_of: dict[str, str] = {}  # request id -> the engine it was routed to
        self._cursors: dict[str, bytes] = {}
        self._events_read_at = 0.0
        self._turn = 0  # rotates the order ties break in
        self.num_resyncs = 0  # KV event streams read again from a snapshot (events were missed)
        self.on_route: Callable[[str, str], None] | None = None  # (engine, reason) of each decision: a metric

    # ------------------------------------------------------------------ routing
    async def route(self, request: GenerateRequest, statuses: list[SchedulerStatus]) -> str:
        """The stream to put `request` on (its engine is remembered until `finished`)."""
        groups = _ready_groups(statuses)
        if self.mode == "pull" or (self.mode == "auto" and len(groups) < 2) or not groups:
            self._count("", "pull")
            return streams.REQUESTS
        await self._read_events(groups)
        now = time.monotonic()
        for expected in self.expected.values():
            while expected and next(iter(expected.values())) <= now:
                expected.popitem(last=False)
        engine, reason, hashes = self.choose(request, groups)
        expected = self.expected.setdefault(engine, OrderedDict())
        for h in hashes:
            expected[h] = now + EXPECTED_TTL_S
            expected.move_to_end(h)
        self.outstanding[engine] += 1
        self._engine_of[request.request_id] = engine
        self._count(engine, reason)
        return streams.group_requests_stream(engine)

    def choose(self, request: GenerateRequest, groups: dict[str, SchedulerStatus]) -> tuple[str, str, list[bytes]]:
        """(engine, why: "cache_hit", "smallest_cache" or "least_loaded", the prompt's block hashes
        for that engine). Every tie breaks by load, then by turn (round-robin over the groups)."""
        lora = request.lora_request
        salt = None if lora is None else lora_salt(lora.lora_int_id, lora.lora_path)
        hashes_by_size: dict[int, list[bytes]] = {}
        now = time.monotonic()
        scored = []
        engines = sorted(groups)
        for i, engine in enumerate(engines):
            size = groups[engine].block_size
            if size not in hashes_by_size:
                hashes_by_size[size] = prompt_block_hashes(request.prompt_token_ids, size, salt)
            hashes = hashes_by_size[size]
            turn = (i - self._turn) % len(engines)
            scored.append(_Candidate(self._match(engine, hashes, now), self.load(engine, groups[engine]), turn,
                                     engine, hashes))
        self._turn += 1
        least = min(c.load for c in scored)
        best = min(scored, key=lambda c: (-c.match, c.load, c.turn))
        if best.match > 0 and best.load - least <= self.margin:
            return best.engine, "cache_hit", best.hashes
        if best.match == 0 and best.hashes:  # a new prefix: where the most room is (SGLang's smallest
            # tree), spreading prefixes, among the groups within the margin of the least loaded
            balanced = [c for c in scored if c.load - least <= self.margin]
            best = min(balanced, key=lambda c: (self.cache_size(c.engine), c.load, c.turn))
            return best.engine, "smallest_cache", best.hashes
        # a prefix too busy where it is cached, or a prompt shorter than a block (no prefix to place)
        best = min(scored, key=lambda c: (c.load, -c.match, c.turn))
        return best.engine, "least_loaded", best.hashes

    def cache_size(self, engine: str) -> int:
        """The blocks the group holds, and those it is about to (this router's expected ones: a
        block both cached and expected counts twice, alike for every group)."""
        return len(self.cached.get(engine, ())) + len(self.expected.get(engine, ()))

    def _count(self, engine: str, reason: str) -> None:
        self.routed[(engine, reason)] += 1
        if self.on_route is not None:
            self.on_route(engine, reason)

    def _match(self, engine: str, hashes: list[bytes], now: float) -> int:
        """How many of the prompt's leading blocks the group holds, or is about to."""
        cached, expected = self.cached.get(engine, set()), self.expected.get(engine, {})
        for i, h in enumerate(hashes):
            if h not in cached and expected.get(h, 0.0) <= now:
                return i
        return len(hashes)

    def load(self, engine: str, status: SchedulerStatus) -> int:
        return max(self.outstanding[engine], status.num_running + status.num_waiting)

    def finished(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self.outstanding[engine] -= 1

    # ------------------------------------------------------------------ KV events
    async def _read_events(self, groups: dict[str, SchedulerStatus]) -> None:
        """Replay what each group's KV event stream gained since the last read."""
        if time.monotonic() - self._events_read_at < EVENTS_READ_INTERVAL_S:
            return
        self._events_read_at = time.monotonic()
        engines = sorted(groups)
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for engine in engines:
                pipe.xrange(streams.kv_events_stream(engine), count=1)
            pipe.xread({streams.kv_events_stream(e): self._cursors.get(e, b"0-0") for e in engines},
                       count=EVENTS_READ_COUNT)
            *firsts, replies = await pipe.execute()
            for engine, first in zip(engines, firsts):
                if first and self._missed_events(engine, *first[0]):
                    await self._resync(engine)
            full = False
            for stream, entries in replies or []:
                engine = (stream.decode() if isinstance(stream, bytes) else stream)[len(streams.KV_EVENTS_PREFIX):]
                self._replay(engine, entries)
                full |= len(entries) == EVENTS_READ_COUNT
            if not full:
                return

    def _replay(self, engine: str, entries: list) -> None:
        cached = self.cached.setdefault(engine, set())
        for entry_id, fields in entries:
            self._cursors[engine] = entry_id
            try:
                batch = kv_events.decode_batch(fields.get(streams.KV_EVENTS_FIELD, b""))
            except ValueError as exc:
                log.warning("ignoring an undecodable KV event batch of engine %s: %s", engine, exc)
                continue
            kv_events.replay(batch.events, cached)

    def _missed_events(self, engine: str, first_id: bytes, fields: dict) -> bool:
        """Whether the stream lost events this router has not read: its first entry is past the
        cursor (the cap trimmed the stream beyond it), or, read from the start, it does not begin
        where its scheduler did (with AllBlocksCleared)."""
        cursor = self._cursors.get(engine)
        if cursor is not None:
            return _entry_id(first_id) > _entry_id(cursor)
        try:
            events = kv_events.decode_batch(fields.get(streams.KV_EVENTS_FIELD, b"")).events
        except ValueError:
            return True
        return not events or not isinstance(events[0], kv_events.AllBlocksCleared)

    async def _resync(self, engine: str) -> None:
        """Forget what the group holds (a removal it missed would leave a hash it no longer holds),
        replay what the stream still has, and ask its scheduler for a snapshot of its whole cache."""
        log.info("this router missed KV events of engine %s (the stream's cap trimmed them): re-syncing", engine)
        self.cached[engine] = set()
        self.num_resyncs += 1
        await self.redis.set(streams.kv_resync_key(engine), b"1", ex=streams.KV_RESYNC_TTL_S)


def _entry_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


@dataclass(slots=True)
class _Candidate:
    match: int  # the prompt's leading blocks the group holds or is about to
    load: int
    turn: int  # its place in this decision's round-robin order
    engine: str
    hashes: list[bytes]


def _ready_groups(statuses: list[SchedulerStatus]) -> dict[str, SchedulerStatus]:
    """One status per engine group whose workers are ready and whose scheduler is not draining (the
    latest, if two schedulers share it)."""
    groups: dict[str, SchedulerStatus] = {}
    for status in statuses:
        if status.workers_ready and not status.draining and (
                status.engine not in groups or status.updated_at > groups[status.engine].updated_at):
            groups[status.engine] = status
    return groups
