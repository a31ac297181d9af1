"""One scheduler's side of Redis, over one connection, in three parts:

    scheduler/inbox.py    requests in: XREADGROUP its own group's stream, then the shared one;
                          steals from a busy group, claims (XCLAIM), takeover (XAUTOCLAIM), aborts
    scheduler/outbox.py   the requests it holds and their events out: one pipeline per flush
                          (started marks, reply streams, requeues, KV events, XACK + XDEL, memory)
    scheduler/status.py   its status (a heartbeat), whether a page watches its memory, and after
                          a Redis restart the requests it holds

`RequestStream` is what the scheduler server (scheduler/server.py) calls: each of its names is
the part's own, read and set there.
"""
from __future__ import annotations

import redis

from common.config import ServingConfig
from scheduler.inbox import Inbox
from scheduler.outbox import Outbox
from scheduler.status import StatusPublisher


def _on(part: str, name: str) -> property:
    """The façade's `name`: the attribute or method `name` of its `part`, read and set there."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value))


class RequestStream:
    __slots__ = ("serving", "consumer", "redis", "outbox", "inbox", "status")  # the rest is the parts'

    def __init__(self, serving: ServingConfig, consumer: str) -> None:
        self.serving = serving
        self.consumer = consumer
        self.redis = redis.Redis.from_url(serving.redis_url, socket_timeout=10, socket_connect_timeout=2,
                                          retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self.outbox = Outbox(self.redis, consumer)
        self.inbox = Inbox(serving, consumer, self.redis, self.outbox)
        self.status = StatusPublisher(serving, consumer, self.redis, self.outbox)

    # requests in
    ensure_group = _on("inbox", "ensure_group")
    read = _on("inbox", "read")
    take_over = _on("inbox", "take_over")
    read_aborts = _on("inbox", "read_aborts")
    maintain_due = _on("inbox", "maintain_due")
    maintain = _on("inbox", "maintain")
    renew_due = _on("inbox", "renew_due")
    renew_claims = _on("inbox", "renew_claims")
    orphans = _on("inbox", "orphans")
    early_aborts = _on("inbox", "early_aborts")
    num_routed = _on("inbox", "num_routed")
    num_shared = _on("inbox", "num_shared")
    num_stolen = _on("inbox", "num_stolen")
    # requests held, events out
    tracked = _on("outbox", "tracked")
    track = _on("outbox", "track")
    finish = _on("outbox", "finish")
    retire = _on("outbox", "retire")
    fail = _on("outbox", "fail")
    fail_all = _on("outbox", "fail_all")
    release_unstarted = _on("outbox", "release_unstarted")
    hand_back_unstarted = _on("outbox", "hand_back_unstarted")
    emit = _on("outbox", "emit")
    flush = _on("outbox", "flush")
    publish_memory = _on("outbox", "publish_memory")
    # the status
    publish_status = _on("status", "publish_status")
    delete_status = _on("status", "delete_status")
    redis_run_id = _on("status", "redis_run_id")
    memory_watched = _on("status", "memory_watched")
    kv_resync_asked = _on("status", "kv_resync_asked")
