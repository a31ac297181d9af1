"""The requests a scheduler holds and everything it writes to Redis about them.

    track ─▶ Tracked (from the read until its last event)
    emit / finish / fail ─▶ entries ─▶ flush: HSET pagoda:started, XADD each reply stream one entry
              of all its events (and one EXPIRE), XADD requeued requests and KV events, XACK + XDEL
              (one pipeline per flush) and SET pagoda:memory:<id>, the latest memory snapshot if one waits

A request is acknowledged in its stream only when it ends (scheduler/inbox.py says why). The
outbox survives a Redis outage: its writes are sent, in order, once Redis is back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from common import streams
from common.protocol import RequestEvent, SamplingParams, encode
from scheduler.sequence import RequestOutput

if TYPE_CHECKING:
    from scheduler.inbox import Arrival

log = logging.getLogger(__name__)

REPLY_STREAM_MAXLEN = 100_000


@dataclass(slots=True)
class Tracked:
    """A request this scheduler holds, from its read until its last event."""

    reply_stream: str
    entry_id: bytes  # in its requests stream, acknowledged when the request ends
    logprobs: bool
    stream: str = streams.REQUESTS  # the requests stream it came from
    ended: set[int] = field(default_factory=set)  # outputs whose last event went out
    started: bool = False  # a token went out: the request can no longer be run again from the start
    num_sent: int = 0  # token-bearing events sent (RequestEvent.seq)
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class SendEvent:
    reply_stream: str
    event: RequestEvent


@dataclass(slots=True)
class MarkStarted:
    """The request streamed a token: a scheduler taking it over must not run it again."""

    request_id: str


@dataclass(slots=True)
class Requeue:
    """A request handed back on drain, added again as a new entry (read at once by the next scheduler)."""

    payload: bytes


@dataclass(slots=True)
class Ack:
    """The entry is done with: acknowledge and delete it (the stream would grow forever)."""

    entry_id: bytes
    request_id: str | None = None  # clears its started mark; None for an entry that never ran
    stream: str = streams.REQUESTS


@dataclass(slots=True)
class PublishKVEvents:
    """A batch of this engine group's KV events (common/kv_events.py), for routers."""

    stream: str
    batch: bytes


OutboxEntry = SendEvent | MarkStarted | Requeue | Ack | PublishKVEvents


