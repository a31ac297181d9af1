"""Prometheus metrics with vLLM's names under `pagoda:`: this gateway's latencies and counts, plus
the gauges and counters of every live scheduler, read from their status keys.

Every series carries `model_name` (the served model name, as vLLM's do). A scheduler's series also
carry `engine` (its --engine-id): one sample per engine group, so a dashboard sums over `engine` for
the whole deployment. Schedulers that share an engine id are summed into its one sample.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from common.protocol import SchedulerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


def _kv_cache_usage(statuses: list[SchedulerStatus]) -> float:
    total_blocks = sum(x.num_gpu_blocks for x in statuses)
    used = sum(x.kv_cache_usage * x.num_gpu_blocks for x in statuses)
    return used / total_blocks if total_blocks else 0.0


def _summed(field: str) -> Callable[[list[SchedulerStatus]], float]:
    """The sum of a status field over one engine group's schedulers."""
    return lambda statuses: sum(getattr(x, field) for x in statuses)


# (family, name, help, the value of one engine group's statuses)
ENGINE_SERIES: tuple[tuple[type, str, str, Callable[[list[SchedulerStatus]], float]], ...] = (
    (GaugeMetricFamily, "pagoda:num_requests_running", "Requests in the running batch.",
     _summed("num_running")),
    (GaugeMetricFamily, "pagoda:num_requests_waiting", "Requests waiting to be scheduled.",
     _summed("num_waiting")),
    (GaugeMetricFamily, "pagoda:num_requests_swapped", "Requests swapped out to the CPU pool.",
     _summed("num_swapped")),
    (GaugeMetricFamily, "pagoda:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", _kv_cache_usage),
    (CounterMetricFamily, "pagoda:num_preemptions", "Preemptions since the scheduler started.",
     _summed("num_preemptions_total")),
    (CounterMetricFamily, "pagoda:prefix_cache_queries", "Prefix cache lookups, in tokens.",
     _summed("prefix_cache_queries_total")),
    (CounterMetricFamily, "pagoda:prefix_cache_hits", "Prefix cache hits, in tokens.",
     _summed("prefix_cache_hits_total")),
)


class SchedulerCollector(Collector):
    """The schedulers' gauges and counters as of the last `render`, one sample per engine group."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.statuses: list[SchedulerStatus] = []

    def collect(self):
        groups: dict[str, list[SchedulerStatus]] = {}
        for status in sorted(self.statuses, key=lambda x: x.engine):
            groups.setdefault(status.engine, []).append(status)
        live = GaugeMetricFamily("pagoda:num_schedulers", "Live schedulers (status key present).", labels=["model_name"])
        live.add_metric([self.model_name], len(self.statuses))
        yield live
        for family, name, help, value in ENGINE_SERIES:
            metric = family(name, help, labels=["model_name", "engine"])
            for engine, statuses in groups.items():
                metric.add_metric([self.model_name, engine], value(statuses))
            yield metric


@dataclass(slots=True)
class ModelLabelled:
    """A labelled metric whose first label, model_name, is given once: `.labels(route, status)`."""

    metric: MetricWrapperBase
    model_name: str

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)


class GatewayMetrics:
    """One per app, in a private registry (several apps in one process do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, model = self.registry, ["model_name"]
        self.time_to_first_token = Histogram(
            "pagoda:time_to_first_token_seconds", "Arrival at the gateway to the first token back.", model,
            buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "pagoda:inter_token_latency_seconds", "Time between tokens of a request, as seen by the gateway.", model,
            buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival at the gateway to the request's end.", model,
            buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.http_requests = ModelLabelled(Counter(
            "pagoda:http_requests", "HTTP requests answered, by route and status.", [*model, "route", "status"],
            registry=r), model_name)
        self.request_success = ModelLabelled(Counter(
            "pagoda:request_success", "Generations finished, by finish reason.", [*model, "finished_reason"],
            registry=r), model_name)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens submitted.", model,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", model,
                                         registry=r).labels(model_name)
        self.schedulers = SchedulerCollector(model_name)
        r.register(self.schedulers)

    def render(self, statuses: list[SchedulerStatus]) -> bytes:
        self.schedulers.statuses = statuses  # no await between this and generate_latest
        return generate_latest(self.registry)
