"""The real stack for tests: pagoda/bench/stack.py's launcher on CPU, logging to .pytest_cache/."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

from common.redis_server import free_port
from pagoda.bench import stack as launcher

ROOT = Path(__file__).resolve().parent.parent


def _log(name: str, port: int) -> Path | None:
    return ROOT / ".pytest_cache" / f"{name}-{port}.log" if (ROOT / ".pytest_cache").is_dir() else None


class Stack(launcher.Stack):
    """`pagoda up --device cpu FLAGS`; `Stack(...).wait_ready()`, then `url`, `redis_url`, `stop()`."""

    def __init__(self, *flags: str, api_key: str | None = None, port: int | None = None) -> None:
        port = port or free_port()
        super().__init__("--device", "cpu", *flags, port=port, api_key=api_key, log=_log("stack", port))


class Gateway(launcher.Stack):
    """One more gateway process (`pagoda gateway`) on a running stack's Redis: for gateway flags
    that `pagoda up` does not pass on (--max-pending-requests, --max-body-bytes)."""

    def __init__(self, redis_url: str, *flags: str) -> None:
        port = free_port()
        super().__init__("--redis-url", redis_url, *flags, command="gateway", port=port, log=_log("gateway", port))
        self.redis_url = redis_url


def wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds until `predicate()` held; AssertionError naming `what` after `timeout` seconds."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


@contextmanager
def serve_app(app, port: int, **config):
    """An ASGI app under uvicorn on 127.0.0.1:`port` in a thread, as `pagoda gateway` runs it;
    yields the uvicorn Server once it has started, and stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(10)
