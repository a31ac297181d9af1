"""The scheduler process: requests from Redis, plans to the workers over ZeroMQ, tokens back to Redis.

    loop: aborts ─▶ new requests (XREADGROUP) ─▶ schedule ─▶ plan to every rank ─▶ rank 0's result
          ─▶ update ─▶ XADD events to each request's reply stream ─▶ XACK the requests that ended

A request is acknowledged in the requests stream only when it ends, so a request held by a
scheduler that dies stays pending in Redis: a live scheduler re-claims its own entries every
second (XCLAIM, which resets their idle time) and takes over entries idle longer than CLAIM_IDLE_MS
(XAUTOCLAIM). A taken-over request that had not streamed a token runs from the start; one that had
(marked in the `pagoda:started` hash) ends with an error, never with its text repeated.

A step whose result misses its deadline, or a worker whose connection closes, fails every request
the group holds; the epoch advances so workers drop their state. Events go out through an outbox
that survives a Redis outage (sent, in order, once Redis is back).

SIGTERM drains: no new requests are read, requests that have not started are handed back to the
stream for another (or the restarted) scheduler, running ones finish within `drain_timeout_s`,
the rest end with an error; then the process exits 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import dataclasses
from dataclasses import dataclass, field

import redis

from common import streams
from common.config import EngineConfig, ServingConfig
from common.protocol import (
    GenerateRequest, ProtocolError, RequestEvent, SamplingParams, SchedulerStatus, WorkerHello, decode, encode,
)
from common.transport import WorkerLink
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.sequence import RequestOutput

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.5
CLAIM_INTERVAL_S = 1.0  # how often a scheduler renews its claims and looks for orphaned requests
CLAIM_IDLE_MS = 10_000  # a pending entry unclaimed this long belongs to a dead scheduler
MAX_DELIVERIES = 3  # a request whose schedulers keep dying is not given to another one
# An abort can come long before its request is read (queued behind others in Redis): it is kept
# longer than a gateway waits for a request (request_timeout_s, 600 s by default).
EARLY_ABORT_TTL_S = 900.0
WORKER_SILENCE_S = 10.0  # an idle worker says hello every 2 s; silence this long means it is gone
IDLE_BLOCK_MS = 50
READ_BATCH = 64


@dataclass(slots=True)
class _Tracked:
    reply_stream: str
    entry_id: bytes  # in the requests stream, acknowledged when the request ends
    logprobs: bool
    ended: set[int] = field(default_factory=set)  # outputs whose last event went out
    started: bool = False  # a token went out: the request can no longer be run again from the start
    num_sent: int = 0  # token-bearing events sent (RequestEvent.seq)


class SchedulerServer:
    def __init__(self, engine_config: EngineConfig, serving: ServingConfig) -> None:
        self.engine_config = engine_config
        self.serving = serving
        self.id = serving.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.redis = redis.Redis.from_url(serving.redis_url, socket_timeout=10, socket_connect_timeout=2,
                                          retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self.link = WorkerLink(serving.zmq_address, serving.world_size)
        self.scheduler: Scheduler | None = None
        self.hello: WorkerHello | None = None
        self.tracked: dict[str, _Tracked] = {}
        self.early_aborts: dict[str, float] = {}  # aborts that arrived before their request
        self.epoch = int(time.time() * 1000) % (1 << 31)  # a restarted scheduler starts a new epoch
        self.aborts_cursor = b"0-0"
        self.stopping = False
        self.drain_deadline: float | None = None  # set by SIGTERM
        self._drain_logged = False
        self.group_generation = -1
        self.outbox: list[tuple] = []  # Redis writes not yet done: ("event", stream, event) | ("ack", entry, id)
        self._last_status = 0.0
        self._last_claim = 0.0
        self._last_prune = 0.0

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            signal.signal(signal.SIGTERM, lambda *_: self.drain())
        self._ensure_group()
        self.aborts_cursor = self._recent_aborts_id()
        log.info("scheduler %s waiting for %d worker(s) on %s", self.id, self.serving.world_size, self.serving.zmq_address)
        try:
            while not self.stopping:
                try:
                    self._iterate()
                except redis.RedisError as exc:  # Redis restarting: keep the workers, retry
                    log.warning("redis: %s; retrying", exc)
                    time.sleep(1.0)
        finally:
            self._shutdown()

    def drain(self, timeout_s: float | None = None) -> None:
        """Stop taking requests; hand back those not started; finish the rest within the timeout."""
        if self.drain_deadline is None:  # runs in a signal handler: no logging here
            timeout_s = self.serving.drain_timeout_s if timeout_s is None else timeout_s
            self.drain_deadline = time.monotonic() + timeout_s

    def _iterate(self) -> None:
        self._flush()
        self._publish_status()
        if self.drain_deadline is not None and not self._drain_logged:
            self._drain_logged = True
            log.info("draining: %d request(s) held, %.0f s to finish", len(self.tracked),
                     self.drain_deadline - time.monotonic())
        if self.drain_deadline is not None and self._drained():
            self.stopping = True
            return
        if self.scheduler is not None and self.link.generation != self.group_generation:
            self._fail_group("a worker restarted")
        if self.scheduler is not None and self.link.check_connections() is not None:
            self._fail_group(f"the worker failed: {_lost(self.link.lost)}")
        if self.scheduler is None:
            self.link.poll_hello(timeout_ms=200)
            if self.link.ready:
                self._start_group()
            return
        self._read_aborts()
        self._claim()
        busy = self.scheduler.has_unfinished_requests()
        if not busy:
            self.link.drain()
            if self.link.silent_for() > WORKER_SILENCE_S:
                self._fail_group(f"no word from the workers for {WORKER_SILENCE_S:g} s")
                return
        if self.drain_deadline is None:
            self._read_requests(block=not busy)
        elif not busy:
            time.sleep(IDLE_BLOCK_MS / 1000)
        if self.scheduler.has_unfinished_requests():
            self._step()

    def _drained(self) -> bool:
        """While draining: hand back what has not started; True once nothing runs or time is up."""
        for request_id, tracked in list(self.tracked.items()):
            if not tracked.started:  # queued again as a new entry: the next scheduler reads it at once
                del self.tracked[request_id]
                if self.scheduler is not None:
                    self.scheduler.abort_request(request_id)
                for _, fields in self.redis.xrange(streams.REQUESTS, tracked.entry_id, tracked.entry_id):
                    self.outbox.append(("requeue", fields[streams.FIELD], None))
                self.outbox.append(("ack", tracked.entry_id, request_id))
        self._flush()
        return not self.tracked or time.monotonic() > self.drain_deadline

    def _shutdown(self) -> None:
        """Requests still held end with an error (their clients would otherwise wait for nothing)."""
        try:
            for request_id, tracked in list(self.tracked.items()):
                self._finish_untracked(request_id, tracked, "error", "the scheduler is shutting down")
            self._flush()
            self.redis.delete(streams.status_key(self.id))
        except redis.RedisError as exc:
            log.warning("redis unavailable at shutdown: %s", exc)
        self.link.close()

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @staticmethod
    def _recent_aborts_id() -> bytes:
        """Read recent aborts too: those for requests this scheduler may take over from a dead one."""
        return f"{int((time.time() - EARLY_ABORT_TTL_S) * 1000)}-0".encode()

    def _start_group(self) -> None:
        """Every rank said hello: size the scheduler from their capacity (the smallest pool)."""
        self.hello = self.link.hellos[0]
        self.group_generation = self.link.generation
        num_gpu_blocks = min(h.num_gpu_blocks for h in self.link.hellos.values())
        num_cpu_blocks = min(h.num_cpu_blocks for h in self.link.hellos.values())
        if self.hello.block_size != self.engine_config.block_size:
            log.warning("workers use block size %d; the scheduler follows", self.hello.block_size)
        config = self.engine_config.replace(block_size=self.hello.block_size, max_model_len=self.hello.max_model_len)
        self.scheduler = Scheduler.from_hello(
            config, dataclasses.replace(self.hello, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)
        )
        self.scheduler.epoch = self.epoch
        log.info("workers ready: %s, %d KV blocks of %d tokens, context %d",
                 self.hello.model, self.hello.num_gpu_blocks, self.hello.block_size, self.hello.max_model_len)

    # ------------------------------------------------------------------ inputs
    def _read_requests(self, block: bool) -> None:
        room = self.engine_config.max_num_seqs - len(self.scheduler.waiting)
        if room <= 0:
            return
        try:
            replies = self.redis.xreadgroup(
                streams.SCHEDULER_GROUP, self.id, {streams.REQUESTS: ">"}, count=min(room, READ_BATCH),
                block=IDLE_BLOCK_MS if block else None,
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("the requests stream has no consumer group (Redis restarted empty?): recreating it")
            self._ensure_group()
            return
        for _, entries in replies or []:
            for entry_id, fields in entries:
                self._admit(entry_id, fields)

    def _claim(self) -> None:
        """Renew this scheduler's claims on its requests; take over requests of dead schedulers."""
        now = time.monotonic()
        if now - self._last_claim < CLAIM_INTERVAL_S:
            return
        self._last_claim = now
        room = self.engine_config.max_num_seqs - len(self.scheduler.waiting)
        try:
            self._drop_taken_over()
            self._renew_claims()
            if self.drain_deadline is not None or room <= 0:
                return
            entries = self.redis.xautoclaim(  # [next id, entries] (Redis 6.2), + deleted ids (7.0)
                streams.REQUESTS, streams.SCHEDULER_GROUP, self.id, CLAIM_IDLE_MS, start_id="0-0",
                count=min(room, READ_BATCH),
            )[1]
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return  # Redis restarted empty: _read_requests recreates the group
        if any(fields is None for _, fields in entries):  # deleted from the stream while pending
            self._ack_deleted()
        self._take_over([(entry_id, fields) for entry_id, fields in entries if fields is not None])

    def _take_over(self, entries: list[tuple[bytes, dict]]) -> None:
        """Run a dead scheduler's request again, unless it had streamed (its text would repeat) or
        was delivered to too many schedulers that died (it may be what kills them)."""
        if not entries:
            return
        requests = [_try_decode_request(fields) for _, fields in entries]
        started = self.redis.hmget(streams.STARTED, [r.request_id if r else "" for r in requests])
        deliveries = self._deliveries([entry_id for entry_id, _ in entries])
        for (entry_id, fields), request, owner in zip(entries, requests, started):
            if request is None:
                self._admit(entry_id, fields)  # malformed: dropped there
                continue
            if request.request_id in self.tracked:
                continue  # ours all along (a claim renewed late)
            log.warning("took over request %s from a scheduler that stopped", request.request_id)
            if owner is not None:
                self._interrupt(entry_id, request, "the scheduler serving this request stopped after it had started "
                                                   "streaming")
            elif deliveries.get(entry_id, 0) > MAX_DELIVERIES:
                self._interrupt(entry_id, request, f"the request was taken by {MAX_DELIVERIES} schedulers that each "
                                                   "stopped; it is not tried again")
            else:
                self._admit(entry_id, fields)

    def _drop_taken_over(self) -> None:
        """A request another scheduler took over (this one was stopped or stalled past CLAIM_IDLE_MS)
        is dropped here without a word: it is the other's now. Between steps only."""
        if not self.tracked:
            return
        own = {p["message_id"] for p in self.redis.xpending_range(
            streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", len(self.tracked) + 1000, consumername=self.id)}
        for request_id, tracked in list(self.tracked.items()):
            if tracked.entry_id in own:
                continue
            holder = self.redis.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, tracked.entry_id,
                                               tracked.entry_id, 1)
            if holder and holder[0]["consumer"].decode() != self.id:  # (none: Redis restarted empty; keep it)
                log.warning("request %s was taken over by %s; dropping it here", request_id,
                            holder[0]["consumer"].decode())
                del self.tracked[request_id]
                self.scheduler.abort_request(request_id)

    def _renew_claims(self) -> None:
        """XCLAIM with JUSTID resets an entry's idle time (and not its delivery count)."""
        ids = [t.entry_id for t in self.tracked.values()]
        for i in range(0, len(ids), 1000):
            self.redis.xclaim(streams.REQUESTS, streams.SCHEDULER_GROUP, self.id, 0, ids[i:i + 1000], justid=True)

    def _ack_deleted(self) -> None:
        """Acknowledge this scheduler's pending entries that are gone from the stream (Redis 6.2's
        XAUTOCLAIM returns them as nils and keeps them pending; 7.0 drops them itself)."""
        tracked = {t.entry_id for t in self.tracked.values()}
        for p in self.redis.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+", 1000,
                                           consumername=self.id):
            if p["message_id"] not in tracked and not self.redis.xrange(streams.REQUESTS, p["message_id"],
                                                                        p["message_id"]):
                self.outbox.append(("ack", p["message_id"], None))

    def _deliveries(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        """How many times each of this scheduler's pending entries has been delivered (claims count)."""
        pending = self.redis.xpending_range(streams.REQUESTS, streams.SCHEDULER_GROUP, "-", "+",
                                            len(entry_ids) + len(self.tracked) + 1000, consumername=self.id)
        wanted = set(entry_ids)
        return {p["message_id"]: p["times_delivered"] for p in pending if p["message_id"] in wanted}

    def _interrupt(self, entry_id: bytes, request: GenerateRequest, message: str) -> None:
        self._finish_untracked(request.request_id, _Tracked(request.reply_stream, entry_id, False), "error", message)

    def _admit(self, entry_id: bytes, fields: dict) -> None:
        try:
            request = _decode_request(fields)
        except ProtocolError as exc:
            log.warning("dropped malformed request %s: %s", entry_id, exc)
            self.outbox.append(("ack", entry_id, None))
            return
        if request.request_id in self.tracked:
            self.outbox.append(("ack", entry_id, None))  # a duplicate
            return
        params = request.sampling_params
        logprobs = isinstance(params, SamplingParams) and params.logprobs is not None
        tracked = _Tracked(request.reply_stream, entry_id, logprobs)
        if self.early_aborts.pop(request.request_id, None) is not None:
            self._finish_untracked(request.request_id, tracked, "abort", None)
            return
        invalid = _invalid_request(request, self.hello.vocab_size)
        if invalid is not None:  # the gateway validates; an entry from elsewhere must not reach a worker
            self._finish_untracked(request.request_id, tracked, "error", invalid)
            return
        try:
            self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.sampling_params)
        except RequestRejected as exc:
            self._finish_untracked(request.request_id, tracked, "error", str(exc))
            return
        self.tracked[request.request_id] = tracked

    def _read_aborts(self) -> None:
        replies = self.redis.xread({streams.ABORTS: self.aborts_cursor}, count=1000)
        for _, entries in replies or []:
            for entry_id, fields in entries:
                self.aborts_cursor = entry_id
                request_id = fields.get(streams.ABORT_FIELD, b"").decode(errors="replace")
                self._abort(request_id)
        now = time.monotonic()
        if self.early_aborts and now - self._last_prune > 10:  # not every step: the dict can be large
            self._last_prune = now
            self.early_aborts = {k: t for k, t in self.early_aborts.items() if t > now - EARLY_ABORT_TTL_S}

    def _abort(self, request_id: str) -> None:
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            self.early_aborts[request_id] = time.monotonic()
            return
        self.scheduler.abort_request(request_id)
        self._finish_untracked(request_id, tracked, "abort", None)

    # ------------------------------------------------------------------ step
    def _step(self) -> None:
        plan = self.scheduler.schedule()
        self.link.send_plan(plan)  # even an empty plan: it carries the ids workers must drop
        result = self.link.gather(plan, self.serving.step_timeout_s, on_wait=self._heartbeats)
        if result is None or result.error:
            if result is not None:
                reason = result.error
            elif self.link.lost is not None:
                reason = _lost(self.link.lost)
            elif self.link.generation != self.group_generation:  # gather saw a rank's new hello
                reason = "a worker restarted mid-step"
            else:
                reason = f"no result within {self.serving.step_timeout_s:g} s"
            self._fail_group(f"the worker failed: {reason}")
            return
        try:
            outputs = self.scheduler.update(result)
        except (ValueError, RuntimeError) as exc:  # the result breaks the contract: the state is unsure
            self._fail_group(f"the worker's result was invalid: {exc}")
            return
        self._emit(outputs)
        if not (plan.new_seqs or plan.cached_seqs):
            time.sleep(0.001)  # nothing fits yet

    def _heartbeats(self) -> None:
        """While a step runs: keep the status and this scheduler's claims fresh."""
        self._publish_status()
        if time.monotonic() - self._last_claim >= CLAIM_INTERVAL_S:
            self._last_claim = time.monotonic()
            try:
                self._renew_claims()
            except redis.RedisError as exc:
                log.warning("could not renew claims: %s", exc)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            tracked = self.tracked.get(out.request_id)
            if tracked is None:
                continue
            for seq in out.outputs:
                if not seq.num_new_tokens and seq.finish_reason is None:
                    continue
                if seq.finish_reason is not None and seq.index in tracked.ended:
                    continue
                logprobs = None
                if tracked.logprobs and seq.logprobs is not None and seq.num_new_tokens:
                    logprobs = [[lp, top] for lp, top in seq.logprobs[-seq.num_new_tokens:]]
                event = RequestEvent(out.request_id, seq.new_token_ids, logprobs, seq.finish_reason, None, seq.index)
                if event.token_ids:
                    tracked.num_sent += 1
                    event.seq = tracked.num_sent
                if event.token_ids and not tracked.started:
                    tracked.started = True
                    self.outbox.append(("started", out.request_id, None))
                self.outbox.append(("event", tracked.reply_stream, event))
                if seq.finish_reason is not None:
                    tracked.ended.add(seq.index)
            if out.finished:
                self.outbox.append(("ack", tracked.entry_id, out.request_id))
                del self.tracked[out.request_id]
        self._flush()

    def _finish_untracked(self, request_id: str, tracked: _Tracked, reason: str, error: str | None) -> None:
        self.outbox.append(("event", tracked.reply_stream, RequestEvent(request_id, [], None, reason, error)))
        self.outbox.append(("ack", tracked.entry_id, request_id))
        self._flush()

    def _flush(self) -> None:
        """Send the outbox in one pipeline. On a connection error it is kept, in order, for the next
        try; a command Redis refuses (XACK after Redis restarted empty: no group) is logged, not retried."""
        if not self.outbox:
            return
        pipe = self.redis.pipeline(transaction=False)
        for kind, a, b in self.outbox:
            if kind == "event":
                pipe.xadd(a, {streams.FIELD: encode(b)}, maxlen=100_000, approximate=True)
                pipe.expire(a, streams.REPLY_STREAM_TTL_S)
            elif kind == "started":
                pipe.hset(streams.STARTED, a, self.id)
            elif kind == "requeue":
                pipe.xadd(streams.REQUESTS, {streams.FIELD: a})
            else:  # the request ended: acknowledge it and drop it from the stream, which would grow forever
                pipe.xack(streams.REQUESTS, streams.SCHEDULER_GROUP, a)
                pipe.xdel(streams.REQUESTS, a)
                if b is not None:
                    pipe.hdel(streams.STARTED, b)
        results = pipe.execute(raise_on_error=False)
        self.outbox.clear()
        refused = [r for r in results if isinstance(r, redis.ResponseError)]
        if refused:
            log.warning("redis refused %d command(s), e.g. %s", len(refused), refused[0])

    def _fail_group(self, message: str) -> None:
        """The workers' KV state is lost: every request this group holds ends with an error."""
        log.error("%s; failing %d request(s) and waiting for workers", message, len(self.tracked))
        failed, self.tracked = self.tracked, {}
        self.scheduler = None
        if self.link.generation == self.group_generation:  # else the link already took on new ranks
            self.link.forget_workers()
        self.epoch = (self.epoch + 1) % (1 << 31)
        for request_id, tracked in failed.items():  # last: the flush may raise while Redis is down
            self.outbox.append(("event", tracked.reply_stream, RequestEvent(request_id, [], None, "error", message)))
            self.outbox.append(("ack", tracked.entry_id, request_id))
        self._flush()

    # ------------------------------------------------------------------ status
    def _publish_status(self) -> None:
        now = time.time()
        if now - self._last_status < STATUS_INTERVAL_S:
            return
        self._last_status = now
        s, hello = self.scheduler, self.hello
        status = SchedulerStatus(
            scheduler_id=self.id, model=hello.model if hello else "", max_model_len=hello.max_model_len if hello else 0,
            block_size=hello.block_size if hello else self.engine_config.block_size,
            num_gpu_blocks=hello.num_gpu_blocks if hello else 0, max_request_tokens=s.max_request_tokens if s else 0,
            workers_ready=s is not None and self.link.ready,
            num_running=s.num_running_seqs if s else 0, num_waiting=len(s.waiting) if s else 0,
            num_swapped=s.num_swapped_seqs if s else 0,
            kv_cache_usage=s.block_manager.usage if s else 0.0, num_preemptions_total=s.num_preemptions if s else 0,
            prefix_cache_queries_total=s.prefix_cache_queries if s else 0,
            prefix_cache_hits_total=s.prefix_cache_hits if s else 0, updated_at=now,
            max_num_seqs=self.engine_config.max_num_seqs, max_num_batched_tokens=self.engine_config.max_num_batched_tokens,
            enable_chunked_prefill=self.engine_config.enable_chunked_prefill,
        )
        try:
            self.redis.set(streams.status_key(self.id), encode(status), px=int(streams.STATUS_TTL_S * 1000))
        except redis.RedisError as exc:
            log.warning("could not publish status: %s", exc)


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


def _lost(rank: int) -> str:
    return f"worker rank {rank} disconnected (exited, was killed or stopped answering)"


def _invalid_request(request: GenerateRequest, vocab_size: int) -> str | None:
    """Why a decoded request cannot be served, or None (a badly typed one would break the loop)."""
    if not isinstance(request.sampling_params, SamplingParams):
        return "invalid request: sampling_params is not a SamplingParams"
    ids = request.prompt_token_ids
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        return f"invalid request: prompt_token_ids must be a list of token ids in [0, {vocab_size})"
    return None


def serve(engine_config: EngineConfig, serving: ServingConfig) -> None:
    SchedulerServer(engine_config, serving).serve_forever()
