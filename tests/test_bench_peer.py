"""`pagoda bench peer` through the real client and a real stack: the shared `pagoda up` of the
default model plays both servers here; with PAGODA_LLAMA_SERVER (llama.cpp's llama-server binary)
the whole command runs against it too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from common.tokenizer import load_tokenizer
from pagoda.bench import peer
from pagoda.bench.common import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(default_stack):
    """The `pagoda up` of the default model that tests/conftest.py's DEFAULT_STACK_MODULES share."""
    return default_stack


def small(**overrides) -> Namespace:
    return Namespace(**{"concurrency": "1,2", "max_tokens": 6, "long_prompt_tokens": 64, **overrides})


def test_measure_runs_each_workload_on_each_server_in_turn(stack):
    urls = {"pagoda": stack.url, "peer": stack.url}
    samples, order = peer.measure(urls, peer.workloads(small()), rounds=2)

    names = ("streams-1", "streams-2", "ttft-long")
    assert order == ([f"0 {n} {s}" for n in names for s in ("pagoda", "peer")]
                     + [f"1 {n} {s}" for n in names for s in ("peer", "pagoda")])
    tokenizer = load_tokenizer("default")
    for server in urls:
        for count in (1, 2):
            for row in samples[f"streams-{count}"][server]:
                assert row["failed"] == [] and row["tokens"] == 6 * count
                assert row["value"] == pytest.approx(row["tokens"] / row["wall_s"])
        for r, row in enumerate(samples["ttft-long"][server]):
            assert row["failed"] == [] and row["value"] > 0
            assert row["prompt_tokens"] == len(tokenizer.encode(peer.long_prompt(64, f"{r} {server}")))
    medians, ratios, failures = peer.summarize(samples)
    assert failures == 0
    for name in names:
        assert ratios[name] == round(medians[name]["pagoda"] / medians[name]["peer"], 3)


def test_summarize_counts_failures_and_leaves_a_ratio_without_values_out():
    samples = {"streams-1": {"pagoda": [{"value": 10.0, "failed": []}, {"value": 30.0, "failed": []}],
                             "peer": [{"value": 40.0, "failed": ["3 tokens, not 6"]}]},
               "ttft-long": {"pagoda": [{"value": None, "failed": ["HTTP 500: b''"]}], "peer": [{"value": 5.0, "failed": []}]}}
    medians, ratios, failures = peer.summarize(samples)
    assert medians == {"streams-1": {"pagoda": 20.0, "peer": 40.0}, "ttft-long": {"pagoda": None, "peer": 5.0}}
    assert ratios == {"streams-1": 0.5, "ttft-long": None}
    assert failures == 2


def test_the_command_wants_a_peer():
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli", "bench", "peer", "--pagoda-url", "http://127.0.0.1:9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "give --llama-server PATH" in proc.stderr


@pytest.mark.skipif(not os.environ.get("PAGODA_LLAMA_SERVER"),
                    reason="set PAGODA_LLAMA_SERVER to llama.cpp's llama-server binary (docs/benchmarks.md)")
def test_against_llama_server(stack, tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli", "bench", "peer", "--llama-server",
                           os.environ["PAGODA_LLAMA_SERVER"], "--pagoda-url", stack.url, "--concurrency", "1,2",
                           "--max-tokens", "8", "--long-prompt-tokens", "64", "--rounds", "1", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failures"] == 0 and result["peer_command"].startswith(os.environ["PAGODA_LLAMA_SERVER"])
    for name in ("streams-1", "streams-2"):
        assert [row["tokens"] for row in result["samples"][name]["peer"]] == [8 * int(name[-1])]
    pagoda_prompt, = (row["prompt_tokens"] for row in result["samples"]["ttft-long"]["pagoda"])
    peer_prompt, = (row["prompt_tokens"] for row in result["samples"]["ttft-long"]["peer"])
    assert abs(pagoda_prompt - peer_prompt) <= 1  # the nonce names the server: "0 pagoda", "0 peer"
