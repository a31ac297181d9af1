"""What keeps processes honest: ZeroMQ links that notice a lost rank and drop malformed frames,
the worker's heartbeat, `pagoda up`'s restarts and crash-loop exit, and non-zero exits on fatal errors.
Real sockets and real processes throughout; no model is loaded."""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import zmq

import pagoda.up as up_module
from common.protocol import StepPlan, WorkerHello, encode
from common.redis_server import free_port
from common.transport import SchedulerLink, WorkerLink
from pagoda.up import Child, _supervise
from worker.heartbeat import Heartbeat


def hello(rank: int = 0) -> WorkerHello:
    return WorkerHello(rank=rank, world_size=1, device="fake", model="m", num_gpu_blocks=8, num_cpu_blocks=0,
                       block_size=16, max_model_len=64, vocab_size=100, eos_token_ids=[2], kv_bytes_per_block=1,
                       host_bandwidth=1.0, prefill_tokens_per_s=1.0)


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


# ----------------------------------------------------------------------------- ZeroMQ


def test_a_ranks_closed_connection_is_reported_and_a_strays_is_not():
    address = f"tcp://127.0.0.1:{free_port()}"
    link = WorkerLink(address, world_size=1, context=zmq.Context())
    stray = zmq.Context().socket(zmq.DEALER)
    stray.connect(address)
    stray.send_multipart([b"nonsense"])
    worker = SchedulerLink(address, context=zmq.Context())
    worker.hello(hello())
    try:
        wait_for(lambda: link.poll_hello(50) is not None and link.ready)
        stray.close(0)  # not a rank: its leaving changes nothing
        time.sleep(0.3)
        assert link.check_connections() is None and link.ready
        worker.close()
        wait_for(lambda: link.check_connections() is not None)
        assert link.lost == 0
        link.forget_workers()
        assert (link.lost, link.ranks, link.fds) == (None, {}, {})
    finally:
        link.close()


def test_gather_returns_at_once_when_a_rank_disconnects_mid_step():
    address = f"tcp://127.0.0.1:{free_port()}"
    link = WorkerLink(address, world_size=1, context=zmq.Context())
    worker = SchedulerLink(address, context=zmq.Context())
    worker.hello(hello())
    try:
        wait_for(lambda: link.poll_hello(50) is not None and link.ready)
        plan = StepPlan(step=1, epoch=7)
        link.send_plan(plan)
        assert worker.recv_plan(timeout_ms=2000) == plan
        worker.close()  # dies without answering
        start = time.monotonic()
        assert link.gather(plan, timeout_s=30) is None
        assert time.monotonic() - start < 2 and link.lost == 0
    finally:
        link.close()


def test_a_worker_drops_malformed_plans_and_takes_the_next_good_one():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    worker = SchedulerLink(address, context=context)
    try:
        worker.hello(hello())
        identity, _, _ = router.recv_multipart()
        plan = StepPlan(step=3, epoch=1)
        for frame in (b"\xff\x00garbage", encode(hello()), encode([99, {}]), encode(plan)):
            router.send_multipart([identity, frame])
        received = [worker.recv_plan(timeout_ms=2000) for _ in range(4)]
        assert received == [None, None, None, plan]
    finally:
        worker.close()
        router.close(0)


# ----------------------------------------------------------------------------- heartbeat


def test_the_heartbeat_stops_while_a_step_runs_past_the_step_timeout(tmp_path):
    path = tmp_path / "alive"
    heartbeat = Heartbeat(str(path), step_timeout_s=0.3, interval_s=0.05)
    first = path.stat().st_mtime_ns
    assert wait_for(lambda: path.stat().st_mtime_ns > first)
    heartbeat.step_started = time.monotonic()  # a step within the deadline: still alive
    time.sleep(0.15)
    assert heartbeat.alive()
    time.sleep(0.3)  # now past it: the file stops changing
    assert not heartbeat.alive()
    stale = path.stat().st_mtime_ns
    time.sleep(0.3)
    assert path.stat().st_mtime_ns == stale
    heartbeat.step_started = None
    assert wait_for(lambda: path.stat().st_mtime_ns > stale)


# ----------------------------------------------------------------------------- pagoda up


