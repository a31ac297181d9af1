"""A scheduler's requests in: what it reads, steals, claims and takes over, and the aborts.

    XREADGROUP pagoda:requests:<engine>, then pagoda:requests (group "schedulers",
               consumer = this scheduler)                                     ─▶ Arrival
    XREADGROUP another group's pagoda:requests:<engine> whose oldest unread
               entry waited steal_after_ms (it is busy), when this one is idle  ─▶ Arrival (stolen)
    XAUTOCLAIM entries idle > claim_idle_ms (a dead scheduler's), any stream  ─▶ Arrival, before any newer one
    XREAD pagoda:aborts                                                       ─▶ request ids to abort

The streams: the shared one, which every scheduler reads, and one per engine group, where a
gateway's cache-aware router puts the requests whose prefix that group has cached (common/streams.py).
A scheduler reads its own group's stream first, then the shared one, as long as fewer than
max_num_seqs requests wait in it: the rest wait in Redis, where an idle group steals them from a
busy one. What follows holds on every stream.

A request is acknowledged in its stream only when it ends (scheduler/outbox.py), so a request
held by a scheduler that dies stays pending in Redis: a live scheduler re-claims its own entries every
claim_interval_s (XCLAIM, which resets their idle time) and takes over entries idle longer than
claim_idle_ms (XAUTOCLAIM). While such orphans wait, no new request is read: they arrived first.
A taken-over request that had not streamed a token runs from the start; one that had (marked in
the `pagoda:started` hash) ends with an error, never with its text repeated. A dead scheduler's
consumer leaves the group once nothing is pending under its name.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from common import streams
from common.config import ServingConfig
from common.protocol import GenerateRequest, ProtocolError, SchedulerStatus, decode
from scheduler.outbox import Outbox

log = logging.getLogger(__name__)

MAX_DELIVERIES = 3  # a request whose schedulers keep dying is not given to another one
# An abort can come long before its request is read (queued behind others in Redis): it is kept
# longer than a gateway waits for a request (request_timeout_s, 600 s by default).
EARLY_ABORT_TTL_S = 900.0
READ_BATCH = 64
IDLE_BLOCK_MS = 50  # an idle scheduler waits this long for a request

# Deletes a consumer only while nothing is pending under its name (atomic: it may read meanwhile).
_DELETE_IDLE_CONSUMER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
    return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""


@dataclass(slots=True)
class Arrival:
    """A request read from the stream (or taken over) that the scheduler should admit."""

    entry_id: bytes
    request: GenerateRequest
    stream: str = streams.REQUESTS


@dataclass(slots=True)
class Abort:
    """An entry of pagoda:aborts: a whole request, or one output of it (`index`: a stop string
    the gateway found in one of n samples)."""

    request_id: str
    index: int | None = None


class Inbox:
    def __init__(self, serving: ServingConfig, consumer: str, client: redis.Redis, outbox: Outbox) -> None:
        self.serving = serving
        self.consumer = consumer
        self.redis = client
        self.outbox = outbox  # holds the requests read, and acknowledges the entries that end here
        self.own = streams.group_requests_stream(serving.engine_id)  # what routers send this group
        self.others: list[str] = []  # the other engine groups' streams, as last found
        self.early_aborts: dict[str, float] = {}  # aborts that arrived before their request
        self.orphans = False  # a dead scheduler's requests wait to be taken over: read nothing new
        self.aborts_cursor = _recent_aborts_id()
        self.num_routed = 0  # requests read from this group's own stream
        self.num_shared = 0  # from the shared stream
        self.num_stolen = 0  # from another group's stream, left unread there
        self._delete_idle_consumer = self.redis.register_script(_DELETE_IDLE_CONSUMER)
        self._last_maintain = 0.0  # maintain(): takeover checks, dead consumers
        self._last_renew = 0.0  # renew_claims(): also while a step runs
        self._last_steal = 0.0
        self._claim_cursors: dict[str, str | bytes] = {}  # per stream: where the next XAUTOCLAIM scan resumes
        self._last_prune = 0.0

    @property
    def streams(self) -> list[str]:
        """Every requests stream this scheduler reads or takes over from: its own first."""
        return [self.own, streams.REQUESTS, *self.others]

    def ensure_group(self) -> None:
        for stream in (self.own, streams.REQUESTS):
            self._create_group(stream)
        self._find_others()

    def _create_group(self, stream: str) -> None:
        try:
            self.redis.xgroup_create(stream, streams.SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _find_others(self) -> None:
        found = {key.decode() if isinstance(key, bytes) else key
                 for key in self.redis.scan_iter(match=streams.GROUP_REQUESTS_PREFIX + "*", count=1000, _type="stream")}
        self.others = sorted(found - {self.own})

    # ------------------------------------------------------------------ requests in
    def read(self, count: int, block: bool) -> list[Arrival]:
        """Up to `count` new requests: this group's own first, then the shared stream's; with
        nothing there, another group's that it left unread (`_steal`: when `block`, this scheduler
        being idle, from a group with no room; else only from one with no live scheduler); with
        nothing anywhere and `block`, waiting a little for one."""
        count = min(count, READ_BATCH)
        arrivals: list[Arrival] = []
        with _unless_group_missing(self._regroup):
            arrivals = self._read_new({self.own: ">"}, count)
            self.num_routed += len(arrivals)
            if len(arrivals) < count:
                shared = self._read_new({streams.REQUESTS: ">"}, count - len(arrivals))
                self.num_shared += len(shared)
                arrivals += shared
            if not arrivals:  # busy, only from a group with no live scheduler: else it would wait on
                arrivals = self._steal(count, dead_only=not block)
            if not arrivals and block:  # (at most one a stream: the next read takes the rest)
                arrivals = self._read_new({self.own: ">", streams.REQUESTS: ">"}, 1, block_ms=IDLE_BLOCK_MS)
                self.num_routed += sum(a.stream == self.own for a in arrivals)
                self.num_shared += sum(a.stream != self.own for a in arrivals)
        return self._unique(arrivals)

    def _regroup(self, *stream_names: str) -> None:
        log.warning("a requests stream has no consumer group (Redis restarted empty?): making it again")
        for stream in stream_names or (self.own, streams.REQUESTS):
            self._create_group(stream)

    def _read_new(self, keys: dict[str, str], count: int, block_ms: int | None = None) -> list[Arrival]:
        replies = None
        with _unless_group_missing(lambda: self._regroup(*keys)):  # what a gateway queued again waits
            replies = self.redis.xreadgroup(streams.SCHEDULER_GROUP, self.consumer, keys, count=count,
                                            block=block_ms)
        return [a for stream, entries in replies or [] for entry_id, fields in entries
                if (a := self._arrival(entry_id, fields, _name(stream))) is not None]

    def _steal(self, count: int, dead_only: bool = False) -> list[Arrival]:
        """Requests another engine group's stream has held unread for steal_after_ms while that
        group has no room for them (max_num_seqs wait in its scheduler, by its status) or no live
        scheduler: its router sent them there for its cache, and this group has room. A busy
        scheduler (`dead_only`) takes only a dead group's. Looked at every steal_after_ms / 4 at most."""
        now = time.monotonic()
        if not self.others or now - self._last_steal < self.serving.steal_after_ms / 4000:
            return []
        self._last_steal = now
        seconds, micros = self.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        stolen: list[Arrival] = []
        room_of: dict[str, bool] | None = None
        for stream in self.others:
            if len(stolen) >= count:
                break
            try:
                groups = self.redis.xinfo_groups(stream)
            except redis.ResponseError:  # gone (its Redis restarted empty)
                continue
            group = next((g for g in groups if _name(g["name"]) == streams.SCHEDULER_GROUP), None)
            if group is None:  # its scheduler never came back after Redis restarted empty: make the group
                self._create_group(stream)
            last_read = b"0-0" if group is None else _bytes(group["last-delivered-id"])
            oldest = self.redis.xrange(stream, b"(" + last_read, "+", count=1)
            if not oldest or now_ms - int(oldest[0][0].split(b"-")[0]) < self.serving.steal_after_ms:
                continue
            if room_of is None:
                room_of = self._engines_with_room()
            engine = stream[len(streams.GROUP_REQUESTS_PREFIX):]
            if room_of.get(engine, False) or (dead_only and engine in room_of):
                continue  # its scheduler will read it: it is between steps (a long one, maybe)
            arrivals = self._read_new({stream: ">"}, count - len(stolen))
            for arrival in arrivals:
                log.info("stole request %s from %s: it waited there unread", arrival.request.request_id, stream)
            stolen += arrivals
        self.num_stolen += len(stolen)
        return stolen

    def _engines_with_room(self) -> dict[str, bool]:
        """Per engine group with a live scheduler: whether one of them reads more (fewer than
        max_num_seqs wait in it), as their statuses say. A group with no live scheduler is absent."""
        keys = list(self.redis.scan_iter(match=streams.STATUS_PREFIX + "*", count=1000))
        room: dict[str, bool] = {}
        for raw in self.redis.mget(keys) if keys else []:
            try:
                status = decode(raw) if raw is not None else None
            except ProtocolError:
                continue
            if isinstance(status, SchedulerStatus) and status.workers_ready:
                room[status.engine] = room.get(status.engine, False) or status.num_waiting < status.max_num_seqs
        return room

    def _unique(self, arrivals: list[Arrival]) -> list[Arrival]:
        """One arrival per request id: a second entry of it in the same read (a gateway queued it
        again after a Redis restart) is acknowledged and dropped, as one already tracked is."""
        seen, unique = set(), []
        for arrival in arrivals:
            if arrival.request.request_id in seen:
                self.outbox.drop(arrival.entry_id, arrival.stream)
            else:
                seen.add(arrival.request.request_id)
                unique.append(arrival)
        return unique

    def _arrival(self, entry_id: bytes, fields: dict, stream: str) -> Arrival | None:
        """The entry's request, unless it is malformed, a duplicate or already aborted (those end here)."""
        try:
            request = _decode_request(fields)
        except ProtocolError as exc:
            log.warning("dropped malformed request %s: %s", entry_id, exc)
            self.outbox.drop(entry_id, stream)
            return None
        if request.request_id in self.outbox.tracked:
            self.outbox.drop(entry_id, stream)  # a duplicate
            return None
        if self.early_aborts.pop(request.request_id, None) is not None:
            self.outbox.finish(Arrival(entry_id, request, stream), "abort")
            return None
        return Arrival(entry_id, request, stream)

    # ------------------------------------------------------------------ claims and takeover
    def maintain_due(self) -> bool:
        return time.monotonic() - self._last_maintain >= self.serving.claim_interval_s

    def renew_due(self) -> bool:
        return time.monotonic() - self._last_renew >= self.serving.claim_interval_s

    def maintain(self, draining: bool) -> list[str]:
        """Renew this scheduler's claims; note whether a dead scheduler's requests wait; returns the
        requests another scheduler took over (drop them here without a word: they are its now)."""
        self._last_maintain = time.monotonic()
        dropped: list[str] = []
        with _unless_group_missing():  # (read() makes the group again)
            self._find_others()
            dropped = self._drop_taken_over()  # first: renewing would claim them back (XCLAIM takes any entry)
            self.renew_claims()
            self.orphans = not draining and self._orphans_wait()
            self._delete_dead_consumers()
        return dropped

    def _orphans_wait(self) -> bool:
        """Whether a pending entry of any stream has gone unclaimed for claim_idle_ms (its scheduler is dead)."""
        for stream in self.streams:
            with _unless_group_missing():
                if self.redis.xpending_range(stream, streams.SCHEDULER_GROUP, "-", "+", 1,
                                             idle=self.serving.claim_idle_ms):
                    return True
        return False

    def renew_claims(self) -> None:
        """XCLAIM with JUSTID resets an entry's idle time (and not its delivery count)."""
        self._last_renew = time.monotonic()
        by_stream: dict[str, list[bytes]] = {}
        for t in self.outbox.tracked.values():
            by_stream.setdefault(t.stream, []).append(t.entry_id)
        for stream, ids in by_stream.items():
            # (the entries went with the group; what gateways queue again is read once there is room)
            with _unless_group_missing(lambda: self._create_group(stream)):
                for i in range(0, len(ids), 1000):
                    self.redis.xclaim(stream, streams.SCHEDULER_GROUP, self.consumer, 0, ids[i:i + 1000],
                                      justid=True)

    def _drop_taken_over(self) -> list[str]:
        """Tracked requests now pending under another scheduler (this one stalled past claim_idle_ms)."""
        if not self.outbox.tracked:
            return []
        own = {(stream, p["message_id"]) for stream in {t.stream for t in self.outbox.tracked.values()}
               for p in self._own_pending(stream, len(self.outbox.tracked) + 1000)}
        dropped = []
        for request_id, tracked in list(self.outbox.tracked.items()):
            if (tracked.stream, tracked.entry_id) in own:
                continue
            holder = None  # the entry went with a Redis restart: keep the request
            with _unless_group_missing():
                holder = self.redis.xpending_range(tracked.stream, streams.SCHEDULER_GROUP, tracked.entry_id,
                                                   tracked.entry_id, 1)
            if holder and holder[0]["consumer"].decode() != self.consumer:  # (none: Redis restarted empty; keep it)
                log.warning("request %s was taken over by %s; dropping it here", request_id,
                            holder[0]["consumer"].decode())
                del self.outbox.tracked[request_id]
                dropped.append(request_id)
        return dropped

    def _delete_dead_consumers(self) -> None:
        """A dead scheduler's consumer leaves each stream's group once its entries there are all taken over."""
        for stream in self.streams:
            try:
                consumers = self.redis.xinfo_consumers(stream, streams.SCHEDULER_GROUP)
            except redis.ResponseError:  # another group's stream without its group yet
                continue
            for consumer in consumers:
                name = _name(consumer["name"])
                if name != self.consumer and consumer["pending"] == 0 and consumer["idle"] >= self.serving.claim_idle_ms:
                    if self._delete_idle_consumer(keys=[stream], args=[streams.SCHEDULER_GROUP, name]) != -1:
                        log.info("scheduler %s left the group of %s: its requests were taken over", name, stream)

    def take_over(self, count: int) -> list[Arrival]:
        """Up to `count` requests of dead schedulers, from any stream. One that had streamed (its
        text would repeat), or that was delivered to too many schedulers that died (it may be what
        kills them), ends with an error instead."""
        count = min(count, READ_BATCH)
        arrivals: list[Arrival] = []
        scanning = False  # a stream's scan has not come back to its start
        for stream in self.streams:
            if len(arrivals) >= count:
                scanning = True
                break
            arrivals += self._take_over(stream, count - len(arrivals))
            scanning |= self._claim_cursors.get(stream, "0-0") not in (b"0-0", "0-0")
        self.orphans = scanning or self._orphans_wait()
        return self._unique(arrivals)

    def _take_over(self, stream: str, count: int) -> list[Arrival]:
        claimed = None
        with _unless_group_missing():
            # One call scans at most 10 x count pending entries from the cursor; resuming there (not
            # at 0-0) gets past live schedulers' entries to the orphans behind them.
            claimed = self.redis.xautoclaim(  # (Redis 7.0 adds a third element: deleted ids)
                stream, streams.SCHEDULER_GROUP, self.consumer, self.serving.claim_idle_ms,
                start_id=self._claim_cursors.get(stream, "0-0"), count=count,
            )
        if claimed is None:
            self._claim_cursors.pop(stream, None)
            return []
        next_id, entries = claimed[:2]
        self._claim_cursors[stream] = next_id
        if any(fields is None for _, fields in entries):  # deleted from the stream while pending
            self._ack_deleted(stream)
        entries = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        if not entries:
            return []
        requests = [_try_decode_request(fields) for _, fields in entries]
        started = self.redis.hmget(streams.STARTED, [r.request_id if r else "" for r in requests])
        deliveries = self._deliveries(stream, [entry_id for entry_id, _ in entries])
        arrivals = []
        for (entry_id, fields), request, owner in zip(entries, requests, started):
            if request is None:
                self._arrival(entry_id, fields, stream)  # malformed: dropped there
                continue
            if request.request_id in self.outbox.tracked:
                continue  # ours all along (a claim renewed late)
            log.warning("took over request %s from a scheduler that stopped", request.request_id)
            if owner is not None:
                self.outbox.finish(Arrival(entry_id, request, stream), "error",
                            "the scheduler serving this request stopped after it had started streaming")
            elif deliveries.get(entry_id, 0) > MAX_DELIVERIES:
                self.outbox.finish(Arrival(entry_id, request, stream), "error",
                            f"the request was taken by {MAX_DELIVERIES} schedulers that each stopped; "
                            "it is not tried again")
            elif (arrival := self._arrival(entry_id, fields, stream)) is not None:
                arrivals.append(arrival)
        return arrivals

    def _own_pending(self, stream: str, count: int) -> list[dict]:
        with _unless_group_missing():
            return self.redis.xpending_range(stream, streams.SCHEDULER_GROUP, "-", "+", count,
                                             consumername=self.consumer)
        return []

    def _ack_deleted(self, stream: str) -> None:
        """Acknowledge this scheduler's pending entries that are gone from the stream (Redis 6.2's
        XAUTOCLAIM returns them as nils and keeps them pending; 7.0 drops them itself)."""
        tracked = {t.entry_id for t in self.outbox.tracked.values() if t.stream == stream}
        for p in self._own_pending(stream, 1000):
            entry_id = p["message_id"]
            if entry_id not in tracked and not self.redis.xrange(stream, entry_id, entry_id):
                self.outbox.drop(entry_id, stream)

    def _deliveries(self, stream: str, entry_ids: list[bytes]) -> dict[bytes, int]:
        """How many times each of this scheduler's pending entries has been delivered (claims count)."""
        pending = self._own_pending(stream, len(entry_ids) + len(self.outbox.tracked) + 1000)
        wanted = set(entry_ids)
        return {p["message_id"]: p["times_delivered"] for p in pending if p["message_id"] in wanted}

    # ------------------------------------------------------------------ aborts
    def read_aborts(self) -> list[Abort]:
        """The held requests, or outputs of them, aborted since the last read. A whole request's
        abort event is queued here, and an abort for a request not read yet is kept until it comes.
        An output's abort sends no event (the gateway ended it) and is never kept: the gateway sends
        it only once that output has streamed."""
        aborted = []
        replies = self.redis.xread({streams.ABORTS: self.aborts_cursor}, count=1000)
        for _, entries in replies or []:
            for entry_id, fields in entries:
                self.aborts_cursor = entry_id
                request_id = fields.get(streams.ABORT_FIELD, b"").decode(errors="replace")
                index = fields.get(streams.ABORT_INDEX_FIELD)
                if index is not None:
                    if index.isdigit() and request_id in self.outbox.tracked:
                        self.outbox.tracked[request_id].ended.add(int(index))
                        aborted.append(Abort(request_id, int(index)))
                    continue
                tracked = self.outbox.tracked.pop(request_id, None)
                if tracked is None:
                    self.early_aborts[request_id] = time.monotonic()
                    continue
                self.outbox.finish_tracked(request_id, tracked, "abort", None)
                aborted.append(Abort(request_id))
        now = time.monotonic()
        if self.early_aborts and now - self._last_prune > 10:  # not every step: the dict can be large
            self._last_prune = now
            self.early_aborts = {k: t for k, t in self.early_aborts.items() if t > now - EARLY_ABORT_TTL_S}
        return aborted


