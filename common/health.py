"""Container health checks: `python -m common.health --redis-url URL [--workers]`.

Exits 0 when Redis answers (and, with --workers, when some scheduler reports ready workers).
"""
from __future__ import annotations

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--workers", action="store_true", help="also require a scheduler with ready workers")
    args = parser.parse_args(argv)
    try:
        client = redis.Redis.from_url(args.redis_url, socket_timeout=2)
        client.ping()
        if args.workers and not any(s.workers_ready for s in live_schedulers(client)):
            print("no scheduler with ready workers", file=sys.stderr)
            return 1
    except redis.RedisError as exc:
        print(f"redis: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
