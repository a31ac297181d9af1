"""The scheduler process: requests from Redis, plans to the workers over ZeroMQ, tokens back to Redis.

    loop: aborts ─▶ new requests (a dead scheduler's first) ─▶ schedule ─▶ plan to every rank
          ─▶ rank 0's result ─▶ update ─▶ events to each request's reply stream ─▶ XACK those that ended

With async scheduling (the default) plan N+1 is sent before N's result is gathered, so the
workers go from one plan to the next without waiting on this process (scheduler/scheduler.py).

This module owns the worker group's life and the step; scheduler/request_stream.py owns the Redis
side: the inbox (reads, claims, takeover), the outbox of events and the status.

A step whose result misses its deadline, or a worker rank whose connection closes (killed, or
hung: the ZeroMQ heartbeat), fails every request the group holds that has streamed; those that
have not stay pending in Redis for any live scheduler to take over. The epoch advances so the
ranks drop their state and form their group afresh once all are back. An exception raised while
scheduling or updating one request fails that request alone; the others go on.

SIGTERM drains: no new requests are read, requests that have not started are handed back to the
stream for another (or the restarted) scheduler, running ones finish within `drain_timeout_s`,
the rest end with an error; then the process exits 0.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time

import redis

from common import streams
from common.admission import AdmissionLimits
from common.config import EngineConfig, ServingConfig
from common.gc_heap import freeze_startup_heap
from common.kv_events import AllBlocksCleared, KVEventBatch, encode_batch
from common.multimodal import invalid_items
from common.protocol import GenerateRequest, SamplingParams, SchedulerStatus, StepPlan, WorkerHello, encode
from common.transport import WorkerLink
from scheduler.memory_view import MemoryEventLog, PackedTables, build_snapshot, memory_version
from scheduler.inbox import IDLE_BLOCK_MS, Arrival
from scheduler.outbox import PublishKVEvents
from scheduler.request_stream import RequestStream
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.step_pipeline import StepPipeline

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.5
MEMORY_INTERVAL_S = 0.25  # the dashboard's snapshot, at most this often, only when it changed and is watched


class SchedulerServer(StepPipeline):
    def __init__(self, engine_config: EngineConfig, serving: ServingConfig) -> None:
        super().__init__()
        self.engine_config = engine_config
        self.serving = serving
        self.id = serving.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stream = RequestStream(serving, self.id)
        self.link = WorkerLink(serving.zmq_address, engine_config.tensor_parallel_size)
        self.scheduler: Scheduler | None = None
        self.hello: WorkerHello | None = None  # rank 0's with the group's pools and context, of the last group started
        self.group_generation = -1
        self.epoch = int(time.time() * 1000) % (1 << 31)  # a restarted scheduler starts a new epoch
        self.stopping = False
        self.drain_deadline: float | None = None  # set by SIGTERM
        self._drain_logged = False
        self._last_status = 0.0
        self._kv_events_run_id: str | None = None  # the Redis whose KV events stream has this group's history
        self._last_memory = 0.0
        self._memory_version: tuple | None = None  # of the snapshot last published
        self._memory_tables = PackedTables()  # its block tables, packed: the next publish packs what changed
        self._num_snapshots = 0  # published: each snapshot's `version`
        self.memory_events = MemoryEventLog()  # every worker group's: event ids never restart

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            signal.signal(signal.SIGTERM, lambda *_: self.drain())
            freeze_startup_heap(f"scheduler {self.id}")  # a process of its own (tests run it in a thread)
        self.stream.ensure_group()
        log.info("scheduler %s waiting for %d worker(s) on %s", self.id, self.engine_config.tensor_parallel_size,
                 self.serving.zmq_address)
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
        self._publish()
        if self.drain_deadline is not None and self._drained():
            self.stopping = True
            return
        self._check_workers()
        if self.scheduler is None:
            self.link.poll_hello(timeout_ms=200)
            if self.link.ready:
                self._start_group()
            return
        for abort in self.stream.read_aborts():
            if abort.index is None:
                self.scheduler.abort_request(abort.request_id)
            elif self.scheduler.abort_sequence(abort.request_id, abort.index):  # the others had already finished
                self.stream.retire(abort.request_id)
        if self.stream.maintain_due():
            for request_id in self.stream.maintain(draining=self.drain_deadline is not None):
                self.scheduler.abort_request(request_id)
        if self.in_flight and not self.scheduler.has_unfinished_requests():  # every request aborted
            self.settle()
            if self.scheduler is None:
                return
        busy = self.scheduler.has_unfinished_requests()
        if not busy:
            self.link.drain()
            if self.link.silent_for() > self.serving.worker_silence_s:
                self._fail_group(f"no word from the workers for {self.serving.worker_silence_s:g} s")
                return
        if self.drain_deadline is None:
            self._admit_arrivals(block=not busy)
        elif not busy:
            time.sleep(IDLE_BLOCK_MS / 1000)
        if self.scheduler.has_unfinished_requests():
            self._step()

    def _drained(self) -> bool:
        """While draining: hand back what has not started; True once nothing runs or time is up."""
        if not self._drain_logged:
            self._drain_logged = True
            log.info("draining: %d request(s) held, %.0f s to finish", len(self.stream.tracked),
                     self.drain_deadline - time.monotonic())
            self._last_status = float("-inf")  # routers learn at once that this group takes nothing new
            self._publish_status()
        for request_id in self.stream.hand_back_unstarted():
            if self.scheduler is not None:
                self.scheduler.abort_request(request_id)
        return not self.stream.tracked or time.monotonic() > self.drain_deadline

    def _shutdown(self) -> None:
        """Requests still held end with an error (their clients would otherwise wait for nothing)."""
        try:
            if self.scheduler is not None and self.serving.kv_events:
                self._queue_kv_events([AllBlocksCleared()])  # routers: nothing is cached here any more
            self.stream.fail_all("the scheduler is shutting down")
            self.stream.delete_status()
        except redis.RedisError as exc:
            log.warning("redis unavailable at shutdown: %s", exc)
        self.link.close()

    # ------------------------------------------------------------------ the worker group
    def _check_workers(self) -> None:
        if self.scheduler is not None and self.link.generation != self.group_generation:
            self._fail_group("a worker restarted")
        if self.scheduler is not None and self.link.check_connections() is not None:
            self._fail_group(f"the worker failed: {_lost(self.link.lost)}")

    def _start_group(self) -> None:
        """Every rank said hello: size the scheduler from their capacity (the smallest pool)."""
        hellos = self.link.hellos
        # rank 0's, with the group's pools and context: the least any rank holds (a rank whose pool
        # holds less may have lowered its default context)
        hello = self.hello = dataclasses.replace(
            hellos[0], num_gpu_blocks=min(h.num_gpu_blocks for h in hellos.values()),
            num_cpu_blocks=min(h.num_cpu_blocks for h in hellos.values()),
            max_model_len=min(h.max_model_len for h in hellos.values()))
        self.group_generation = self.link.generation
        if hello.block_size != self.engine_config.block_size:
            log.warning("workers use block size %d; the scheduler follows", hello.block_size)
        # async scheduling stays on for a group of ranks: rank 0 broadcasts its sampled ids over
        # the group, so a PENDING_TOKEN means the same token on every rank (worker/executor.py)
        config = self.engine_config.replace(block_size=hello.block_size, max_model_len=hello.max_model_len)
        self.scheduler = Scheduler.from_hello(config, hello, self.memory_events)
        self.scheduler.epoch = self.epoch
        self.scheduler.isolate_failures = True
        if self.serving.kv_events:  # its first batch says AllBlocksCleared: the pool starts empty
            self.scheduler.block_manager.record_kv_events()
            self._kv_events_run_id = self.stream.redis_run_id
        self._memory_version, self._memory_tables = None, PackedTables()
        log.info("workers ready: %s, %d KV blocks of %d tokens (%d bytes each, %d a token%s), context %d: at most "
                 "%.2fx sequences of %d tokens at once%s", hello.model, hello.num_gpu_blocks, hello.block_size,
                 hello.kv_bytes_per_block, hello.kv_bytes_per_block // hello.block_size,
                 " in each KV cache group" if hello.kv_groups else "", hello.max_model_len,
                 self.scheduler.block_manager.max_concurrency(hello.max_model_len), hello.max_model_len,
                 f"; KV cache groups {hello.kv_groups} (each one's window, 0: global)" if hello.kv_groups else "")

    def _fail_group(self, message: str) -> None:
        """The workers' KV state is lost: every request this group holds that has streamed ends
        with an error; those that have not are left to be taken over (by another engine group, or
        by this one once its ranks are back)."""
        released = self.stream.release_unstarted()
        log.error("%s; failing %d request(s), releasing %d not started, and waiting for workers", message,
                  len(self.stream.tracked), len(released))
        if self.scheduler is not None and self.serving.kv_events:
            self._queue_kv_events([AllBlocksCleared()])  # the group's KV is gone with its ranks
        self.scheduler = None
        self.in_flight.clear()  # their results, if any come, are of the old epoch: dropped
        if self.link.generation == self.group_generation:  # else the link already took on new ranks
            self.link.forget_workers()
        self.epoch = (self.epoch + 1) % (1 << 31)
        self.stream.fail_all(message)  # last: the flush may raise while Redis is down

    # ------------------------------------------------------------------ admission
    def _admit_arrivals(self, block: bool) -> None:
        """A dead scheduler's requests come first: nothing new is read while any waits for room.
        At most max_num_seqs wait here: the rest wait in Redis, where an engine group with room
        steals them from a busy group's stream (scheduler/inbox.py)."""
        room = self.engine_config.max_num_seqs - len(self.scheduler.waiting)
        if room <= 0:
            return
        arrivals = self.stream.take_over(room) if self.stream.orphans else self.stream.read(room, block)
        for arrival in arrivals:
            self._admit(arrival)

    def _admit(self, arrival: Arrival) -> None:
        request = arrival.request
        invalid = _invalid_request(request, self.hello.vocab_size, self.hello.images)
        if invalid is not None:  # the gateway validates; an entry from elsewhere must not reach a worker
            self.stream.finish(arrival, "error", invalid)
            return
        # how an image's tokens attend is the model's, not the request's to say
        bidirectional = self.hello.images == "bidirectional"
        mm_items = [dataclasses.replace(item, bidirectional=bidirectional) for item in request.mm_items]
        try:
            self.scheduler.add_request(request.request_id, request.prompt_token_ids, request.sampling_params,
                                       lora_request=request.lora_request, mm_items=mm_items)
        except RequestRejected as exc:
            self.stream.finish(arrival, "error", str(exc))
            return
        self.stream.track(arrival)

    # ------------------------------------------------------------------ step
    def _step(self) -> None:
        """Send the next plan, then take the oldest result (scheduler/step_pipeline.py). Once no
        request is left, the plan still in flight is gathered too (an idle link drops stale frames)."""
        oldest = self.run_step()
        if not any(p.new_seqs or p.cached_seqs for p in (oldest, *self.in_flight)):
            time.sleep(0.001)  # nothing fits yet

    def _launch(self, plan: StepPlan) -> None:
        self._fail_isolated()
        self.link.send_plan(plan)

    def _take_result(self, plan: StepPlan) -> bool:
        """Gather and apply the plan's result; False when that failed the group."""
        result = self.link.gather(plan, self.serving.step_timeout_s, on_wait=self._heartbeats)
        if result is None or result.error:
            # a rank that died is the cause its peers' failed collectives report: name it first
            if self.link.check_connections() is not None:
                reason = _lost(self.link.lost)
            elif result is not None:
                reason = result.error
            elif self.link.generation != self.group_generation:  # gather saw a rank's new hello
                reason = "a worker restarted mid-step"
            else:
                reason = f"no result within {self.serving.step_timeout_s:g} s"
            self._fail_group(f"the worker failed: {reason}")
            return False
        try:
            outputs = self.scheduler.update(result)
        except (ValueError, RuntimeError) as exc:  # the result breaks the contract: the state is unsure
            self._fail_group(f"the worker's result was invalid: {exc}")
            return False
        self._fail_isolated()
        self.stream.emit(outputs)
        return True

    def _fail_isolated(self) -> None:
        """Requests whose scheduling or update raised: each ends with an error, alone."""
        for failed in self.scheduler.take_failed():
            self.stream.fail(failed.request_id, f"the scheduler failed on this request: {failed.error}")

    def _heartbeats(self) -> None:
        """While a step runs: keep the status and this scheduler's claims fresh."""
        self._publish_status()
        if self.stream.renew_due():
            try:
                self.stream.renew_claims()
            except redis.RedisError as exc:
                log.warning("could not renew claims: %s", exc)

    # ------------------------------------------------------------------ status
    def _publish(self) -> None:
        """Each loop: the outbox (with the memory snapshot made last loop), then the status and the
        memory snapshot when due."""
        s = self.scheduler
        if s is not None and self.serving.kv_events:
            events = s.block_manager.take_kv_events()
            if self.stream.redis_run_id != self._kv_events_run_id or self.stream.kv_resync_asked:
                # Redis restarted empty (the stream too), or a router missed events: the whole cache
                events, self._kv_events_run_id = s.block_manager.kv_snapshot(), self.stream.redis_run_id
                if self.stream.kv_resync_asked:  # (asked again meanwhile: this snapshot, sent after, answers it)
                    self.stream.redis.delete(streams.kv_resync_key(self.serving.engine_id))
                    self.stream.kv_resync_asked = False
            self._queue_kv_events(events)
        self.stream.flush()
        self._publish_status()
        self._publish_memory()

    def _queue_kv_events(self, events: list) -> None:
        """One batch of the cache's changes (common/kv_events.py), sent with the outbox."""
        if events:
            engine = self.serving.engine_id  # vLLM's data_parallel_rank is an int: a numeric engine id is sent as one
            batch = encode_batch(KVEventBatch(time.time(), events, int(engine) if engine.isdigit() else engine))
            self.stream.outbox.entries.append(PublishKVEvents(streams.kv_events_stream(self.serving.engine_id), batch))

    def _publish_status(self) -> None:
        now = time.time()
        if now - self._last_status < STATUS_INTERVAL_S:
            return
        self._last_status = now
        s, hello, config = self.scheduler, self.hello, self.engine_config
        stats = s.make_stats() if s else _stats_before_hello(config)
        status = SchedulerStatus(
            scheduler_id=self.id, model=hello.model if hello else "", num_gpu_blocks=hello.num_gpu_blocks if hello else 0,
            workers_ready=s is not None and self.link.ready, updated_at=now, engine=self.serving.engine_id,
            kv_cache_dtype=hello.kv_cache_dtype if hello else "", kv_bytes_per_block=hello.kv_bytes_per_block if hello else 0,
            prefill_tokens_per_s=hello.prefill_tokens_per_s if hello else 0.0,
            num_routed_total=self.stream.num_routed, num_shared_total=self.stream.num_shared,
            num_stolen_total=self.stream.num_stolen, draining=self.drain_deadline is not None, **stats,
        )
        try:
            if not self.stream.publish_status(encode(status), has_memory=s is not None):
                # none published yet, a page began watching, or Redis lost it: publish at once
                self._memory_version, self._last_memory = None, float("-inf")
        except redis.RedisError as exc:
            log.warning("could not publish status: %s", exc)

    def _publish_memory(self) -> None:
        """The block manager's snapshot for the dashboard (scheduler/memory_view.py), at most every
        MEMORY_INTERVAL_S, only when it changed, and only while a gateway serves the dashboard's
        data (it sets streams.MEMORY_WATCH; the status finds it): unwatched, it costs nothing
        (`pagoda bench publish` measures what it costs watched)."""
        s, now = self.scheduler, time.monotonic()
        if s is None or not self.stream.memory_watched or now - self._last_memory < MEMORY_INTERVAL_S:
            return
        version = memory_version(s)
        if version == self._memory_version:
            return
        self._last_memory = now
        self._memory_version = version
        self._num_snapshots += 1
        snapshot = build_snapshot(s, self.serving.engine_id, self.id, self._memory_tables, self._num_snapshots)
        self.stream.publish_memory(encode(snapshot))  # written with the step's events, in their round trip


