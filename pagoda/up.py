"""`pagoda up`: the whole stack on one machine, as separate processes, supervised.

    private redis-server (unless a Redis URL is given) ─ gateway
        engine group 0:   scheduler-0 ─ worker-0.0 … worker-0.{N-1}     (--tensor-parallel-size N)
        …
        engine group M-1: scheduler-{M-1} ─ worker-{M-1}.0 …            (--data-parallel-size M)

Every scheduler reads the one Redis request stream (a consumer group spreads the requests); each
group has its own ZeroMQ address and torch.distributed address. On a machine with GPUs, worker
(g, r) gets the (g*N + r)-th visible GPU as its only one (CUDA_VISIBLE_DEVICES).

A Hub id (--model ORG/NAME) is resolved before anything starts: downloaded here if the Hugging Face
cache lacks it (or one error), and every child is given the commit it resolved to (--revision), so
all of them read the same snapshot from the cache and none downloads.

A child that exits with code 2 refused its configuration (a model the tensor-parallel size does not
divide, say): the stack stops and `pagoda up` exits 2, since a restart would refuse again.
A child that exits otherwise, or a worker whose heartbeat file goes stale (stopped, hung, or stuck in a step
past --step-timeout), is restarted; the private Redis too, on its port. A child restarted more than
MAX_RESTARTS times in RESTART_WINDOW_S is crash-looping: the stack stops and `pagoda up` exits 1.
SIGINT or SIGTERM drains: the gateway first (requests in flight get --drain-timeout to finish),
then the schedulers, then the workers; then it exits 0.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.cli_args import config_to_argv
from common.config import ConfigError, EngineConfig, GatewayConfig, ServingConfig
from common.lifetime import die_with_parent
from common.models import pin_revision
from common.redis_server import RedisServer, free_port
from pagoda.commands import EXIT_CONFIG_ERROR, SCHEDULER_EXCLUDES, WORKER_EXCLUDES

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
POLL_S = 0.5
STARTUP_S = 60.0  # a worker's first heartbeat may take this long


@dataclass
class Child:
    name: str  # its role, then its place: gateway, scheduler-1, worker-1.0 (group 1, rank 0)
    command: list[str]
    heartbeat: Path | None = None  # a worker's: restarted when older than the worker timeout
    env: dict[str, str] = field(default_factory=dict)  # on top of ours: a worker's CUDA_VISIBLE_DEVICES
    process: subprocess.Popen | None = None
    restarts: collections.deque = field(default_factory=collections.deque)
    started_at: float = 0.0

    @property
    def role(self) -> str:
        return self.name.partition("-")[0]

    def start(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.unlink(missing_ok=True)
        # Own session: Ctrl-C reaches `pagoda up` alone, which then stops the children in order.
        # SIGKILL when `pagoda up` dies without that chance (kill -9, the OOM killer): no orphans.
        self.process = subprocess.Popen(self.command, start_new_session=True, preexec_fn=die_with_parent(),
                                        env={**os.environ, **self.env} if self.env else None)
        self.started_at = time.monotonic()

    def failure(self, worker_timeout_s: float) -> str | None:
        """Why this child must be restarted, or None."""
        code = self.process.poll()
        if code is not None:
            return f"exited with code {code}"
        if self.heartbeat is not None:
            try:
                age, limit = time.time() - self.heartbeat.stat().st_mtime, worker_timeout_s
            except FileNotFoundError:  # not yet written (the interpreter starting): allow longer
                age, limit = time.monotonic() - self.started_at, max(worker_timeout_s, STARTUP_S)
            if age > limit:
                return f"has not shown a heartbeat for {age:.0f} s (stopped, hung, or stuck in a step)"
        return None

    def crash_looping(self) -> bool:
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        return len(self.restarts) > MAX_RESTARTS

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self, timeout_s: float) -> None:
        stop_together([self], timeout_s)


def stop_together(children: list[Child], timeout_s: float) -> None:
    """SIGTERM to every child at once (each drains in parallel), then wait; kill one still running
    `timeout_s` after."""
    running = [child for child in children if child.process is not None and child.process.poll() is None]
    for child in running:
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in running:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"pagoda: the {child.name} did not stop within {timeout_s:g} s; killing it", file=sys.stderr)
            child.kill()


def up(args, engine: EngineConfig, serving: ServingConfig, gateway: GatewayConfig) -> int:
    data_parallel_size = args.data_parallel_size
    if data_parallel_size < 1:
        raise ConfigError("data_parallel_size must be >= 1")
    # refused before anything starts
    gpus = assign_gpus(engine.device, data_parallel_size, engine.tensor_parallel_size, visible_gpus())
    engine, gateway = pin_model(engine, gateway)
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):  # first, and explicit: a shell may start us with SIGINT ignored
        signal.signal(sig, lambda *_: stop.update(now=True))
    redis_server, children = None, []
    run_dir = Path(tempfile.mkdtemp(prefix="pagoda-up-"))
    code = 1
    try:  # whatever happens, the children (in sessions of their own) and Redis are stopped
        redis_url = args.redis_url
        if not redis_url:
            redis_server = RedisServer(die_with_parent=True, appendonly=True).start()
            redis_url = redis_server.url
            print(f"pagoda: private Redis at {redis_url} (append-only file, fsync every second)", file=sys.stderr)
        else:
            _warn_if_not_durable(redis_url)
        if args.addresses_file:
            _write_addresses(Path(args.addresses_file), local_url(gateway.host, gateway.port), redis_url)
        children = _children(engine, serving, gateway, redis_url, run_dir, data_parallel_size, gpus)
        for child in children:
            if not stop["now"]:
                child.start()
        code = _supervise(children, redis_server, args, stop)
    finally:
        print("\npagoda: stopping", file=sys.stderr)
        timeouts = {"gateway": gateway.drain_timeout_s + 10, "scheduler": serving.drain_timeout_s + 10, "worker": 10}
        for role in ("gateway", "scheduler", "worker"):  # the gateway drains first: nothing new reaches a scheduler
            stop_together([child for child in children if child.role == role], timeouts[role])
        if redis_server:
            redis_server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def pin_model(engine: EngineConfig, gateway: GatewayConfig) -> tuple[EngineConfig, GatewayConfig]:
    """The configs with a Hub id's revision resolved to its snapshot's commit (downloaded here, once,
    if the cache lacks it; one error if it cannot be): the children read that snapshot from the
    cache, none downloads, and all serve the same commit. `pagoda up` gives both one --model and
    one --download-dir."""
    engine = pin_revision(engine)
    return engine, dataclasses.replace(gateway, revision=engine.revision)


def _children(engine: EngineConfig, serving: ServingConfig, gateway: GatewayConfig, redis_url: str,
              run_dir: Path, data_parallel_size: int = 1, gpus: list[str] | None = None) -> list[Child]:
    """Each child gets its config as flags (config_to_argv): what the user gave `pagoda up`, with
    the Redis, the group's ZeroMQ and torch.distributed addresses and the heartbeat file this stack
    uses. `gpus`: one per worker, group by group (assign_gpus), or none (CPU)."""
    cli = [sys.executable, "-m", "pagoda.cli"]
    size = engine.tensor_parallel_size
    threads = cpu_threads_env(data_parallel_size * size)
    children = []
    for g in range(data_parallel_size):
        group = dataclasses.replace(serving, redis_url=redis_url, engine_id=str(g),
                                    zmq_address=f"tcp://127.0.0.1:{free_port()}",
                                    dist_init_address=f"tcp://127.0.0.1:{free_port()}")
        children.append(Child(f"scheduler-{g}", cli + [
            "scheduler", *config_to_argv(engine), *config_to_argv(group, SCHEDULER_EXCLUDES)]))
        for rank in range(size):
            heartbeat = run_dir / f"worker-{g}.{rank}.alive"
            rank_serving = dataclasses.replace(group, heartbeat_file=str(heartbeat))
            children.append(Child(f"worker-{g}.{rank}", cli + [
                "worker", "--rank", str(rank), *config_to_argv(engine), *config_to_argv(rank_serving, WORKER_EXCLUDES)],
                heartbeat, {"CUDA_VISIBLE_DEVICES": gpus[g * size + rank]} if gpus else threads))
    gateway = dataclasses.replace(gateway, redis_url=redis_url)
    children.append(Child("gateway", cli + ["gateway", *config_to_argv(gateway)]))
    return children


def cpu_threads_env(num_workers: int) -> dict[str, str]:
    """Workers on the CPU share its cores: each gets OMP_NUM_THREADS = cores / workers (torch's
    threads), unless the user set it. Every worker at all the cores oversubscribes them: two engine
    groups on 2 cores ran their steps about 2x slower (tests/test_data_parallel.py: 62 s vs 29 s)."""
    if num_workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_workers))}


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, found without importing torch: CUDA_VISIBLE_DEVICES's
    entries when it is set (up to the first invalid one, as CUDA reads it), else one index per
    `nvidia-smi -L` line; none without either."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry or entry.startswith("-"):
                break
            gpus.append(entry)
        return gpus
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def assign_gpus(device: str, data_parallel_size: int, tensor_parallel_size: int, gpus: list[str]) -> list[str]:
    """One GPU per worker, group by group (worker (g, r) gets gpus[g*N + r]), or [] where the workers
    are not given GPUs (--device cpu, or none visible). ConfigError when there are too few."""
    num_workers = data_parallel_size * tensor_parallel_size
    if device == "cpu" or not gpus:
        return []
    if device.startswith("cuda:"):
        if num_workers > 1:
            raise ConfigError(f"--device {device} names one GPU, but {num_workers} workers need one each "
                              f"(--data-parallel-size x --tensor-parallel-size); use --device cuda or auto")
        return []
    if num_workers > len(gpus):
        raise ConfigError(
            f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size {tensor_parallel_size} is "
            f"{num_workers} workers, one GPU each, but {len(gpus)} GPU(s) are visible ({','.join(gpus)}); "
            "lower either size or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return gpus[:num_workers]


def local_url(host: str, port: int) -> str:
    """The gateway's URL from this machine (a wildcard bind is reached on loopback)."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def _write_addresses(path: Path, url: str, redis_url: str) -> None:
    """{"url", "redis_url"} as JSON, whole or not at all (a launcher may read it at any moment)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"url": url, "redis_url": redis_url}) + "\n")
    partial.replace(path)


def _supervise(children: list[Child], redis_server: RedisServer | None, args, stop: dict) -> int:
    url = local_url(args.host, args.port)
    ready = False
    print("pagoda: loading the model and starting the gateway...", file=sys.stderr)
    redis_restarts = collections.deque()
    while not stop["now"]:
        if redis_server and redis_server.process.poll() is not None:
            print(f"pagoda: redis-server exited with code {redis_server.process.returncode}; restarting it",
                  file=sys.stderr)
            redis_restarts.append(time.monotonic())
            if len([t for t in redis_restarts if time.monotonic() - t < RESTART_WINDOW_S]) > MAX_RESTARTS:
                print("pagoda: redis-server keeps exiting; giving up", file=sys.stderr)
                return 1
            try:
                redis_server.start()
            except (RuntimeError, TimeoutError) as exc:
                print(f"pagoda: redis-server did not start: {exc}", file=sys.stderr)
        for child in children:
            reason = child.failure(args.worker_timeout)
            if reason is None:
                continue
            if child.process.returncode == EXIT_CONFIG_ERROR:  # it would refuse again: do not loop
                print(f"pagoda: the {child.name} refused its configuration (its error is above); stopping",
                      file=sys.stderr)
                return EXIT_CONFIG_ERROR
            print(f"pagoda: the {child.name} {reason}; restarting it", file=sys.stderr)
            if child.crash_looping():
                print(f"pagoda: the {child.name} restarted {MAX_RESTARTS} times in {RESTART_WINDOW_S:g} s; giving up",
                      file=sys.stderr)
                return 1
            child.kill()
            child.start()
        if not ready and healthy(url):
            ready = True
            _banner(url, args)
        time.sleep(POLL_S)
    return 0


def _warn_if_not_durable(redis_url: str) -> None:
    """An external Redis's persistence is its own: say what a restart of it would lose."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        appendonly = client.config_get("appendonly").get("appendonly")
    except redis.RedisError as exc:  # CONFIG may be off on a managed Redis
        print(f"pagoda: could not read the persistence of the Redis at {redis_url} ({exc})", file=sys.stderr)
        return
    finally:
        client.close()
    if appendonly != "yes":
        print(f"pagoda: warning: the Redis at {redis_url} keeps no append-only file (appendonly {appendonly}): if it "
              "restarts, a request it queued survives only while the gateway that accepted it is up to queue it "
              "again (docs/reliability.md)", file=sys.stderr)


def healthy(url: str) -> bool:
    """Whether the gateway at `url` answers /health with 200 (ready to serve)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Back once `url` is healthy; RuntimeError if `process` (the stack) exits first, TimeoutError
    at the deadline."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not healthy within {timeout:g} s")
        time.sleep(POLL_S)


def _banner(url: str, args) -> None:
    auth = f" \\\n  -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    print(
        f"\nPagoda is serving at {url}  (OpenAI-compatible: {url}/v1)\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n  -d '{body}'\n\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )
