"""This gateway process's side of Redis: submit requests, read its reply stream, abort, read status.

One reader task per process XREADs the reply stream and fans events out to per-request queues:

    XADD pagoda:requests[:<engine>] {m: GenerateRequest} ──▶ schedulers (the stream gateway/router.py picks)
    XREAD pagoda:replies:<gateway_id>           ◀── RequestEvents ──▶ queue of the request's HTTP handler
    XADD pagoda:aborts {id: request_id}         ──▶ every scheduler (disconnect, stop string)
    XADD pagoda:aborts {id, index}              ──▶ every scheduler (a stop string in one sample of n)
    GET pagoda:scheduler:<id>, pagoda:memory:<id> ◀── each scheduler's status and memory snapshot
    SET pagoda:memory-watch                     ──▶ while the dashboard's data is served: schedulers publish it

An abort that cannot be sent (Redis down) is sent again once the reader reaches Redis: else its
request would run on to max_tokens for no one, holding its KV blocks.

Redis restarting empty (its run_id changes) loses the requests it queued. The schedulers then
publish the ids they hold (pagoda:held:<id>); once every scheduler seen before the restart has,
or after `restart_grace_s`, a request that no scheduler holds and whose entry the new Redis lacks
ends with an error (503, retry) and is aborted in the schedulers. A request sent to the new Redis
is never failed: its entry is there. It also loses the events this gateway had not read yet: a
request that had streamed and that no scheduler holds lost its end, and one whose next event
skips a number (RequestEvent.seq) lost part of its text; either ends with an error, never with a
text that stops short or skips, nor waits for an end that will not come.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from common import streams
from common.memory_snapshot import snapshot_json
from common.protocol import (
    GenerateRequest, HeldRequests, MemorySnapshot, ProtocolError, RequestEvent, SchedulerStatus, decode,
    decode_events, encode,
)
from gateway.router import PrefixRouter

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
MAX_CONNECTIONS = 1024
READ_COUNT = 512
TRIM_INTERVAL_S = 1.0
MAX_BACKOFF_S = 2.0
CLOSE_TIMEOUT_S = 3.0  # close() never waits longer on the reader or the pool, whatever Redis is doing
MEMORY_READ_INTERVAL_S = 0.25  # the dashboard's snapshots are read from Redis at most this often
MEMORY_WATCH_INTERVAL_S = 2.0  # streams.MEMORY_WATCH is set at most this often while they are read
FIRST_SNAPSHOT_WAIT_S = 1.5  # a watch just begun: the schedulers see it with their status (every 0.5 s), then publish
REDIS_RESTARTED = "Redis restarted and lost the request before a scheduler read it"
OUTPUT_LOST = "Redis restarted and lost part of the request's output"


@dataclass(slots=True)
class _RedisRestart:
    """Redis came back empty: the schedulers are saying which requests they hold."""

    deadline: float  # monotonic: schedulers that have not said by then are not waited for
    schedulers: set[str]  # those alive before the restart


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """One scheduler's latest memory snapshot, as the JSON text of common/memory_snapshot.snapshot_json."""

    engine: str
    scheduler_id: str
    version: int
    json: str


def _engine_memory(key: bytes, raw: bytes) -> EngineMemory | None:
    """The snapshot's JSON, or None (logged once per value: each is decoded once) for a value that
    is not one: one bad key must not hide the others."""
    try:
        snapshot = decode(raw)
        if not isinstance(snapshot, MemorySnapshot):
            raise ProtocolError(f"a {type(snapshot).__name__}, not a MemorySnapshot")
        if not (isinstance(snapshot.engine, str) and isinstance(snapshot.scheduler_id, str)
                and type(snapshot.version) is int):
            raise ProtocolError("engine and scheduler_id must be strings, version an int")
        text = json.dumps(snapshot_json(snapshot), separators=(",", ":"))
    except Exception as exc:  # whatever a malformed value raises
        log.warning("ignoring the undecodable memory snapshot in %s: %s: %s", key.decode(errors="replace"),
                    type(exc).__name__, exc)
        return None
    return EngineMemory(snapshot.engine, snapshot.scheduler_id, snapshot.version, text)


