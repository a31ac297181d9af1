"""deploy/grafana/pagoda.json asks only for what the server exports: every series a PromQL
expression names is a sample of the real GatewayMetrics exposition (rendered from real
SchedulerStatus values and some observations, parsed back with prometheus_client's parser), with
the labels the expression selects or groups by."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common.protocol import ITERATION_TOKENS_BUCKETS, SchedulerStatus
from gateway.metrics import FinishedOutput, GatewayMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pagoda.json"
METRIC = re.compile(r"\bpagoda:[A-Za-z0-9_:]+")
SELECTOR = re.compile(r"(pagoda:[A-Za-z0-9_:]+)\{([^}]*)\}")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Sample name (as Prometheus stores it: with _bucket, _sum, _count, _total) -> its label names."""
    metrics = GatewayMetrics("m")
    metrics.observe_tokens(0.05, 2)
    metrics.observe_finished(FinishedOutput("length", 0.0, 2.0, 0.1, 0.5, 1.5, 7, 3))
    status = SchedulerStatus(
        "s0", "m", 2048, 16, 128, 1900, True, num_running=2, num_waiting=1, num_swapped=1, kv_cache_usage=0.5,
        num_preemptions_total=3, prefix_cache_queries_total=40, prefix_cache_hits_total=16, updated_at=0.0,
        engine="0", num_cpu_blocks=64, cpu_cache_usage=0.25, num_shared_blocks=4, num_blocks_saved_by_sharing=6,
        num_cow_copies_total=2, num_swapped_out_blocks_total=8, num_swapped_in_blocks_total=8,
        num_prefix_evictions_total=1, iteration_tokens=[1] * (len(ITERATION_TOKENS_BUCKETS) + 1),
        iteration_tokens_sum=40000)
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render([status]).decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def expressions(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            exprs += [target["expr"] for target in inner.get("targets", [])]
    return exprs


def test_every_query_names_only_series_the_server_exports_with_their_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    series = exported()
    exprs = expressions(dashboard)
    assert len(exprs) >= 40
    named = set()
    for expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"names no pagoda metric: {expr}"
        for name in names:
            assert name in series and not name.endswith("_created"), f"{name} is not exported (in {expr})"
        for name, matchers in SELECTOR.findall(expr):
            for matcher in filter(None, (m.strip() for m in matchers.split(","))):
                label = re.match(r"[A-Za-z_][A-Za-z0-9_]*", matcher).group()
                assert label in series[name], f"{name} has no label {label} (in {expr})"
        labels = set.intersection(*(series[name] for name in names))
        for grouping in GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in grouping.split(","))):
                assert label in labels, f"grouped by {label}, which {names} lack (in {expr})"
        named.update(names)
    # the panels: latency, throughput, queue, KV usage (GPU and CPU), sharing, CoW, swaps,
    # preemptions, prefix hits and evictions
    assert {
        "pagoda:e2e_request_latency_seconds_bucket", "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:time_per_output_token_seconds_bucket", "pagoda:request_queue_time_seconds_bucket",
        "pagoda:generation_tokens_total", "pagoda:kv_cache_usage_perc", "pagoda:cpu_cache_usage_perc",
        "pagoda:num_shared_blocks", "pagoda:num_blocks_saved_by_sharing", "pagoda:num_cow_copies_total",
        "pagoda:num_swapped_out_blocks_total", "pagoda:num_swapped_in_blocks_total", "pagoda:num_preemptions_total",
        "pagoda:prefix_cache_hits_total", "pagoda:prefix_cache_evictions_total",
        "pagoda:iteration_tokens_total_bucket", "pagoda:request_prompt_tokens_bucket",
    } <= named


def test_every_panel_reads_the_datasource_chosen_at_import():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["definition"] == 'label_values({__name__=~"pagoda:.*"},model_name)'
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert 'model_name="$model_name"' in target["expr"], target["expr"]