def args(**changes) -> SimpleNamespace:
    return SimpleNamespace(host="127.0.0.1", port=free_port(), api_key=None, worker_timeout=1.0, **changes)


def test_a_crash_looping_child_makes_up_give_up_with_exit_code_1(monkeypatch, capsys):
    monkeypatch.setattr(up_module, "POLL_S", 0.05)
    child = Child("worker", [sys.executable, "-c", "import sys; sys.exit(3)"])
    child.start()
    try:
        assert _supervise([child], None, args(), {"now": False}) == 1
    finally:
        child.kill()
    err = capsys.readouterr().err
    assert err.count("the worker exited with code 3; restarting it") == up_module.MAX_RESTARTS + 1
    assert f"the worker restarted {up_module.MAX_RESTARTS} times in 60 s; giving up" in err


def test_a_child_with_a_stale_heartbeat_is_killed_and_restarted(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up_module, "POLL_S", 0.05)
    beat = tmp_path / "alive"
    # beats for 0.3 s, then hangs (as a stopped worker would)
    script = (f"import pathlib, time\nfor _ in range(3):\n    pathlib.Path({str(beat)!r}).touch(); time.sleep(0.1)\n"
              "time.sleep(60)")
    child = Child("worker", [sys.executable, "-c", script], heartbeat=beat)
    child.start()
    first = child.process
    stop = {"now": False}
    try:
        supervisor = threading.Thread(target=_supervise, args=([child], None, args(), stop), daemon=True)
        supervisor.start()
        wait_for(lambda: child.process is not first, timeout=10)
        assert first.returncode == -9  # killed, then a new one started
        stop["now"] = True
        supervisor.join(5)
    finally:
        child.kill()
    assert "the worker has not shown a heartbeat for 1 s (stopped, hung, or stuck in a step); restarting it" in (
        capsys.readouterr().err)


def test_a_private_redis_that_dies_is_restarted_on_its_port(monkeypatch, capsys):
    import redis

    from common.redis_server import RedisServer

    monkeypatch.setattr(up_module, "POLL_S", 0.05)
    server = RedisServer().start()
    stop = {"now": False}
    supervisor = threading.Thread(target=_supervise, args=([], server, args(), stop), daemon=True)
    supervisor.start()
    try:
        first = server.process
        first.kill()
        wait_for(lambda: server.process is not first and server.process.poll() is None)
        assert wait_for(lambda: _pings(redis.Redis.from_url(server.url)))
    finally:
        stop["now"] = True
        supervisor.join(5)
        server.stop()
    assert "pagoda: redis-server exited with code -9; restarting it" in capsys.readouterr().err


def _pings(client) -> bool:
    try:
        return client.ping()
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ----------------------------------------------------------------------------- fatal errors


def test_a_scheduler_that_cannot_bind_its_address_exits_non_zero():
    port = free_port()
    taken = zmq.Context().socket(zmq.ROUTER)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pagoda.cli", "scheduler", "--redis-url", "redis://127.0.0.1:1/0",
             "--zmq-address", f"tcp://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    finally:
        taken.close(0)
    assert proc.returncode == 1
    assert "Address already in use" in proc.stderr


def test_a_worker_whose_model_cannot_load_exits_non_zero(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "worker", "--model", str(tmp_path / "missing"), "--device", "cpu",
         "--zmq-address", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "missing" in proc.stderr


def test_every_listener_binds_loopback_by_default():
    from common.config import GatewayConfig, ServingConfig
    from common.redis_server import RedisServer
    from pagoda import cli

    assert GatewayConfig().host == "127.0.0.1"
    assert ServingConfig().zmq_address.startswith("tcp://127.0.0.1:")
    assert RedisServer().host == "127.0.0.1"
    for command, add in (("gateway", cli._add_gateway), ("scheduler", cli._add_scheduler), ("worker", cli._add_worker),
                         ("up", cli._add_up)):
        parser = argparse.ArgumentParser()
        add(parser)
        defaults = vars(parser.parse_args([]))
        if "host" in defaults:
            assert defaults["host"] == "127.0.0.1", command
        if "zmq_address" in defaults:
            assert defaults["zmq_address"].startswith("tcp://127.0.0.1:"), command