@dataclass(slots=True)
class _Submitted:
    """A request of this gateway, from its submission until its handler releases it."""

    queue: asyncio.Queue[RequestEvent] | None  # its handler's (its Generation's); None once its events stopped
    num_prompt_tokens: int
    payload: bytes | None = None  # as sent, while no event came: put on the stream again if Redis loses it
    entry_id: bytes | None = None  # in its requests stream, once the XADD is done
    stream: str = streams.REQUESTS  # the requests stream it went to
    last_seq: int = 0  # the last token-bearing event passed on
    has_event: bool = False  # a scheduler holds it


class Generation:
    """The requests of one HTTP request (one per prompt), from submission until each has finished
    or been aborted."""

    def __init__(self, client: EngineClient, request_ids: list[str]) -> None:
        self.client = client
        self.queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.started: set[str] = set()  # requests that have had an event

    async def next_event(self, timeout: float) -> RequestEvent:
        """The next event of any of the requests; raises TimeoutError after `timeout` seconds."""
        event = await asyncio.wait_for(self.queue.get(), timeout)
        if event.request_id not in self.started and event.request_id in self.unfinished:
            self.started.add(event.request_id)
            self.client.unqueue(event.request_id)
        return event

    def finish(self, request_id: str, abort: bool = False) -> None:
        """The request is over for this gateway; `abort` tells the schedulers to stop it too."""
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self.client._release(request_id, started=request_id in self.started, abort=abort)

    def abort_output(self, request_id: str, index: int) -> None:
        """Output `index` of the request is over for this gateway (a stop string): the schedulers
        stop that sample alone and the request's other outputs go on."""
        if request_id in self.unfinished:
            self.client.abort(request_id, index)

    def close(self) -> None:
        """Abort whatever has not finished (a disconnect, an error, a timeout)."""
        for request_id in list(self.unfinished):
            self.finish(request_id, abort=True)


def _abort_fields(request_id: str, index: int | None) -> dict[bytes, bytes]:
    fields = {streams.ABORT_FIELD: request_id.encode()}
    if index is not None:
        fields[streams.ABORT_INDEX_FIELD] = str(index).encode()
    return fields


def _cancelling(task: asyncio.Task) -> bool:
    """Whether a cancel of `task` is pending (Task.cancelling is Python 3.11's; before it, unknown)."""
    return bool(getattr(task, "cancelling", lambda: 0)())


