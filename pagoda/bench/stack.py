"""The one launcher of the real stack, for tests, the soak, `pagoda bench serve --launch`,
`pagoda bench overhead` and scripts/fuzz.sh: start `pagoda up` on a free port, wait for /health,
know its addresses, stop it and report its exit code.

    stack = Stack("--device", "cpu", "--max-num-seqs", "2").wait_ready()
    stack.url, stack.redis_url   # the gateway; the Redis it uses (its private one unless given)
    stack.stop()                 # SIGINT: `pagoda up` drains and stops its children; its exit code

From a shell, the stack lives as long as a command:

    python -m pagoda.bench.stack [--log PATH] [PAGODA UP FLAGS] -- COMMAND [ARGS]

runs COMMAND once the stack is healthy, `{url}` and `{redis_url}` in its arguments replaced, and
exits with COMMAND's status.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.redis_server import free_port
from pagoda.up import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
USAGE = "usage: python -m pagoda.bench.stack [--log PATH] [PAGODA UP FLAGS] -- COMMAND [ARGS]"
GAUGES = ("pagoda:kv_cache_usage_perc", "pagoda:num_requests_running", "pagoda:num_requests_waiting",
          "pagoda:num_requests_swapped")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')  # name="value", the value's \" and \\ kept as written


class Stack:
    """`pagoda up FLAGS` (or `pagoda COMMAND FLAGS`, e.g. one more gateway) on a free local port, in a
    session of its own. Its output goes to `log` (default: discarded)."""

    def __init__(self, *flags: str, command: str = "up", port: int | None = None, api_key: str | None = None,
                 log: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.command = command
        self.log = log
        self.redis_url: str | None = None  # `pagoda up`'s, once ready: the one it was given or its private one
        argv = [sys.executable, "-m", "pagoda.cli", command, "--port", str(self.port), *flags]
        if api_key:
            argv += ["--api-key", api_key]
        self.addresses: Path | None = None
        if command == "up":
            fd, name = tempfile.mkstemp(prefix="pagoda-up-", suffix=".json")
            os.close(fd)
            self.addresses = Path(name)
            argv += ["--addresses-file", name]
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_REDIS_URL"}  # `pagoda up`'s own, unless a flag says
        with open(log, "w") if log else open(os.devnull, "w") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> Stack:
        """Back once /health answers 200; raises if the process exits first or at the deadline."""
        try:
            wait_healthy(self.url, timeout, self.process)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            where = f"; see {self.log}" if self.log else ""
            raise type(exc)(f"pagoda {self.command}: {exc}{where}") from None
        if self.addresses is not None:  # written before its children start, so before /health answers
            self.redis_url = json.loads(self.addresses.read_text())["redis_url"]
        return self

    def statuses(self) -> list:
        """The live schedulers' SchedulerStatus, read from their keys in Redis."""
        import redis

        from common import streams
        from common.protocol import SchedulerStatus, decode

        client = redis.Redis.from_url(self.redis_url)
        try:
            keys = list(client.scan_iter(match=streams.STATUS_PREFIX + "*"))
            statuses = [decode(raw) for raw in client.mget(keys) if raw is not None] if keys else []
        finally:
            client.close()
        return [status for status in statuses if isinstance(status, SchedulerStatus)]

    def engines(self) -> dict[str, bool]:
        """The live engine groups, from the schedulers' status keys: {engine id: workers ready}."""
        ready: dict[str, bool] = {}
        for status in self.statuses():
            ready[status.engine] = ready.get(status.engine, False) or status.workers_ready
        return ready

    def wait_engines(self, count: int, timeout: float = 600) -> Stack:
        """Back once `count` engine groups have their workers ready (/health answers once one has)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagoda {self.command} exited with {self.process.returncode}")
            engines = self.engines()
            if sum(engines.values()) >= count:
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} engine groups were not ready within {timeout:g} s (ready: {engines})")
            time.sleep(0.2)

    def children(self) -> dict[str, int]:
        """The pids of `pagoda up`'s children by role: scheduler, worker, gateway (redis-server if private)."""
        return {name: pid for name, pid in process_tree(self.process.pid).items() if name != "up"}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each role's live children have used so far: {"worker": s, ...}."""
        used: dict[str, float] = collections.defaultdict(float)
        for name, pid in self.children().items():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]
            used[name.rstrip("'")] += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        return dict(used)

    def health(self) -> int:
        """/health's status, 0 when nothing listens."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            return parse_metrics(response.read().decode())

    def wait_drained(self, timeout: float) -> dict[str, float]:
        """The metrics once no KV block is used and no request runs or waits in any engine group, or at
        the deadline (a gauge is absent while no scheduler is live). Only statuses every scheduler
        published after this call count: one from before a request that has already been answered
        shows it neither running nor counted (a status is published twice a second). The statuses'
        `updated_at` is the schedulers' wall clock: this machine's, where `pagoda up` runs them."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            fresh = self.redis_url is None or all(s.updated_at > since for s in self.statuses())
            metrics = self.metrics()
            drained = fresh and [metrics.get(g) for g in GAUGES] == [0, 0, 0, 0]
            if drained or time.monotonic() > deadline:
                return metrics
            time.sleep(0.2)

    def stop(self, timeout: float = 60) -> int:
        """SIGINT to the process alone (`pagoda up` stops its children in order); its exit code
        (negative: killed after `timeout` seconds)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.addresses is not None:
            self.addresses.unlink(missing_ok=True)
        return self.process.returncode

    def __enter__(self) -> Stack:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: the sum of its samples over their labels} (e.g. over the
    engine groups: a running count of the whole stack; a usage fraction summed is only good for == 0)."""
    values: dict[str, float] = collections.defaultdict(float)
    for name, _, value in parse_samples(text):
        values[name] += value
    return dict(values)


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> [(metric name, its labels, value)], in order (label values as escaped there)."""
    samples = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            samples.append((name, dict(LABEL.findall(labels)), float(value)))
    return samples


def _ppid_and_cmdline(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1]), cmdline


def process_tree(root: int) -> dict[str, int]:
    """`root` and its descendants, named up / gateway / scheduler / worker / redis-server (/proc)."""
    parents: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _ppid_and_cmdline(int(entry))
            if info:
                parents[info[0]].append((int(entry), info[1]))
    names, todo = {"up": root}, [root]
    while todo:
        for pid, cmdline in parents.get(todo.pop(), []):
            words = cmdline.split()
            if any("redis-server" in w for w in words[:1]):
                name = "redis-server"
            elif "pagoda.cli" in words and words.index("pagoda.cli") + 1 < len(words):
                name = words[words.index("pagoda.cli") + 1]
            else:
                name = os.path.basename(words[0]) if words else str(pid)
            while name in names:
                name += "'"
            names[name] = pid
            todo.append(pid)
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(USAGE, file=sys.stderr)
        return 2
    split = argv.index("--")
    flags, command = argv[:split], argv[split + 1:]
    log = None
    if "--log" in flags[:-1]:
        i = flags.index("--log")
        log, flags = Path(flags[i + 1]), flags[:i] + flags[i + 2:]
    stack = Stack(*flags, log=log)
    print(f"stack: starting pagoda up on {stack.url}" + (f" (log: {log})" if log else ""), file=sys.stderr, flush=True)
    try:
        stack.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 1
    command = [a.replace("{url}", stack.url).replace("{redis_url}", stack.redis_url) for a in command]
    try:
        code = subprocess.call(command)
    except KeyboardInterrupt:  # the stack is in a session of its own: Ctrl-C reached COMMAND and us only
        code = 130
    finally:
        exit_code = stack.stop()
    if exit_code != 0:
        print(f"stack: pagoda up exited with {exit_code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