class Outbox:
    def __init__(self, client: redis.Redis, consumer: str) -> None:
        self.redis = client
        self.consumer = consumer
        self.tracked: dict[str, Tracked] = {}
        self.entries: list[OutboxEntry] = []  # Redis writes not yet done
        self.memory: bytes | None = None  # the latest memory snapshot, not yet written (sent with the entries)

    # ------------------------------------------------------------------ requests held
    def track(self, arrival: Arrival) -> None:
        params = arrival.request.sampling_params
        logprobs = isinstance(params, SamplingParams) and params.logprobs is not None
        self.tracked[arrival.request.request_id] = Tracked(arrival.request.reply_stream, arrival.entry_id, logprobs,
                                                           arrival.stream)

    def finish(self, arrival: Arrival, reason: str, error: str | None = None) -> None:
        """End a request that is not tracked (refused, aborted early, or taken over) with one event."""
        self.finish_tracked(arrival.request.request_id,
                            Tracked(arrival.request.reply_stream, arrival.entry_id, False, arrival.stream), reason, error)

    def drop(self, entry_id: bytes, stream: str) -> None:
        """An entry that never ran (malformed, a duplicate, gone): acknowledged with the next flush."""
        self.entries.append(Ack(entry_id, stream=stream))

    def retire(self, request_id: str) -> None:
        """A request whose last output ended without an event of ours (the gateway aborted it): ack it."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is not None:
            self.entries.append(Ack(tracked.entry_id, request_id, tracked.stream))
            self.flush()

    def fail(self, request_id: str, message: str) -> None:
        tracked = self.tracked.pop(request_id, None)
        if tracked is not None:
            self.finish_tracked(request_id, tracked, "error", message)

    def fail_all(self, message: str) -> None:
        """Every held request ends with an error (flushed last: it raises while Redis is down)."""
        failed, self.tracked = self.tracked, {}
        for request_id, tracked in failed.items():
            self.entries.append(SendEvent(tracked.reply_stream, RequestEvent(request_id, [], None, "error", message)))
            self.entries.append(Ack(tracked.entry_id, request_id, tracked.stream))
        self.flush()

    def release_unstarted(self) -> list[str]:
        """When the workers failed: requests that have not streamed are let go unacknowledged, so
        they stay pending in Redis and any live scheduler takes them over after claim_idle_ms
        (XAUTOCLAIM: each takeover counts as a delivery, so one that keeps failing its groups ends
        after MAX_DELIVERIES). Returns their ids."""
        released = [request_id for request_id, tracked in self.tracked.items() if not tracked.started]
        for request_id in released:
            del self.tracked[request_id]
        return released

    def hand_back_unstarted(self) -> list[str]:
        """On drain: requests that have not streamed go back to the shared stream as new entries
        (the next scheduler reads them at once; a rolling restart is not a death). Returns their ids."""
        handed_back = [request_id for request_id, tracked in self.tracked.items() if not tracked.started]
        for request_id in handed_back:
            tracked = self.tracked.pop(request_id)
            for _, fields in self.redis.xrange(tracked.stream, tracked.entry_id, tracked.entry_id):
                self.entries.append(Requeue(fields[streams.FIELD]))
            self.entries.append(Ack(tracked.entry_id, request_id, tracked.stream))
        self.flush()
        return handed_back

    def held_ids(self) -> list[str]:
        """The requests this scheduler holds, and those that ended while Redis was down (their last
        events wait in the entries), each once."""
        unsent = [e.event.request_id for e in self.entries if isinstance(e, SendEvent)]
        return list(dict.fromkeys([*self.tracked, *unsent]))

    # ------------------------------------------------------------------ events out
    def emit(self, outputs: list[RequestOutput]) -> None:
        """Each output's new tokens and endings to its reply stream; acknowledge the requests that ended."""
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
                if out.pooled is not None and seq.finish_reason is not None:
                    event.embedding = out.pooled
                # the request's first event, whichever output's: the gateway gives them to every choice
                if out.prompt_logprobs is not None and not tracked.prompt_logprobs_sent:
                    event.prompt_logprobs = out.prompt_logprobs
                    tracked.prompt_logprobs_sent = True
                if event.token_ids:
                    tracked.num_sent += 1
                    event.seq = tracked.num_sent
                    if tracked.num_sent == 1:
                        event.scheduled_at = out.first_scheduled_time or 0.0
                        event.num_cached_tokens = out.num_cached_tokens
                    if not tracked.started:
                        tracked.started = True
                        self.entries.append(MarkStarted(out.request_id))
                self.entries.append(SendEvent(tracked.reply_stream, event))
                if seq.finish_reason is not None:
                    tracked.ended.add(seq.index)
            if out.finished:
                self.entries.append(Ack(tracked.entry_id, out.request_id, tracked.stream))
                del self.tracked[out.request_id]
        self.flush()

    def finish_tracked(self, request_id: str, tracked: Tracked, reason: str, error: str | None) -> None:
        self.entries.append(SendEvent(tracked.reply_stream, RequestEvent(request_id, [], None, reason, error)))
        self.entries.append(Ack(tracked.entry_id, request_id, tracked.stream))
        self.flush()

    def publish_memory(self, snapshot: bytes) -> None:
        """The block manager's snapshot (an encoded MemorySnapshot) for the dashboard, written by the
        next flush, in the round trip of the step's events (it replaces one still waiting); it
        expires with the status."""
        self.memory = snapshot

    # ------------------------------------------------------------------ writes
    def flush(self) -> None:
        """Send the entries in one pipeline of a constant number of commands per stream written: the
        started marks (one HSET), one entry per reply stream holding every event for its gateway
        (vLLM's EngineCoreOutputs: one write per gateway per step, not one per request) with one
        EXPIRE, the requeued requests and KV events in order, then the acknowledgements (one XACK
        and one XDEL per requests stream, one HDEL). On a connection error the entries are kept, in
        order, for the next try; a command Redis refuses (XACK after Redis restarted empty: no
        group) is logged, not retried."""
        if not self.entries and self.memory is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        marks: dict[str, str] = {}
        replies: dict[str, list[RequestEvent]] = {}
        acks: dict[str, list[bytes]] = {}
        unmarks: list[str] = []
        for entry in self.entries:
            match entry:
                case MarkStarted(request_id):
                    marks[request_id] = self.consumer
                case SendEvent(reply_stream, event):
                    replies.setdefault(reply_stream, []).append(event)
                case Ack(entry_id, request_id, stream):
                    acks.setdefault(stream, []).append(entry_id)
                    if request_id is not None:
                        unmarks.append(request_id)
        if marks:
            pipe.hset(streams.STARTED, mapping=marks)
        for reply_stream, events in replies.items():
            pipe.xadd(reply_stream, {streams.FIELD: encode(events)}, maxlen=REPLY_STREAM_MAXLEN, approximate=True)
            pipe.expire(reply_stream, streams.REPLY_STREAM_TTL_S)
        for entry in self.entries:
            match entry:
                case Requeue(payload):
                    pipe.xadd(streams.REQUESTS, {streams.FIELD: payload})
                case PublishKVEvents(stream, batch):
                    pipe.xadd(stream, {streams.KV_EVENTS_FIELD: batch}, maxlen=streams.KV_EVENTS_MAXLEN,
                              approximate=True)
        for stream, entry_ids in acks.items():
            pipe.xack(stream, streams.SCHEDULER_GROUP, *entry_ids)
            pipe.xdel(stream, *entry_ids)
        if unmarks:
            pipe.hdel(streams.STARTED, *unmarks)
        if self.memory is not None:
            pipe.set(streams.memory_key(self.consumer), self.memory, px=int(streams.STATUS_TTL_S * 1000))
        results = pipe.execute(raise_on_error=False)
        self.entries.clear()
        self.memory = None
        refused = [r for r in results if isinstance(r, redis.ResponseError)]
        if refused:
            log.warning("redis refused %d command(s), e.g. %s", len(refused), refused[0])
