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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.redis_server import free_port
from pagoda.bench.common import ROOT
from pagoda.bench.common import flags as bench_flags
from pagoda.up import wait_healthy

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

    @classmethod
    def of(cls, args, names: tuple[str, ...], *flags: str, engines: int = 1) -> Stack:
        """A bench's `pagoda up` on `args.port`: its options `names` repeated from `args`, then `flags`;
        back once `engines` engine groups are ready."""
        return cls(*bench_flags(args, names), *flags, port=args.port).wait_ready().wait_engines(engines)

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

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            keys = list(client.scan_iter(match=streams.STATUS_PREFIX + "*", count=1000))
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

    def metrics_text(self) -> str:
        """/metrics, Prometheus text."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

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


def rss_mib(pid: int) -> float | None:
    """VmRSS of `pid` in MiB (/proc); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_of(pids: dict[str, int]) -> dict[str, float]:
    """{name: VmRSS in MiB, to 0.1} of the processes still there."""
    return {name: round(mib, 1) for name, pid in pids.items() if (mib := rss_mib(pid)) is not None}


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    rss_mib: dict[str, float]  # by process (rss_of)


class RssSampler:
    """The RSS of `processes()` ({name: pid}, asked each time) now (`sample`, `mark`) and, from a
    thread of its own, every `interval` seconds: `samples`."""

    def __init__(self, processes: Callable[[], dict[str, int]], interval: float) -> None:
        self.processes, self.interval = processes, interval
        self.samples: list[Sample] = []
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> Sample:
        return self.samples[self.mark()]

    def mark(self) -> int:
        """Take a sample now (a stretch's first or last); its index in `samples`."""
        sample = Sample(round(time.monotonic() - self.start, 2), rss_of(self.processes()))
        with self._lock:
            self.samples.append(sample)
            return len(self.samples) - 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def begin(self) -> RssSampler:
        self._thread.start()
        return self

    def end(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> RssSampler:
        return self.begin()

    def __exit__(self, *exc) -> None:
        self.end()


def proc(pid: int) -> tuple[int, str, list[str]] | None:
    """(parent pid, state letter, argv) from /proc; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], argv


def role(argv: list[str]) -> str | None:
    """A child of `pagoda up` by its argv: redis-server, or the pagoda command it runs (gateway, ...)."""
    if argv and "redis-server" in program(argv):
        return "redis-server"
    if "pagoda.cli" in argv[:-1]:
        return argv[argv.index("pagoda.cli") + 1]
    return None


def program(argv: list[str]) -> str:
    """The program's file name (redis-server rewrites its argv[0] into a title with spaces)."""
    return os.path.basename(argv[0].split(" ")[0])


def process_tree(root: int) -> dict[str, int]:
    """`root` and its descendants, named up / gateway / scheduler / worker / redis-server (/proc)."""
    children: dict[int, list[tuple[int, list[str]]]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := proc(int(entry))):
            children[info[0]].append((int(entry), info[2]))
    names, todo = {"up": root}, [root]
    while todo:
        for pid, argv in children.get(todo.pop(), []):
            name = role(argv) or (program(argv) if argv else str(pid))
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
