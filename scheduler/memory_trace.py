"""The offline engine's memory trace (`pagoda generate --memory-trace FILE`, `LLM(memory_trace=FILE)`).

JSON Lines, one engine snapshot per line: the object `GET /dashboard/snapshot` lists per engine
(common/memory_snapshot.py), with engine "0" and scheduler_id "offline". A line is written after
each step (or abort) that changed `memory_version`, at most every `interval_s` seconds (0.25 by
default, as the scheduler process publishes; 0: after every such step); the step that leaves the
engine idle is always written, so a trace ends with the memory as the engine left it.

Each line carries the latest MAX_EVENTS memory events (ids increase, across LLM.reset() too): a
reader de-duplicates them by id. Events older than the latest MAX_EVENTS at a written step are lost.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TextIO

from common.memory_snapshot import snapshot_json
from scheduler.memory_view import PackedTables, build_snapshot, memory_version

ENGINE = "0"
SCHEDULER_ID = "offline"
INTERVAL_S = 0.25  # the scheduler process's MEMORY_INTERVAL_S
SNAPSHOT_KEYS = ("engine", "step", "block_size", "ref_counts", "cpu_ref_counts", "cached", "sequences", "events")


@dataclass(slots=True)
class MemoryTrace:
    file: TextIO
    interval_s: float = INTERVAL_S
    num_snapshots: int = 0  # written: each snapshot's `version`
    _last_version: tuple | None = field(default=None, repr=False)
    _last_time: float = field(default=float("-inf"), repr=False)
    _tables: PackedTables = field(default_factory=PackedTables, repr=False)  # as the last line packed them

    @classmethod
    def open(cls, path: str | os.PathLike, interval_s: float = INTERVAL_S) -> MemoryTrace:
        if interval_s < 0:
            raise ValueError(f"memory trace interval {interval_s}: give 0 (every step) or more seconds")
        return cls(open(path, "w", encoding="utf-8"), interval_s)

    def record(self, scheduler, idle: bool = False) -> bool:
        """Write `scheduler`'s snapshot if its memory changed and the interval has passed (or
        `idle`: the engine has no request left). True when a line was written."""
        version = memory_version(scheduler)
        if version == self._last_version:
            return False
        now = time.monotonic()
        if not idle and now - self._last_time < self.interval_s:
            return False
        self.num_snapshots += 1
        snapshot = snapshot_json(build_snapshot(scheduler, ENGINE, SCHEDULER_ID, self._tables, self.num_snapshots))
        self.file.write(json.dumps(snapshot, separators=(",", ":")) + "\n")
        self.file.flush()
        self._last_version, self._last_time = version, now
        return True

    def close(self) -> None:
        self.file.close()


def read_trace(path: str | os.PathLike) -> list[dict]:
    """The snapshots of a trace file, in order; ValueError naming the line that is not one."""
    snapshots = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                snapshot = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            missing = [key for key in SNAPSHOT_KEYS if key not in snapshot] if isinstance(snapshot, dict) else SNAPSHOT_KEYS
            if missing:
                raise ValueError(f"{path}:{number}: not an engine snapshot (missing {', '.join(missing)})")
            snapshots.append(snapshot)
    return snapshots
