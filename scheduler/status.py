"""What a scheduler tells the gateways about itself, about twice a second.

    SET pagoda:scheduler:<id>      its SchedulerStatus, under a TTL: a heartbeat
    EXISTS pagoda:memory-watch     whether a gateway serves the dashboard's data (then the
                                   outbox writes pagoda:memory:<id>, which expires with the status)
    EXISTS pagoda:kv-resync:<g>    whether a router missed this group's KV events
    SET pagoda:held:<id>           once Redis comes back as a new server (its run_id changed: it
                                   restarted empty), the ids of the requests this scheduler holds,
                                   so that gateways fail only what was lost
"""
from __future__ import annotations

import logging

import redis

from common import streams
from common.config import ServingConfig
from common.protocol import HeldRequests, encode
from scheduler.outbox import Outbox

log = logging.getLogger(__name__)


class StatusPublisher:
    def __init__(self, serving: ServingConfig, consumer: str, client: redis.Redis, outbox: Outbox) -> None:
        self.serving = serving
        self.consumer = consumer
        self.redis = client
        self.outbox = outbox
        self.redis_run_id: str | None = None
        self.memory_watched = False  # a gateway serves the dashboard's data (streams.MEMORY_WATCH), as of the status
        self.kv_resync_asked = False  # a router missed KV events (streams.kv_resync_key), as of the status

    def publish_status(self, status: bytes, has_memory: bool = True) -> bool:
        """The status (a heartbeat under a TTL); first, on a Redis that restarted, what this scheduler
        holds. Whether a gateway watches the memory (`memory_watched`) is read with it, and the
        memory snapshot's TTL refreshed, or the snapshot deleted when nobody watches or this
        scheduler has no worker group (`has_memory` False: no memory to show). Returns whether a
        snapshot is there and watched (False: publish one at once even if nothing changed, when
        watched; a page began watching, or Redis lost it)."""
        run_id = self.redis.info("server").get("run_id")
        if run_id != self.redis_run_id:
            if self.redis_run_id is not None:
                log.warning("Redis restarted: publishing the %d request(s) this scheduler holds",
                            len(self.outbox.tracked))
            # and those that ended while Redis was down: their last events wait in the outbox
            held = HeldRequests(self.consumer, self.outbox.held_ids())
            self.redis.set(streams.held_key(self.consumer), encode(held), ex=streams.HELD_TTL_S)
            self.redis_run_id = run_id
        ttl_ms = int(streams.STATUS_TTL_S * 1000)
        key = streams.memory_key(self.consumer)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(streams.status_key(self.consumer), status, px=ttl_ms)
        pipe.exists(streams.MEMORY_WATCH)
        if has_memory:
            pipe.pexpire(key, ttl_ms)
        else:
            pipe.delete(key)
        pipe.exists(streams.kv_resync_key(self.serving.engine_id))  # deleted once the snapshot is queued
        _, watched, memory, resync = pipe.execute()
        self.memory_watched = bool(watched)
        self.kv_resync_asked |= bool(resync)
        if has_memory and memory and not watched:  # no page for MEMORY_WATCH_TTL_S: the snapshot goes (once)
            self.redis.delete(key)
        return has_memory and bool(watched) and bool(memory)

    def delete_status(self) -> None:
        """At shutdown: the status and the memory snapshot."""
        self.redis.delete(streams.status_key(self.consumer), streams.memory_key(self.consumer))