def _stats_before_hello(config: EngineConfig) -> dict:
    """`Scheduler.make_stats()`'s fields while no worker group is ready: nothing held, and the
    configured limits (the gateway admits by the scheduler's own, common/admission.py)."""
    limits = AdmissionLimits(0, config.block_size, 0, config.max_num_seqs, config.max_num_batched_tokens,
                             config.enable_chunked_prefill)
    return {"num_running": 0, "num_waiting": 0, "num_swapped": 0, "kv_cache_usage": 0.0, "num_preemptions_total": 0,
            "prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0, **dataclasses.asdict(limits)}


def _lost(rank: int) -> str:
    return f"worker rank {rank} disconnected (exited, was killed or stopped answering)"


def _invalid_request(request: GenerateRequest, vocab_size: int, images: str) -> str | None:
    """Why a decoded request cannot be served, or None (a badly typed one would break the loop)."""
    if not isinstance(request.sampling_params, SamplingParams):
        return "invalid request: sampling_params is not a SamplingParams"
    ids = request.prompt_token_ids
    if not isinstance(ids, list):
        return f"invalid request: prompt_token_ids must be a list of token ids in [0, {vocab_size})"
    if request.mm_items and not images:
        return "invalid request: this model does not take images"
    return invalid_items(ids, request.mm_items, vocab_size, grids=images == "mrope")


def serve(engine_config: EngineConfig, serving: ServingConfig) -> None:
    SchedulerServer(engine_config, serving).serve_forever()
