"""The scheduler process: requests from Redis, plans to the workers over ZeroMQ, tokens back to Redis.

    loop: aborts ─▶ new requests (XREADGROUP) ─▶ schedule ─▶ plan to every rank ─▶ rank 0's result
          ─▶ update ─▶ XADD events to each request's reply stream ─▶ XACK the requests that ended

A request is acknowledged in the requests stream only when it ends, so a request held by a
scheduler that dies stays pending in Redis. A step whose result misses its deadline fails every
request the group holds; the epoch advances so workers drop their state.
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
WORKER_SILENCE_S = 10.0  # an idle worker says hello every 2 s; silence this long means it is gone
IDLE_BLOCK_MS = 50
READ_BATCH = 64


@dataclass(slots=True)
class _Tracked:
    reply_stream: str
    entry_id: bytes  # in the requests stream, acknowledged when the request ends
    logprobs: bool
    ended: set[int] = field(default_factory=set)  # outputs whose last event went out


class SchedulerServer:
    def __init__(self, engine_config: EngineConfig, serving: ServingConfig) -> None:
        self.engine_config = engine_config
        self.serving = serving
        self.id = serving.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.redis = redis.Redis.from_url(serving.redis_url)
        self.link = WorkerLink(serving.zmq_address, serving.world_size)
        self.scheduler: Scheduler | None = None
        self.hello: WorkerHello | None = None
        self.tracked: dict[str, _Tracked] = {}
        self.early_aborts: dict[str, float] = {}  # aborts that arrived before their request
        self.epoch = int(time.time() * 1000) % (1 << 31)  # a restarted scheduler starts a new epoch
        self.aborts_cursor = b"0-0"
        self.stopping = False
        self.group_generation = -1
        self._last_status = 0.0

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self._ensure_group()
        self.aborts_cursor = self._latest_abort_id()
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

    def _iterate(self) -> None:
        self._publish_status()
        if self.scheduler is not None and self.link.generation != self.group_generation:
            self._fail_group("a worker restarted")
        if self.scheduler is None:
            self.link.poll_hello(timeout_ms=200)
            if self.link.ready:
                self._start_group()
            return
        self._read_aborts()
        busy = self.scheduler.has_unfinished_requests()
        if not busy:
            self.link.drain()
            if self.link.silent_for() > WORKER_SILENCE_S:
                self._fail_group(f"no word from the workers for {WORKER_SILENCE_S:g} s")
                return
        self._read_requests(block=not busy)
        if self.scheduler.has_unfinished_requests():
            self._step()

    def _shutdown(self) -> None:
        """Requests still held end with an error (their clients would otherwise wait for nothing)."""
        try:
            for request_id, tracked in list(self.tracked.items()):
                self._finish_untracked(request_id, tracked, "error", "the scheduler is shutting down")
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

    def _latest_abort_id(self) -> bytes:
        last = self.redis.xrevrange(streams.ABORTS, count=1)
        return last[0][0] if last else b"0-0"

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

    def _admit(self, entry_id: bytes, fields: dict) -> None:
        try:
            request = decode(fields.get(streams.FIELD, b""))
            if not isinstance(request, GenerateRequest):
                raise ProtocolError(f"expected a GenerateRequest, got {type(request).__name__}")
            if not (isinstance(request.request_id, str) and isinstance(request.reply_stream, str)):
                raise ProtocolError("request_id and reply_stream must be strings")
        except ProtocolError as exc:
            log.warning("dropped malformed request %s: %s", entry_id, exc)
            self._ack(self.redis, entry_id)
            return
        if request.request_id in self.tracked:
            self._ack(self.redis, entry_id)  # a duplicate
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
        if self.early_aborts:  # runs every step: prune only when there is something to prune
            cutoff = time.monotonic() - 60
            self.early_aborts = {k: t for k, t in self.early_aborts.items() if t > cutoff}

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
        result = self.link.gather(plan, self.serving.step_timeout_s, on_wait=self._publish_status)
        if result is None or result.error:
            if result is not None:
                reason = result.error
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

    def _emit(self, outputs: list[RequestOutput]) -> None:
        pipe = self.redis.pipeline(transaction=False)
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
                self._add_event(pipe, tracked, event)
                if seq.finish_reason is not None:
                    tracked.ended.add(seq.index)
            if out.finished:
                self._ack(pipe, tracked.entry_id)
                del self.tracked[out.request_id]
        pipe.execute()

    def _finish_untracked(self, request_id: str, tracked: _Tracked, reason: str, error: str | None) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._add_event(pipe, tracked, RequestEvent(request_id, [], None, reason, error))
        self._ack(pipe, tracked.entry_id)
        pipe.execute()

    @staticmethod
    def _ack(pipe, entry_id: bytes) -> None:
        """The request ended: acknowledge it and drop it from the stream, which would grow forever."""
        pipe.xack(streams.REQUESTS, streams.SCHEDULER_GROUP, entry_id)
        pipe.xdel(streams.REQUESTS, entry_id)

    @staticmethod
    def _add_event(pipe, tracked: _Tracked, event: RequestEvent) -> None:
        pipe.xadd(tracked.reply_stream, {streams.FIELD: encode(event)}, maxlen=100_000, approximate=True)
        pipe.expire(tracked.reply_stream, streams.REPLY_STREAM_TTL_S)

    def _fail_group(self, message: str) -> None:
        """The workers' KV state is lost: every request this group holds ends with an error."""
        log.error("%s; failing %d request(s) and waiting for workers", message, len(self.tracked))
        for request_id, tracked in list(self.tracked.items()):
            self._finish_untracked(request_id, tracked, "error", message)
        self.tracked.clear()
        self.scheduler = None
        if self.link.generation == self.group_generation:  # else the link already took on new ranks
            self.link.forget_workers()
        self.epoch = (self.epoch + 1) % (1 << 31)

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
        )
        try:
            self.redis.set(streams.status_key(self.id), encode(status), px=int(streams.STATUS_TTL_S * 1000))
        except redis.RedisError as exc:
            log.warning("could not publish status: %s", exc)


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
