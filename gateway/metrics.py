"""Prometheus metrics with vLLM's names under `pagoda:`: this gateway's latencies and counts, plus
the gauges of every live scheduler, read from their status keys and summed."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.protocol import SchedulerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


class SchedulerCollector(Collector):
    """The schedulers' gauges and counters as of the last `render` (summed over live schedulers)."""

    def __init__(self) -> None:
        self.statuses: list[SchedulerStatus] = []

    def collect(self):
        s = self.statuses
        yield GaugeMetricFamily("pagoda:num_schedulers", "Live schedulers (status key present).", value=len(s))
        yield GaugeMetricFamily("pagoda:num_requests_running", "Requests in the running batch.",
                                value=sum(x.num_running for x in s))
        yield GaugeMetricFamily("pagoda:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=sum(x.num_waiting for x in s))
        yield GaugeMetricFamily("pagoda:num_requests_swapped", "Requests swapped out to the CPU pool.",
                                value=sum(x.num_swapped for x in s))
        total_blocks = sum(x.num_gpu_blocks for x in s)
        used = sum(x.kv_cache_usage * x.num_gpu_blocks for x in s)
        yield GaugeMetricFamily("pagoda:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                                value=used / total_blocks if total_blocks else 0.0)
        yield CounterMetricFamily("pagoda:num_preemptions", "Preemptions since the schedulers started.",
                                  value=sum(x.num_preemptions_total for x in s))
        yield CounterMetricFamily("pagoda:prefix_cache_queries", "Prefix cache lookups, in tokens.",
                                  value=sum(x.prefix_cache_queries_total for x in s))
        yield CounterMetricFamily("pagoda:prefix_cache_hits", "Prefix cache hits, in tokens.",
                                  value=sum(x.prefix_cache_hits_total for x in s))


class GatewayMetrics:
    """One per app, in a private registry (several apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "pagoda:time_to_first_token_seconds", "Arrival at the gateway to the first token back.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "pagoda:inter_token_latency_seconds", "Time between tokens of a request, as seen by the gateway.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival at the gateway to the request's end.",
            buckets=E2E_BUCKETS, registry=r)
        self.http_requests = Counter(
            "pagoda:http_requests", "HTTP requests answered, by route and status.", ["route", "status"], registry=r)
        self.request_success = Counter(
            "pagoda:request_success", "Generations finished, by finish reason.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens submitted.", registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", registry=r)
        self.schedulers = SchedulerCollector()
        r.register(self.schedulers)

    def render(self, statuses: list[SchedulerStatus]) -> bytes:
        self.schedulers.statuses = statuses  # no await between this and generate_latest
        return generate_latest(self.registry)
