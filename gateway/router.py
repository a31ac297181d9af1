"""Cache-aware routing over engine groups (`--routing cache_aware`): SGLang's cache-aware router's
rule, fed by the schedulers' KV events instead of an approximate tree of its own.

    request ─▶ its prompt's block hashes (the schedulers' own: common/block_hash.py, salted by
               its LoRA adapter) ─▶ per ready engine group, how many leading hashes it holds
       ├─ the longest match, if any and its group's load is within `margin` of the least loaded's
       │                                                   ─▶ XADD pagoda:requests:<that engine>
       ├─ no match: of the groups within `margin` of the least loaded, the one holding the fewest
       │  blocks (the most room for a new prefix)          ─▶ XADD pagoda:requests:<that engine>
       └─ a match too busy: the least loaded group         ─▶ XADD pagoda:requests:<that engine>

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
        for that engine)."""
        lora = request.lora_request
        salt = None if lora is None else lora_salt(lora.lora_int_id, lora.lora_path)
        hashes_by_size: dict[int, list[bytes]] = {}
        now = time.monotonic()
        scored = []
        for engine, status in sorted(groups.items()):
            size = status.block_size
            if size not in hashes_by_size:
                hashes_by_size[size] = prompt_block_hashes(request.prompt_token_ids, size, salt)
            hashes = hashes_by_size[size]
            scored.append((self._match(engine, hashes, now), self.load(engine, status), engine, hashes))
        least = min(load for _, load, _, _ in scored)
        match, load, engine, hashes = max(scored, key=lambda s: (s[0], -s[1]))
        if match > 0 and load - least <= self.margin:
            return engine, "cache_hit", hashes
        if match == 0:  # a new prefix: where the most room is (SGLang's smallest tree), spreading prefixes,
            # among the groups within the margin of the least loaded
            balanced = [s for s in scored if s[1] - least <= self.margin]
            _, _, engine, hashes = min(balanced, key=lambda s: (self.cache_size(s[2]), s[1]))
            return engine, "smallest_cache", hashes
        _, _, engine, hashes = min(scored, key=lambda s: (s[1], -s[0]))
        return engine, "least_loaded", hashes

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
        while True:
            keys = {streams.kv_events_stream(e): self._cursors.get(e, b"0-0") for e in groups}
            replies = await self.redis.xread(keys, count=EVENTS_READ_COUNT)
            if not replies:
                return
            full = False
            for stream, entries in replies:
                engine = (stream.decode() if isinstance(stream, bytes) else stream)[len(streams.KV_EVENTS_PREFIX):]
                cached = self.cached.setdefault(engine, set())
                for entry_id, fields in entries:
                    self._cursors[engine] = entry_id
                    try:
                        batch = kv_events.decode_batch(fields.get(streams.KV_EVENTS_FIELD, b""))
                    except ValueError as exc:
                        log.warning("ignoring an undecodable KV event batch of engine %s: %s", engine, exc)
                        continue
                    kv_events.replay(batch.events, cached)
                full |= len(entries) == EVENTS_READ_COUNT
            if not full:
                return


def _ready_groups(statuses: list[SchedulerStatus]) -> dict[str, SchedulerStatus]:
    """One status per engine group whose workers are ready (the latest, if two schedulers share it)."""
    groups: dict[str, SchedulerStatus] = {}
    for status in statuses:
        if status.workers_ready and (status.engine not in groups or status.updated_at > groups[status.engine].updated_at):
            groups[status.engine] = status
    return groups
