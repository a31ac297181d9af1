"""Container health checks: `python -m common.health --redis-url URL [--this-host] [--workers]`, or
for a worker `python -m common.health --heartbeat-file PATH [--max-age S]`.

Exits 0 when Redis answers (with --this-host, when a scheduler of this host publishes its status;
with --workers, when such a scheduler reports ready workers), or when the worker's heartbeat file
was touched within --max-age seconds. --redis-url defaults to $PAGODA_REDIS_URL.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import redis

from common import streams
from common.protocol import ProtocolError, SchedulerStatus, decode


def live_schedulers(client: redis.Redis) -> list[SchedulerStatus]:
    statuses = []
    for key in client.scan_iter(match=streams.STATUS_PREFIX + "*", count=100):
        raw = client.get(key)
        try:
            status = decode(raw) if raw else None
        except ProtocolError:
            continue
        if isinstance(status, SchedulerStatus):
            statuses.append(status)
    return statuses


def on_this_host(status: SchedulerStatus) -> bool:
    """A scheduler's id is HOSTNAME-PID (scheduler/server.py): in a container or pod, its own."""
    return status.scheduler_id.rpartition("-")[0] == socket.gethostname()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m common.health", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("PAGODA_REDIS_URL") or None,
                        help="default: $PAGODA_REDIS_URL")
    parser.add_argument("--this-host", action="store_true",
                        help="count only the schedulers of this host (its container or pod), and require one")
    parser.add_argument("--workers", action="store_true", help="also require a scheduler with ready workers")
    parser.add_argument("--heartbeat-file", help="a worker's (`pagoda worker --heartbeat-file`)")
    parser.add_argument("--max-age", type=float, default=15.0, help="seconds the heartbeat may be stale")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.heartbeat_file:
        try:
            age = time.time() - os.stat(args.heartbeat_file).st_mtime
        except FileNotFoundError:
            print("no heartbeat yet", file=sys.stderr)
            return 1
        if age > args.max_age:
            print(f"heartbeat {age:.0f} s old: the worker is stopped, hung or stuck in a step", file=sys.stderr)
            return 1
        return 0
    if not args.redis_url:
        parser.error("give --redis-url or --heartbeat-file")
    try:
        client = redis.Redis.from_url(args.redis_url, socket_timeout=2)
        client.ping()
        if args.this_host or args.workers:
            statuses = [s for s in live_schedulers(client) if not args.this_host or on_this_host(s)]
            where = " on this host" if args.this_host else ""
            if not statuses:
                print(f"no scheduler{where}", file=sys.stderr)
                return 1
            if args.workers and not any(s.workers_ready for s in statuses):
                print(f"no scheduler{where} with ready workers", file=sys.stderr)
                return 1
    except redis.RedisError as exc:
        print(f"redis: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
