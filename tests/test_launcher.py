"""The stack launcher (pagoda/bench/stack.py) and `pagoda up`'s health helpers, without a model (and
`pagoda up` refusing a model it cannot shard)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from common.redis_server import free_port
from pagoda.bench.stack import parse_metrics, parse_samples
from pagoda.up import _write_addresses, wait_healthy
from tests.stack import ROOT


def test_wait_healthy_says_when_the_stack_exits_before_it_is_healthy():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="^exited with 3 before it was healthy$"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", 60, process)


def test_wait_healthy_gives_up_at_its_deadline():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=f"^{url} was not healthy within 0.2 s$"):
        wait_healthy(url, 0.2)


def test_the_addresses_file_holds_both_urls_and_no_partial_file_is_left(tmp_path):
    path = tmp_path / "addresses.json"
    _write_addresses(path, "http://127.0.0.1:8000", "redis://127.0.0.1:6379/0")
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:8000", "redis_url": "redis://127.0.0.1:6379/0"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["addresses.json"]


def test_the_launcher_cli_exits_1_when_pagoda_up_fails_and_never_runs_the_command(tmp_path):
    marker = tmp_path / "ran"
    log = tmp_path / "up.log"
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.bench.stack", "--log", str(log), "--no-such-flag", "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"stack: pagoda up: exited with 2 before it was healthy; see {log}" in proc.stderr
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
    assert not marker.exists()


def test_the_launcher_cli_without_a_command_prints_its_usage_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "pagoda.bench.stack", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "usage: python -m pagoda.bench.stack [--log PATH] [PAGODA UP FLAGS] -- COMMAND [ARGS]\n"


def test_wait_drained_reads_only_statuses_published_after_it_was_called(monkeypatch):
    """A status from before a request that has since been answered shows the stack drained without the
    request's counts: wait_drained waits for a status every scheduler published after its call."""
    import time
    from types import SimpleNamespace

    from pagoda.bench.stack import GAUGES, Stack

    stack = Stack.__new__(Stack)
    stack.redis_url = "redis://unused"
    called = time.time()
    published = iter([[called - 0.3, called + 0.2], [called + 0.4, called - 0.1], [called + 0.4, called + 0.5]])
    reads = []

    def statuses():
        reads.append(next(published))
        return [SimpleNamespace(updated_at=t) for t in reads[-1]]

    monkeypatch.setattr(stack, "statuses", statuses)
    monkeypatch.setattr(stack, "metrics", lambda: {**dict.fromkeys(GAUGES, 0), "queries": len(reads)})
    monkeypatch.setattr(time, "time", lambda: called)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    assert stack.wait_drained(60) == {**dict.fromkeys(GAUGES, 0), "queries": 3}  # both fresh on the third read


def test_parse_metrics_drops_labels_and_comments():
    text = '# HELP x y\n# TYPE x gauge\npagoda:num_requests_running{model="m"} 2.0\npagoda:kv_cache_usage_perc 0.5\n'
    assert parse_metrics(text) == {"pagoda:num_requests_running": 2.0, "pagoda:kv_cache_usage_perc": 0.5}


ENGINES = ('# TYPE pagoda:num_requests_running gauge\n'
           'pagoda:num_requests_running{engine="0",model_name="m, \\"quoted\\""} 2.0\n'
           'pagoda:num_requests_running{engine="1",model_name="m, \\"quoted\\""} 3.0\n'
           'pagoda:num_schedulers{model_name="m"} 2.0\n')


def test_parse_metrics_sums_a_metrics_samples_over_their_labels():
    assert parse_metrics(ENGINES) == {"pagoda:num_requests_running": 5.0, "pagoda:num_schedulers": 2.0}


def test_parse_samples_keeps_each_samples_labels():
    model = 'm, \\"quoted\\"'
    assert parse_samples(ENGINES) == [
        ("pagoda:num_requests_running", {"engine": "0", "model_name": model}, 2.0),
        ("pagoda:num_requests_running", {"engine": "1", "model_name": model}, 3.0),
        ("pagoda:num_schedulers", {"model_name": "m"}, 2.0)]


def test_pagoda_up_stops_with_exit_2_when_a_child_refuses_its_configuration():
    """A worker that refuses the model (the default model's 9 heads do not split over 2 ranks)
    exits 2; restarting it would refuse again, so the stack stops at once instead of crash-looping."""
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "up", "--device", "cpu", "--tensor-parallel-size", "2",
         "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert "pagoda: error: --tensor-parallel-size 2 does not divide the attention heads (9)" in proc.stderr
    assert re.search(r"pagoda: the worker-0\.[01] refused its configuration \(its error is above\); stopping",
                     proc.stderr)
    assert "restarting it" not in proc.stderr
