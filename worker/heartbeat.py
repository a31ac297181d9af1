"""A worker's liveness for its supervisor, without torch (started before the model's imports)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

class Heartbeat:
    """Touches a file every second while this process runs and no step has run past the step
    deadline. A supervisor (`pagoda up`) restarts a worker whose file goes stale: one that was
    stopped (SIGSTOP), starved, or is stuck inside a step, which it cannot see from outside."""

    def __init__(self, path: str, step_timeout_s: float, interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.step_timeout_s = step_timeout_s
        self.interval_s = interval_s
        self.step_started: float | None = None
        self.touch()
        threading.Thread(target=self._run, name="pagoda-heartbeat", daemon=True).start()

    def touch(self) -> None:
        self.path.touch()  # sets the mtime of an existing file too

    def alive(self) -> bool:
        started = self.step_started
        return started is None or time.monotonic() - started < self.step_timeout_s

    def _run(self) -> None:
        while True:
            if self.alive():
                self.touch()
            time.sleep(self.interval_s)
