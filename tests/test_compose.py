"""compose.yaml and deploy/compose/: valid for docker-compose, and shaped as docs/architecture.md says."""
import shutil
import socket
import subprocess

import pytest
import yaml

from common import streams
from common.config import GatewayConfig
from common.protocol import SchedulerStatus, encode
from tests.conftest import ROOT
from tests.deployments import EngineGroup, check_engine_groups, host_of, parse_health, parse_pagoda

COMPOSE = ROOT / "compose.yaml"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_file():
    proc = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "--services"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["redis", "scheduler", "worker-0", "gateway"]


def test_services_wait_for_healthy_dependencies():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(services) == {"redis", "scheduler", "worker-0", "gateway"}
    assert all("healthcheck" in s for s in services.values())
    assert services["scheduler"]["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}
    assert services["scheduler"]["healthcheck"]["start_period"] == "300s"


def test_worker_reserves_one_gpu_and_gateway_binds_loopback():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    devices = services["worker-0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert all(port.startswith("127.0.0.1:") for port in services["gateway"]["ports"])


def test_workers_report_their_heartbeat_and_servers_get_time_to_drain():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    worker = services["worker-0"]
    beat = worker["command"][worker["command"].index("--heartbeat-file") + 1]
    assert worker["healthcheck"]["test"][-4:] == ["--heartbeat-file", beat, "--max-age", "15"]
    assert all(services[s]["restart"] == "unless-stopped" for s in services)
    assert services["scheduler"]["stop_grace_period"] == services["gateway"]["stop_grace_period"] == "40s"


def test_the_health_check_reads_a_workers_heartbeat(tmp_path):
    import os
    import time

    from common.health import main

    beat = tmp_path / "alive"
    assert main(["--heartbeat-file", str(beat)]) == 1  # none yet
    beat.touch()
    assert main(["--heartbeat-file", str(beat), "--max-age", "15"]) == 0
    os.utime(beat, (time.time() - 20, time.time() - 20))
    assert main(["--heartbeat-file", str(beat), "--max-age", "15"]) == 1


# ----------------------------------------------------------------------------- engine groups

TENSOR_PARALLEL = ROOT / "deploy" / "compose" / "tensor-parallel.yaml"
TP_SERVICES = ["redis", "scheduler-0", "worker-0-0", "worker-0-1", "scheduler-1", "worker-1-0", "worker-1-1", "gateway"]


def engine_groups(services: dict) -> list[EngineGroup]:
    """One group per scheduler service; a worker belongs to the scheduler it connects to."""
    commands = {name: parse_pagoda(s["command"]) for name, s in services.items() if s["command"][0] == "pagoda"}
    groups = {name: EngineGroup(name, c, []) for name, c in commands.items() if c.name == "scheduler"}
    for name, command in commands.items():
        if command.name == "worker":
            groups[host_of(command.serving.zmq_address)].ranks.append(command)
    return list(groups.values())


def worker_services(services: dict) -> dict[str, dict]:
    return {name: s for name, s in services.items() if s["command"][:2] == ["pagoda", "worker"]}


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_tensor_parallel_file():
    proc = subprocess.run(["docker-compose", "-f", str(TENSOR_PARALLEL), "config", "--services"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == TP_SERVICES


@pytest.mark.parametrize("path", [COMPOSE, TENSOR_PARALLEL], ids=["compose.yaml", "tensor-parallel.yaml"])
def test_each_engine_group_is_a_whole_tensor_parallel_group(path):
    groups = engine_groups(yaml.safe_load(path.read_text())["services"])
    check_engine_groups(groups)
    sizes = {g.name: (g.scheduler.engine.tensor_parallel_size, g.scheduler.serving.engine_id) for g in groups}
    if path == COMPOSE:
        assert sizes == {"scheduler": (1, "0")}
    else:
        assert sizes == {"scheduler-0": (2, "0"), "scheduler-1": (2, "1")}


def test_tensor_parallel_ranks_rendezvous_at_their_rank_0_and_each_has_its_own_gpu():
    services = yaml.safe_load(TENSOR_PARALLEL.read_text())["services"]
    assert list(services) == TP_SERVICES
    workers = {name: parse_pagoda(s["command"]) for name, s in worker_services(services).items()}
    for group in engine_groups(services):
        rank_0 = [name for name, w in workers.items() if host_of(w.serving.zmq_address) == group.name and w.args.rank == 0]
        assert len(rank_0) == 1, group.name
        # rank 0's store listens on every interface; every rank (rank 0 too) reaches it by its service name
        assert {r.serving.dist_init_address for r in group.ranks} == {f"tcp://{rank_0[0]}:29500"}
        assert group.scheduler.serving.zmq_address == "tcp://0.0.0.0:5557"
    gpus = []
    for name, service in worker_services(services).items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], name
        gpus += devices[0]["device_ids"]
    assert gpus == ["0", "1", "2", "3"]


def test_tensor_parallel_health_checks_name_their_own_process():
    services = yaml.safe_load(TENSOR_PARALLEL.read_text())["services"]
    assert all(s["restart"] == "unless-stopped" for s in services.values())
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        if name == "redis" or name == "gateway":
            continue
        assert test[0] == "CMD", name
        check = parse_health(test[1:])
        if name.startswith("worker-"):
            worker = parse_pagoda(service["command"])
            assert (check.heartbeat_file, check.max_age) == (worker.serving.heartbeat_file, 15.0), name
            assert service["depends_on"] == {"redis": {"condition": "service_healthy"}}
        else:  # this container's scheduler, not any group's: each group is healthy on its own
            assert (check.redis_url, check.this_host, check.workers) == ("redis://redis:6379/0", True, True), name
            assert parse_pagoda(service["command"]).serving.redis_url == check.redis_url
            assert service["stop_grace_period"] == "40s"
            assert service["healthcheck"]["start_period"] == "300s"
    gateway = services["gateway"]
    assert parse_pagoda(gateway["command"]).configs[GatewayConfig].host == "0.0.0.0"
    assert all(port.startswith("127.0.0.1:") for port in gateway["ports"])
    assert gateway["depends_on"] == {s: {"condition": "service_healthy"} for s in ("scheduler-0", "scheduler-1")}


# ----------------------------------------------------------------------------- common.health --this-host

def publish_status(client, scheduler_id: str, workers_ready: bool) -> None:
    status = SchedulerStatus(scheduler_id=scheduler_id, model="m", max_model_len=64, block_size=16, num_gpu_blocks=8,
                             max_request_tokens=64, workers_ready=workers_ready, num_running=0, num_waiting=0,
                             num_swapped=0, kv_cache_usage=0.0, num_preemptions_total=0, prefix_cache_queries_total=0,
                             prefix_cache_hits_total=0, updated_at=0.0)
    client.set(streams.status_key(scheduler_id), encode(status), px=10_000)


def test_the_health_check_counts_only_this_hosts_scheduler_with_this_host(redis_server, monkeypatch):
    import redis

    from common.health import main

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    url = ["--redis-url", redis_server.url]
    assert [main(url), main([*url, "--workers"]), main([*url, "--this-host"])] == [0, 1, 1]
    publish_status(client, "another-host-7", workers_ready=True)  # another group's, ready
    assert [main([*url, "--workers"]), main([*url, "--this-host"]), main([*url, "--this-host", "--workers"])] == [0, 1, 1]
    publish_status(client, f"{socket.gethostname()}-12", workers_ready=False)  # ours, its ranks not yet connected
    assert [main([*url, "--this-host"]), main([*url, "--this-host", "--workers"])] == [0, 1]
    publish_status(client, f"{socket.gethostname()}-12", workers_ready=True)
    assert main([*url, "--this-host", "--workers"]) == 0
    monkeypatch.setenv("PAGODA_REDIS_URL", redis_server.url)  # as the Kubernetes probes give it
    assert main(["--this-host", "--workers"]) == 0
    client.delete(streams.status_key(f"{socket.gethostname()}-12"))
    assert main(["--this-host"]) == 1