@contextmanager
def _unless_group_missing(on_missing: Callable[[], None] | None = None) -> Iterator[None]:
    """The one answer to NOGROUP: the stream, or its consumer group, went with a Redis that
    restarted empty. Nothing of it is pending or held any more; the call it interrupts answers with
    what it had before (`on_missing` may make the group again, from the stream's start, for what
    gateways queue again)."""
    try:
        yield
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        if on_missing is not None:
            on_missing()


def _name(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _recent_aborts_id() -> bytes:
    """Read recent aborts too: those for requests this scheduler may take over from a dead one."""
    return f"{int((time.time() - EARLY_ABORT_TTL_S) * 1000)}-0".encode()


def _decode_request(fields: dict) -> GenerateRequest:
    """A requests-stream entry's request; ProtocolError when it is not one with string ids."""
    request = decode(fields.get(streams.FIELD, b""))
    if not isinstance(request, GenerateRequest):
        raise ProtocolError(f"expected a GenerateRequest, got {type(request).__name__}")
    if not (isinstance(request.request_id, str) and isinstance(request.reply_stream, str)):
        raise ProtocolError("request_id and reply_stream must be strings")
    return request


def _try_decode_request(fields: dict) -> GenerateRequest | None:
    try:
        return _decode_request(fields)
    except ProtocolError:
        return None
