"""Redis keys shared by the gateway and the schedulers, and the one field a stream entry carries.

    pagoda:requests              stream, consumer group "schedulers"; entry {m: GenerateRequest}: the
                                 shared stream, which every scheduler reads (`--routing pull`)
    pagoda:requests:<engine>     stream per engine group, consumer group "schedulers", same entries:
                                 the requests a gateway's cache-aware router sent to that group, which
                                 its scheduler reads first and an idle one steals once left unread
    pagoda:aborts                stream every scheduler reads in full; entry {id: request_id}, or
                                 {id: request_id, index: i} to end that one output (sample) alone
    pagoda:replies:<gateway_id>  stream per gateway process; entries {m: RequestEvent}
    pagoda:scheduler:<id>        string, a SchedulerStatus, expires unless refreshed (heartbeat)
    pagoda:memory:<id>           string, a MemorySnapshot (the dashboard), refreshed with the status
    pagoda:memory-watch          string, set by a gateway serving the dashboard's data: schedulers
                                 publish their MemorySnapshot only while it exists
    pagoda:started               hash request_id -> scheduler id: requests that have streamed a token
    pagoda:held:<id>             string, a HeldRequests, written by a scheduler that finds Redis restarted
    pagoda:kv-events:<engine>    stream per engine group, capped; entry {batch: a KV event batch}, plain
                                 msgpack in vLLM's layout for routers (common/kv_events.py)
"""
from __future__ import annotations

REQUESTS = "pagoda:requests"
GROUP_REQUESTS_PREFIX = "pagoda:requests:"
SCHEDULER_GROUP = "schedulers"
ABORTS = "pagoda:aborts"
STARTED = "pagoda:started"
REPLIES_PREFIX = "pagoda:replies:"
STATUS_PREFIX = "pagoda:scheduler:"
HELD_PREFIX = "pagoda:held:"
MEMORY_PREFIX = "pagoda:memory:"
MEMORY_WATCH = "pagoda:memory-watch"  # set by gateways serving the dashboard (outside MEMORY_PREFIX: no scheduler id meets it)
FIELD = b"m"  # the msgpack-encoded protocol message of a stream entry
ABORT_FIELD = b"id"
ABORT_INDEX_FIELD = b"index"

STATUS_TTL_S = 3.0  # a scheduler silent this long is dead
REPLY_STREAM_TTL_S = 600  # a reply stream no one writes to expires
HELD_TTL_S = 60  # long past every gateway's grace period after a Redis restart
MEMORY_WATCH_TTL_S = 10  # the dashboard's data unserved this long: the schedulers stop publishing
ABORTS_MAXLEN = 10_000
KV_EVENTS_PREFIX = "pagoda:kv-events:"
KV_EVENTS_FIELD = b"batch"
KV_EVENTS_MAXLEN = 10_000  # batches (a few hundred bytes each); approximate (XADD MAXLEN ~)
# set by a router that missed some of a group's events (its cursor fell behind the cap): the group's
# scheduler appends a snapshot of its cache (AllBlocksCleared, then every cached block) and deletes it
KV_RESYNC_PREFIX = "pagoda:kv-resync:"
KV_RESYNC_TTL_S = 10


def group_requests_stream(engine_id: str) -> str:
    return GROUP_REQUESTS_PREFIX + engine_id


def kv_events_stream(engine_id: str) -> str:
    return KV_EVENTS_PREFIX + engine_id


def kv_resync_key(engine_id: str) -> str:
    return KV_RESYNC_PREFIX + engine_id


def reply_stream(gateway_id: str) -> str:
    return REPLIES_PREFIX + gateway_id


def status_key(scheduler_id: str) -> str:
    return STATUS_PREFIX + scheduler_id


def held_key(scheduler_id: str) -> str:
    return HELD_PREFIX + scheduler_id


def memory_key(scheduler_id: str) -> str:
    return MEMORY_PREFIX + scheduler_id