class EngineClient:
    def __init__(self, redis_url: str, gateway_id: str, restart_grace_s: float = 3.0, routing: str = "auto",
                 routing_balance_margin: int = 16) -> None:
        # retry_on_error: after a Redis restart each pooled connection fails once; reconnect and retry.
        # socket_timeout: a reply that never comes (seen once in some hundred Redis restarts: the
        # reader waiting on a fresh connection for the answer to an XREAD BLOCK 1000) is retried,
        # not waited for forever
        # max_connections: redis-py's pool refuses past 100, which a burst of submissions reaches
        self.redis = aioredis.from_url(redis_url, socket_connect_timeout=2.0, socket_timeout=READ_BLOCK_MS / 1000 + 9,
                                       health_check_interval=30, max_connections=MAX_CONNECTIONS,
                                       retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self.reply_stream = streams.reply_stream(gateway_id)
        self._requests: dict[str, _Submitted] = {}
        self.router = PrefixRouter(self.redis, routing, routing_balance_margin)
        self._last_id = b"0-0"  # the reply stream is this process's own: everything on it is for us
        self._redis_run_id: str | None = None
        self._schedulers: set[str] = set()  # alive at the last look: they will say what they hold
        self._restart: _RedisRestart | None = None
        self.restart_grace_s = restart_grace_s
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._background: set[asyncio.Task] = set()
        self._unsent_aborts: list[tuple[str, int | None]] = []  # (request id, output index): Redis was down
        self.num_unsubmitted = 0  # admitted here, XADD not yet done
        self.num_unstarted = 0  # submitted, no event back yet (queued in Redis or in a scheduler)
        self.num_unsubmitted_tokens = 0  # their prompt tokens (the gateway's --max-num-queued-tokens)
        self.num_unstarted_tokens = 0
        self.status_ttl_s = 0.1  # admission reads scheduler status at most this often
        self._status_cache: tuple[float, list[SchedulerStatus]] = (0.0, [])
        self._status_read: asyncio.Future | None = None  # the read under way, shared by its callers
        self._memory: dict[bytes, tuple[bytes, EngineMemory | None]] = {}  # key -> (its value, decoded once)
        self._memory_read_at = 0.0
        self._memory_watched_at = float("-inf")
        self._memory_watch_began = float("-inf")  # when this gateway found no watch and set one
        self._memory_lock = asyncio.Lock()  # one read of Redis per interval, however many pages watch
        self.redis_ok = True

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._closing = False
        self._reader = asyncio.create_task(self._read_replies(), name="pagoda-reply-reader")

    async def close(self) -> None:
        """Stop the reader and close the pool, in bounded time."""
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
            _, pending = await asyncio.wait({self._reader}, timeout=CLOSE_TIMEOUT_S)
            if pending:
                log.warning("the reply reader did not stop within %.0f s", CLOSE_TIMEOUT_S)
        if self._background:
            await asyncio.wait(self._background, timeout=1.0)
        try:
            await asyncio.wait_for(self.redis.aclose(), CLOSE_TIMEOUT_S)
        except Exception as exc:  # a pool that cannot close cleanly is dropped all the same
            log.warning("closing the Redis pool: %r", exc)

    # ------------------------------------------------------------------ requests
    async def submit(self, requests: list[GenerateRequest]) -> Generation:
        """Register the requests' queue, then XADD them (so no event can arrive unregistered)."""
        generation = Generation(self, [r.request_id for r in requests])
        for r in requests:
            self._requests[r.request_id] = _Submitted(generation.queue, len(r.prompt_token_ids))
        num_tokens = sum(len(r.prompt_token_ids) for r in requests)
        self.num_unsubmitted += len(requests)
        self.num_unsubmitted_tokens += num_tokens
        payloads = [encode(r) for r in requests]
        try:
            statuses = await self.statuses()
            targets = [await self.router.route(r, statuses) for r in requests]
            pipe = self.redis.pipeline(transaction=False)
            for payload, stream in zip(payloads, targets):
                pipe.xadd(stream, {streams.FIELD: payload})
            for r, stream, entry_id in zip(requests, targets, await pipe.execute()):
                submitted = self._requests[r.request_id]
                submitted.entry_id, submitted.stream = entry_id, stream
        except BaseException:
            for r in requests:  # some may have reached Redis before the failure: stop those
                self._requests.pop(r.request_id, None)
                self.router.finished(r.request_id)
                self.abort(r.request_id)
            raise
        finally:
            self.num_unsubmitted -= len(requests)
            self.num_unsubmitted_tokens -= num_tokens
        self.num_unstarted += len(requests)
        self.num_unstarted_tokens += num_tokens
        for r, payload in zip(requests, payloads):
            self._requests[r.request_id].payload = payload
        return generation

    def unqueue(self, request_id: str) -> None:
        """The request no longer counts as queued here: its first event came (a scheduler runs it),
        or it ended before one."""
        self.num_unstarted -= 1
        submitted = self._requests.get(request_id)
        if submitted is not None and submitted.payload is not None:
            self.num_unstarted_tokens -= submitted.num_prompt_tokens
            submitted.payload = None

    def _release(self, request_id: str, started: bool, abort: bool) -> None:
        if not started:
            self.unqueue(request_id)
        self._requests.pop(request_id, None)
        self.router.finished(request_id)
        if abort:
            self.abort(request_id)

    def fail_all(self, message: str) -> None:
        """End every request in flight here with an error event and abort it in the schedulers (the
        gateway is shutting down)."""
        for request_id, submitted in list(self._requests.items()):
            if submitted.queue is not None:
                submitted.queue.put_nowait(RequestEvent(request_id, [], None, "error", message))
                self.abort(request_id)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop the request in the schedulers, or only its output `index`. Fire and forget: safe to
        call from a cancelled task or a generator's finally."""
        task = asyncio.get_running_loop().create_task(self._abort(request_id, index))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_id: str, index: int | None) -> None:
        try:
            await self.redis.xadd(streams.ABORTS, _abort_fields(request_id, index), maxlen=streams.ABORTS_MAXLEN,
                                  approximate=True)
        except Exception as exc:  # Redis down: the reader sends it once Redis is back
            log.warning("could not abort %s (%s); sending it again once Redis is back", request_id, exc)
            if len(self._unsent_aborts) < streams.ABORTS_MAXLEN:
                self._unsent_aborts.append((request_id, index))

    async def _send_unsent_aborts(self) -> None:
        """The aborts that found Redis down, in one pipeline (kept for the next try if it fails)."""
        unsent, self._unsent_aborts = self._unsent_aborts, []
        pipe = self.redis.pipeline(transaction=False)
        for request_id, index in unsent:
            pipe.xadd(streams.ABORTS, _abort_fields(request_id, index), maxlen=streams.ABORTS_MAXLEN,
                      approximate=True)
        try:
            await pipe.execute()
        except BaseException:
            self._unsent_aborts[:0] = unsent
            raise
        log.warning("sent %d abort(s) that had found Redis down", len(unsent))

    # ------------------------------------------------------------------ status
    async def statuses(self, fresh: bool = False) -> list[SchedulerStatus]:
        """The live schedulers' status (their keys expire when they stop refreshing them). Callers
        that arrive while a read is under way share it."""
        cached_at, cached = self._status_cache
        if not fresh and time.monotonic() - cached_at < self.status_ttl_s:
            return cached
        if self._status_read is None or self._status_read.done():
            self._status_read = asyncio.ensure_future(self._read_statuses())
        return await asyncio.shield(self._status_read)

    async def _read_statuses(self) -> list[SchedulerStatus]:
        started = time.monotonic()  # the cache's age counts from the read's start: what it saw is that old
        keys = [key async for key in self.redis.scan_iter(match=streams.STATUS_PREFIX + "*", count=1000)]
        result = []
        for raw in await self.redis.mget(keys) if keys else []:
            if raw is None:
                continue  # expired between SCAN and MGET
            try:
                status = decode(raw)
            except ProtocolError as exc:
                log.warning("ignoring an undecodable scheduler status: %s", exc)
                continue
            if isinstance(status, SchedulerStatus):
                result.append(status)
        self._status_cache = (started, result)
        return result

    async def memory_snapshots(self) -> list[EngineMemory]:
        """The live schedulers' memory snapshots (their keys expire with their status), sorted by
        engine then scheduler id. Redis is read at most every MEMORY_READ_INTERVAL_S, and each
        snapshot decoded and made JSON once, however many callers ask. Asking is watching: the
        schedulers publish only while streams.MEMORY_WATCH, set here, lives."""
        async with self._memory_lock:
            if time.monotonic() - self._memory_watched_at >= MEMORY_WATCH_INTERVAL_S:
                pipe = self.redis.pipeline(transaction=False)
                pipe.exists(streams.MEMORY_WATCH)
                pipe.set(streams.MEMORY_WATCH, b"1", ex=streams.MEMORY_WATCH_TTL_S)
                watched, _ = await pipe.execute()
                self._memory_watched_at = time.monotonic()
                if not watched:
                    self._memory_watch_began = self._memory_watched_at
            if time.monotonic() - self._memory_read_at >= MEMORY_READ_INTERVAL_S:
                keys = [key async for key in self.redis.scan_iter(match=streams.MEMORY_PREFIX + "*", count=1000)]
                values = await self.redis.mget(keys) if keys else []
                live = {key: raw for key, raw in zip(keys, values) if raw is not None}  # (None: expired since SCAN)
                changed = {key: raw for key, raw in live.items()
                           if key not in self._memory or self._memory[key][0] != raw}
                # off the event loop: some 20 ms at 30,000 blocks, which streams must not wait for
                decoded = await asyncio.to_thread(lambda: {key: _engine_memory(key, raw) for key, raw in changed.items()})
                self._memory = {key: (raw, decoded[key]) if key in decoded else self._memory[key]
                                for key, raw in live.items()}
                self._memory_read_at = time.monotonic()
            engines = [memory for _, memory in self._memory.values() if memory is not None]
            return sorted(engines, key=lambda m: (m.engine, m.scheduler_id))

    async def first_memory_snapshots(self) -> list[EngineMemory]:
        """`memory_snapshots`, waiting up to FIRST_SNAPSHOT_WAIT_S for the ready schedulers to publish
        when this call began the watch (nobody watched: none had published)."""
        engines = await self.memory_snapshots()
        ready = {s.scheduler_id for s in await self.statuses() if s.workers_ready}
        while (ready - {m.scheduler_id for m in engines}
               and time.monotonic() - self._memory_watch_began < FIRST_SNAPSHOT_WAIT_S):
            await asyncio.sleep(MEMORY_READ_INTERVAL_S)
            engines = await self.memory_snapshots()
        return engines

    # ------------------------------------------------------------------ the reader
    async def _read_replies(self) -> None:
        last_trim = time.monotonic()
        backoff = 0.1
        while not self._closing:
            try:
                await self._read_batch(block=True)
                if self._unsent_aborts:
                    await self._send_unsent_aborts()
                if time.monotonic() - last_trim > TRIM_INTERVAL_S:
                    if self._last_id != b"0-0":
                        await self.redis.xtrim(self.reply_stream, minid=self._last_id)  # drop what we have read
                    await self._check_redis_restart()
                    if self._restart is not None:
                        await self._recover_lost_requests()
                    last_trim = time.monotonic()
                self.redis_ok, backoff = True, 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: keep trying, never take the app down
                # a cancel that the Redis client turned into an error (its connect and disconnect
                # timeouts can) is still a cancel: without this the reader outlives close()
                if self._closing or _cancelling(asyncio.current_task()):
                    raise asyncio.CancelledError from exc
                if self.redis_ok:
                    log.warning("reply reader lost Redis (%s); retrying", exc)
                self.redis_ok = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _read_batch(self, block: bool) -> None:
        replies = await self.redis.xread({self.reply_stream: self._last_id}, count=READ_COUNT,
                                         block=READ_BLOCK_MS if block else None)
        for _, entries in replies or []:
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._dispatch(fields)

    async def _check_redis_restart(self) -> None:
        """A Redis that restarted (its run_id changed) without persistence lost what it queued: wait
        for the schedulers to say what they hold (_recover_lost_requests)."""
        run_id = (await self.redis.info("server")).get("run_id")
        if self._redis_run_id is not None and run_id != self._redis_run_id:
            log.warning("Redis restarted: waiting up to %g s for %d scheduler(s) to say which requests they hold",
                        self.restart_grace_s, len(self._schedulers))
            self._restart = _RedisRestart(time.monotonic() + self.restart_grace_s, set(self._schedulers))
        elif self._restart is None:
            self._schedulers = {s.scheduler_id for s in await self.statuses()}
        self._redis_run_id = run_id

    async def _recover_lost_requests(self) -> None:
        """Once every scheduler has said what it holds (or the grace period is over): a request no
        scheduler holds and the new Redis lacks is put on the stream again, under its id, if it had
        not started (a scheduler that holds it after all drops the duplicate); one that had started
        lost part of its output, and ends with an error and is aborted everywhere."""
        held, reported = await self._held_requests()
        alive = {s.scheduler_id for s in await self.statuses(fresh=True)}
        if (self._restart.schedulers | alive) - reported and time.monotonic() < self._restart.deadline:
            return
        self._restart = None
        candidates = {r: s.entry_id for r, s in self._requests.items()
                      if r not in held and s.queue is not None and s.entry_id is not None}
        if not candidates:
            return
        first = min(candidates.values(), key=lambda e: tuple(map(int, e.split(b"-"))))
        queued = await self._queued_request_ids(first)
        lost = [r for r in candidates if r not in queued]
        # (a handler may have released one during the await above)
        started = {r for r in lost if (s := self._requests.get(r)) is not None and s.has_event}
        await self._read_batch(block=False)  # a request that ended has its events out before its entry goes
        # (an error queued behind a started request's last events is never read: it has ended by then)
        lost = [r for r in lost if (s := self._requests.get(r)) is not None and s.queue is not None
                and (r in started or not s.has_event)]
        unstarted = [r for r in lost if r not in started and self._requests[r].payload is not None]
        if unstarted:
            log.warning("Redis restarted: queueing again %d request(s) it lost before a scheduler read them",
                        len(unstarted))
            try:
                pipe = self.redis.pipeline(transaction=False)
                for request_id in unstarted:
                    submitted = self._requests[request_id]
                    pipe.xadd(submitted.stream, {streams.FIELD: submitted.payload})
                for request_id, entry_id in zip(unstarted, await pipe.execute()):
                    if (submitted := self._requests.get(request_id)) is not None:  # not released meanwhile
                        submitted.entry_id = entry_id
                lost = [r for r in lost if r not in unstarted]
            except Exception as exc:  # Redis went again: these fail as lost
                log.warning("could not queue them again (%s)", exc)
        if lost:
            log.warning("Redis restarted: failing %d request(s) it lost (no scheduler holds them)", len(lost))
        for request_id in lost:
            submitted = self._requests.get(request_id)
            if submitted is None or submitted.queue is None:  # its client left while the pipeline ran
                continue
            queue = submitted.queue
            message = OUTPUT_LOST if request_id in started else REDIS_RESTARTED
            queue.put_nowait(RequestEvent(request_id, [], None, "error", message))
            self.abort(request_id)

    async def _queued_request_ids(self, first_entry_id: bytes) -> set[str]:
        """The ids of the requests in the requests streams (the shared one and every engine group's)
        from `first_entry_id` on: by request id, not entry id, since a draining scheduler hands a
        request back under a new entry, and a busy group's request may be stolen into another's."""
        ids = set()
        group_streams = [key async for key in self.redis.scan_iter(match=streams.GROUP_REQUESTS_PREFIX + "*",
                                                                     count=1000, _type="stream")]
        for stream in [streams.REQUESTS, *group_streams]:
            start = first_entry_id
            while True:
                entries = await self.redis.xrange(stream, start, "+", count=1000)
                for _, fields in entries:
                    try:
                        request = decode(fields.get(streams.FIELD, b""))
                    except ProtocolError:
                        continue
                    if isinstance(request, GenerateRequest):
                        ids.add(request.request_id)
                if len(entries) < 1000:
                    break
                start = b"(" + entries[-1][0]
        return ids

    async def _held_requests(self) -> tuple[set[str], set[str]]:
        """The request ids the schedulers hold, and the schedulers that said so, since Redis restarted."""
        keys = [key async for key in self.redis.scan_iter(match=streams.HELD_PREFIX + "*", count=1000)]
        held, reported = set(), set()
        for raw in await self.redis.mget(keys) if keys else []:
            try:
                message = decode(raw) if raw is not None else None
            except ProtocolError as exc:
                log.warning("ignoring an undecodable list of held requests: %s", exc)
                continue
            if isinstance(message, HeldRequests) and isinstance(message.request_ids, list):
                reported.add(message.scheduler_id)
                held.update(message.request_ids)
        return held, reported

    def _dispatch(self, fields: dict) -> None:
        """One reply entry: the events a scheduler's flush wrote for this gateway, to their requests."""
        try:
            events = decode_events(fields.get(streams.FIELD, b""))
        except ProtocolError as exc:
            log.warning("dropped a malformed reply: %s", exc)
            return
        for event in events:
            self._deliver(event)

    def _deliver(self, event: RequestEvent) -> None:
        submitted = self._requests.get(event.request_id)
        if submitted is None or submitted.queue is None:  # finished or aborted here, or its events stopped
            return
        submitted.has_event = True
        if event.seq:
            last = submitted.last_seq
            if event.seq <= last:
                log.warning("dropped event %d of %s: already seen (a retried write)", event.seq, event.request_id)
                return
            submitted.last_seq = event.seq
            if event.seq > last + 1:  # events in between were lost (Redis restarted before this gateway read them)
                log.warning("request %s lost events %d to %d; failing it", event.request_id, last + 1, event.seq - 1)
                submitted.queue.put_nowait(RequestEvent(event.request_id, [], None, "error", OUTPUT_LOST))
                submitted.queue = None  # its end: nothing more goes to its handler
                self.abort(event.request_id)
                return
        submitted.queue.put_nowait(event)
