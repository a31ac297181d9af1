"""Start the real stack (`pagoda up`: redis-server, scheduler, worker, gateway processes) for tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.redis_server import free_port
from pagoda.soak import GAUGES, parse_metrics, process_tree

ROOT = Path(__file__).resolve().parent.parent


class Stack:
    def __init__(self, *flags: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "pagoda.cli", "up", "--port", str(self.port), "--device", "cpu", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_REDIS_URL"}
        self.log = open(ROOT / ".pytest_cache" / f"stack-{self.port}.log", "w") if (ROOT / ".pytest_cache").is_dir() else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> Stack:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagoda up exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the stack did not become healthy")

    def children(self) -> dict[str, int]:
        """The pids of `pagoda up`'s children by role: scheduler, worker, gateway (redis-server if private)."""
        return {name: pid for name, pid in process_tree(self.process.pid).items() if name != "up"}

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0  # not listening

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            return parse_metrics(response.read().decode())

    def wait_drained(self, timeout: float) -> dict[str, float]:
        """The metrics once no KV block is used and no request runs or waits, or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = [metrics[g] for g in GAUGES] == [0, 0, 0, 0]
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.2)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if hasattr(self.log, "close"):
            self.log.close()
        return self.process.returncode


class Gateway(Stack):
    """One more gateway process (`pagoda gateway`) on a running stack's Redis: for gateway flags
    that `pagoda up` does not pass on (--max-pending-requests, --max-body-bytes)."""

    def __init__(self, redis_url: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        cmd = [sys.executable, "-m", "pagoda.cli", "gateway", "--redis-url", redis_url, "--port", str(self.port), *flags]
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_REDIS_URL"}
        self.log = open(ROOT / ".pytest_cache" / f"gateway-{self.port}.log", "w") if (ROOT / ".pytest_cache").is_dir() else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
