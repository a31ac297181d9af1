"""`pagoda bench throughput` and `pagoda bench serve`: their metrics exactly, and runs through the
real engine (tiny random Llama) and the real stack (tests/test_e2e.py drives `run_rate`)."""
import argparse
import json
import math
from pathlib import Path

import pytest

from pagoda.bench.client import Stream
from pagoda.bench.serve import (
    Target, add_arguments, arrival_times, data_parallel_summary, parse_rates, parse_sizes, parse_slos, plot, summarize,
    targets,
)
from pagoda.bench.workloads import shared_prefix_requests
from pagoda.cli import main

TINY = Path(__file__).parent / "data" / "tiny-llama.json"


def test_poisson_arrivals_have_the_asked_rate_and_inf_sends_all_at_once():
    times = arrival_times(4000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert 4000 / times[-1] == pytest.approx(4.0, rel=0.05)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, seed=7) == arrival_times(5, 2.0, seed=7)
    bursty = arrival_times(4000, rate=4.0, burstiness=0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert 4000 / bursty[-1] == pytest.approx(4.0, rel=0.15)
    assert max(gaps) > 2 * max(b - a for a, b in zip(times, times[1:]))  # burstier: longer lulls


def test_summarize_computes_each_metric_as_vllm_defines_it():
    results = [
        Stream(status=200, usage={"prompt_tokens": 10, "completion_tokens": 5}, times=[0.5, 1.0, 1.5, 2.0, 2.5],
               e2e=2.5),  # tpot 0.5
        Stream(status=200, usage={"prompt_tokens": 20, "completion_tokens": 3}, times=[1.0, 1.5, 2.0], e2e=2.0),
        Stream(status=500, body=b'{"error": {}}'),
    ]
    m = summarize(results, duration=4.0, slos={"ttft": 0.6})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["request_throughput"] == 0.5 and m["output_token_throughput"] == 2.0
    assert m["total_token_throughput"] == (8 + 30) / 4.0
    assert m["goodput"] == 0.25  # only the first meets the TTFT SLO
    assert m["ttft_s"] == {"mean": 0.75, "median": 0.75, "p99": pytest.approx(0.995)}  # interpolated linearly
    assert m["tpot_s"]["mean"] == 0.5 and m["itl_s"]["median"] == 0.5
    assert m["e2e_s"]["mean"] == 2.25
    assert m["normalized_latency_s_per_token"] == pytest.approx((2.5 / 5 + 2.0 / 3) / 2)


def test_rates_and_slos_parse_and_bad_slos_are_errors():
    assert parse_rates("0.5, 2,inf") == [0.5, 2.0, math.inf]
    assert parse_slos("ttft:2000,tpot:500") == {"ttft": 2.0, "tpot": 0.5}
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slos("latency:3")


def serve_args(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def test_bench_serve_launches_one_stack_per_allocator_or_per_data_parallel_size():
    assert targets(serve_args("--base-url", "http://h:1", "--label", "x")) == [Target("x", "http://h:1")]
    assert targets(serve_args("--launch")) == [Target("paged", allocator="paged"),
                                               Target("orca-oracle", allocator="orca-oracle")]
    assert targets(serve_args("--launch", "--data-parallel-sizes", "1,2")) == [
        Target("data-parallel-1", data_parallel_size=1), Target("data-parallel-2", data_parallel_size=2)]
    with pytest.raises(ValueError, match="--data-parallel-sizes must be sizes >= 1, comma-separated, not '0,2'"):
        parse_sizes("0,2")


def test_the_data_parallel_summary_gives_each_sizes_request_throughput_over_the_first():
    chosen = [Target("data-parallel-1", data_parallel_size=1), Target("data-parallel-2", data_parallel_size=2)]
    runs = {"data-parallel-1": [{"request_rate": 2.0, "request_throughput": 1.5},
                                {"request_rate": "inf", "request_throughput": 2.0}],
            "data-parallel-2": [{"request_rate": 2.0, "request_throughput": 1.5},
                                {"request_rate": "inf", "request_throughput": 3.5}]}
    assert data_parallel_summary(runs, chosen) == {"sizes": [1, 2], "per_rate": [
        {"request_rate": 2.0, "request_throughput": {"1": 1.5, "2": 1.5}, "ratio_to_size_1": {"2": 1.0}},
        {"request_rate": "inf", "request_throughput": {"1": 2.0, "2": 3.5}, "ratio_to_size_1": {"2": 1.75}}]}
    runs["data-parallel-1"][0]["cpu_cores"] = {"worker": 0.5, "gateway": 0.1}
    runs["data-parallel-2"][0]["cpu_cores"] = {"worker": 0.75}
    assert data_parallel_summary(runs, chosen)["per_rate"][0]["worker_cores"] == {"1": 0.5, "2": 0.75}


def test_plot_draws_normalized_latency_per_allocator(tmp_path):
    result = {"model": "m", "workload": {"name": "ShareGPT"}, "device": "cpu (2 cores)", "runs": {
        "paged": [{"request_rate": 1.0, "normalized_latency_s_per_token": 0.1},
                  {"request_rate": 2.0, "normalized_latency_s_per_token": 0.2}],
        "orca-oracle": [{"request_rate": 1.0, "normalized_latency_s_per_token": 0.3}],
    }}
    plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_throughput_runs_both_sides_on_the_same_requests(tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", f"dummy:{TINY}", "--device", "cpu", "--num-prompts", "6",
                 "--max-output-len", "8", "--ignore-eos", "--hf-batch-size", "4", "--source", "trace",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    from pagoda.bench.workloads import sample_sharegpt

    expected_tokens = sum(min(p.output_len, 8) for p in sample_sharegpt(6, 0, "trace"))
    assert result["pagoda"]["output_tokens"] == result["baseline"]["output_tokens"] == expected_tokens
    assert result["ratio"] == pytest.approx(
        result["pagoda"]["output_tokens_per_s"] / result["baseline"]["output_tokens_per_s"])
    assert result["workload"]["num_prompts"] == 6 and result["allocator"] == "paged"
    assert result["command"].startswith("pagoda bench throughput --model dummy:")
    assert {"commit", "date", "device"} <= result.keys()


def test_bench_throughput_runs_an_orca_baseline_allocator(tmp_path):
    out = tmp_path / "oracle.json"
    assert main(["bench", "throughput", "--model", f"dummy:{TINY}", "--device", "cpu", "--num-prompts", "4",
                 "--max-output-len", "4", "--ignore-eos", "--allocator", "orca-oracle", "--skip-baseline",
                 "--source", "trace", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["allocator"] == "orca-oracle" and "baseline" not in result
    assert result["pagoda"]["output_tokens"] > 0


def test_bench_throughput_runs_a_tensor_parallel_group(tmp_path, monkeypatch):
    """--tensor-parallel-size reaches the offline engine: rank 0 here, rank 1 a child process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # per rank
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", f"dummy:{TINY}", "--device", "cpu", "--num-prompts", "4",
                 "--max-output-len", "4", "--ignore-eos", "--skip-baseline", "--tensor-parallel-size", "2",
                 "--num-gpu-blocks", "256", "--source", "trace", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    from pagoda.bench.workloads import sample_sharegpt

    assert result["tensor_parallel_size"] == 2
    assert result["pagoda"]["output_tokens"] == sum(min(p.output_len, 4) for p in sample_sharegpt(4, 0, "trace"))


def test_bench_throughput_serves_the_same_requests_over_random_adapters(tmp_path):
    """--lora-adapters 3 --max-loras 2: a second engine serves request i on adapter i mod 3; every
    requested token comes out, each adapter loaded, one slot evicted at least once."""
    out = tmp_path / "lora.json"
    assert main(["bench", "throughput", "--model", f"dummy:{TINY}", "--device", "cpu", "--num-prompts", "4",
                 "--max-output-len", "4", "--ignore-eos", "--skip-baseline", "--lora-adapters", "3",
                 "--lora-rank", "8", "--max-loras", "2", "--source", "trace", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    lora = result["lora"]
    assert (lora["adapters"], lora["rank"], lora["max_loras"]) == (3, 8, 2)
    assert lora["pagoda"]["output_tokens"] == result["pagoda"]["output_tokens"]
    assert lora["pagoda"]["lora_loads"] >= 3 and lora["pagoda"]["lora_evictions"] >= 1
    assert lora["lora_over_base_output_tokens_per_s"] == pytest.approx(
        lora["pagoda"]["output_tokens_per_s"] / result["pagoda"]["output_tokens_per_s"], abs=1e-3)


def test_bench_cpu_tier_serves_the_evicted_prefix_from_the_tier_with_the_device_hits_tokens(tmp_path):
    """`pagoda bench cpu-tier` on the tiny model: the tier's engine finds the whole 64-token prefix
    (the recomputing engine's pool kept 2 of its 4 blocks), and its tokens are the device hit's."""
    out = tmp_path / "tier.json"
    assert main(["bench", "cpu-tier", "--model", f"dummy:{TINY}", "--device", "cpu", "--prefix-len", "64",
                 "--rounds", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert runs["cpu_tier"]["enabled"] and not runs["recompute"]["enabled"]
    assert [runs[name]["cached_tokens"] for name in ("cpu_tier", "recompute", "device_hit")] == [[64], [32], [64]]
    assert runs["cpu_tier"]["cpu_tier_hits_blocks"] >= 4 and result["same_tokens_as_device_hit"] is True
    assert result["device_pool_blocks"] == 8 and result["command"].startswith("pagoda bench cpu-tier --model dummy:")


def test_shared_prefix_requests_share_each_prefix_among_its_conversations_in_a_seeded_order():
    requests = shared_prefix_requests(num_prefixes=3, prefix_len=40, conversations=5, question_len=8, output_len=7,
                                      seed=3, vocab=(1000, 2000))
    assert len(requests) == 15 and {n for _, n in requests} == {7}
    assert all(len(p) == 48 and all(1000 <= t < 2000 for t in p) for p, _ in requests)
    counts: dict[tuple[int, ...], int] = {}
    for prompt, _ in requests:
        counts[tuple(prompt[:40])] = counts.get(tuple(prompt[:40]), 0) + 1
    assert sorted(counts.values()) == [5, 5, 5]
    assert len({tuple(p[40:]) for p, _ in requests}) == 15  # every conversation its own question
    order = [list(counts).index(tuple(p[:40])) for p, _ in requests]
    assert order != sorted(order)  # shuffled, not grouped by prefix
    assert shared_prefix_requests(3, 40, 5, 8, 7, seed=3, vocab=(1000, 2000)) == requests
    assert shared_prefix_requests(3, 40, 5, 8, 7, seed=4, vocab=(1000, 2000)) != requests


@pytest.mark.slow
def test_bench_routing_serves_the_requests_routed_by_cache(tmp_path):
    """`pagoda bench routing --routings cache_aware` at a tiny size: a stack of two engine groups
    serves all 6 requests, each routed to a group (a new prefix to the group holding fewer blocks,
    its next conversation after it), and each group reads exactly the requests routed to it. The
    pull run is the same code with one flag changed (the comparison: the next test)."""
    from common.redis_server import free_port

    out = tmp_path / "routing.json"
    assert main(["bench", "routing", "--routings", "cache_aware", "--num-prefixes", "2", "--prefix-len", "64",
                 "--conversations", "3", "--output-len", "2", "--port", str(free_port()), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    [(name, run)] = result["runs"].items()
    assert name == "cache_aware" and result["workload"]["num_requests"] == 6
    assert (run["completed"], run["failed"]) == (6, 0) and "errors" not in run
    assert run["prefix_cache_queries_tokens"] == 6 * (64 + 32)  # one lookup per prompt
    assert 0.0 < run["prefix_cache_hit_rate"] <= 1.0
    decisions = run["routing_decisions"]
    assert sum(decisions["smallest_cache"].values()) == 2 and set(decisions) <= {"smallest_cache", "cache_hit",
                                                                                "least_loaded"}
    routed = {e: sum(by_engine.get(e, 0) for by_engine in decisions.values()) for e in ("0", "1")}
    assert {e: run["per_engine"][e]["requests_routed"] for e in ("0", "1")} == routed  # nothing stolen, idle or not
    assert result["command"].startswith("pagoda bench routing --routings cache_aware --model default")


def test_bench_routing_compares_hit_rate_and_throughput_against_pull():
    from pagoda.bench.routing import comparison

    runs = {"cache_aware": {"prefix_cache_hit_rate": 0.9, "request_throughput": 2.6, "failed": 0},
            "pull": {"prefix_cache_hit_rate": 0.45, "request_throughput": 1.3, "failed": 0}}
    assert comparison(runs) == {
        "hit_rate_ratio_cache_aware_over_pull": 2.0, "request_throughput_ratio_cache_aware_over_pull": 2.0,
        "goal": "hit rate >= 1.8x, request throughput >= 1.3x (cache_aware over pull, every request completed)",
        "goal_met": True}
    runs["pull"]["failed"] = 1
    assert comparison(runs)["goal_met"] is False
    runs["pull"].update(failed=0, prefix_cache_hit_rate=0.6)
    assert comparison(runs)["hit_rate_ratio_cache_aware_over_pull"] == 1.5 and not comparison(runs)["goal_met"]
    assert comparison({"pull": runs["pull"]}) == {}


@pytest.mark.slow
def test_bench_overload_answers_only_completions_and_429s_with_retry_after(tmp_path, monkeypatch):
    """`pagoda bench overload` at a tiny size: 1 req/s for 2 s, then 8 req/s with 2 queued
    requests allowed; phase B meets the bound (429 queue_full with Retry-After), every other answer
    is a completion of exactly its 4 tokens, and the result has the goal's fields."""
    from common.redis_server import free_port

    # the stack's one worker: two intra-op threads on 2 cores shared with the gateway and this process
    # waited on each other (on a busy host phase B took 16 s for 6 completions with two, p99 TTFT 12 s)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "overload.json"
    assert main(["bench", "overload", "--duration", "2", "--sustainable-rate", "1", "--overload-factor", "8",
                 "--max-num-queued-requests", "2", "--output-len", "4", "--max-num-seqs", "2",
                 "--sample-interval", "0.5", "--port", str(free_port()), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert result["calibration"] is None and result["sustainable_rate"] == 1.0
    assert [phases[name]["request_rate"] for name in ("sustainable", "overload")] == [1.0, 8.0]
    for phase in phases.values():
        answers = phase["answers"]
        assert answers["completed"] + answers["rejected_with_retry_after"] == phase["arrivals"] >= 1, answers
        assert set(phase["status_counts"]) <= {"200", "429"}
        assert answers["completed"] == phase["status_counts"]["200"] >= 1
        assert answers["rejected_with_retry_after"] == phase["status_counts"].get("429", 0)
        assert phase["output_tokens"] == 4 * answers["completed"] and "errors" not in phase
        assert set(phase["rejection_codes"]) <= {"queue_full"}
        assert phase["ttft_s"]["p99"] >= phase["ttft_s"]["median"] > 0
        memory = phase["memory"]
        assert memory["num_samples"] >= 2 and memory["start_mib"] > 0
        assert {"gateway", "scheduler", "worker"} <= set(memory["processes"])  # each one's RSS, beside the sum
        assert memory["start_mib"] == pytest.approx(sum(p["start_mib"] for p in memory["processes"].values()),
                                                    abs=0.1 * len(memory["processes"]))
        assert memory["growth_fraction"] == max(p["growth_fraction"] for p in memory["processes"].values())
    overload = phases["overload"]
    assert overload["status_counts"]["429"] >= 1 and overload["rejection_codes"] == {
        "queue_full": overload["status_counts"]["429"]}
    assert sum(overload["retry_after_values"].values()) == overload["status_counts"]["429"]
    goal = result["goal"]
    assert goal["every_answer_completion_or_429_with_retry_after"] is True
    assert goal["phase_b_rejected_429"] == overload["status_counts"]["429"]
    assert goal["p99_ttft_ratio"] == pytest.approx(
        overload["ttft_s"]["p99"] / phases["sustainable"]["ttft_s"]["p99"], abs=1e-3)
    assert (goal["p99_ttft_ratio_max"], goal["memory_growth_max_fraction"]) == (3.0, 0.05)
    assert goal["memory_growth_fraction"] == overload["memory"]["growth_fraction"]
    assert goal["memory_growth_by_process"] == {
        name: p["growth_fraction"] for name, p in overload["memory"]["processes"].items()}
    assert goal["goal_met"] == (goal["p99_ttft_within"] and goal["memory_flat"])
    assert result["memory"]["num_samples"] >= 4 and result["stack_exit_code"] == 0
    assert result["command"].startswith("pagoda bench overload --model default --device cpu --max-num-seqs 2")
