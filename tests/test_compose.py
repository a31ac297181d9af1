"""compose.yaml: valid for docker-compose, and shaped as docs/architecture.md says."""
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT

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
