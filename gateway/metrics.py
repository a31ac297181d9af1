"""Prometheus metrics with vLLM's names, types and buckets under `pagoda:` (a dashboard built for
vLLM works after renaming the prefix): this gateway's latencies and counts, plus the gauges, counters
and histograms of every live scheduler, read from their status keys.

Every series carries `model_name` (the served model name, as vLLM's do). A scheduler's series also
carry `engine` (its --engine-id): one sample per engine group, so a dashboard sums over `engine` for
the whole deployment. Schedulers that share an engine id are summed into its one sample.

    the gateway, per output          time_to_first_token_seconds, inter_token_latency_seconds,
                                     time_per_output_token_seconds (vLLM's older name for the gaps
                                     between tokens: the same observations), request_time_per_output_token_seconds,
                                     e2e_request_latency_seconds, request_queue_time_seconds,
                                     request_prefill_time_seconds, request_decode_time_seconds,
                                     request_prompt_tokens, request_generation_tokens (histograms);
                                     request_success_total{finished_reason}, prompt_tokens_total,
                                     generation_tokens_total, http_requests_total{route,status};
                                     Pagoda's own requests_rejected_total{reason} (429s by the bound met),
                                     routing_decisions_total{engine,reason} (gateway/router.py)
    the schedulers, per engine       num_requests_running/waiting/swapped, kv_cache_usage_perc,
                                     cpu_cache_usage_perc, num_preemptions_total,
                                     prefix_cache_queries_total, prefix_cache_hits_total,
                                     iteration_tokens_total (histogram of tokens per step); Pagoda's own:
                                     num_shared_blocks, num_blocks_saved_by_sharing,
                                     num_cow_copies_total, num_swapped_out_blocks_total,
                                     num_swapped_in_blocks_total, prefix_cache_evictions_total,
                                     cpu_prefix_cache_hits_total, cpu_prefix_cache_blocks,
                                     cpu_prefix_cache_stores_total (--cpu-prefix-cache),
                                     requests_routed_total, requests_shared_total,
                                     requests_stolen_total (the streams a group read requests from);
                                     cache_config_info{block_size,cache_dtype,kv_bytes_per_block,
                                     num_gpu_blocks,num_cpu_blocks} (vLLM's info gauge, value 1);
                                     with --enable-lora: lora_requests_info{running_lora_adapters,
                                     waiting_lora_adapters,max_lora} (vLLM's), lora_loads_total,
                                     lora_evictions_total; with --speculative-config (vLLM's):
                                     spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
                                     spec_decode_num_accepted_tokens_total,
                                     spec_decode_num_accepted_tokens_per_pos_total{position}

One output's phases, as vLLM times a request (the gateway's clock; the scheduler's first-scheduled
time comes on the request's first token-bearing event, RequestEvent.scheduled_at):

    arrival ──queue──▶ first scheduled ──prefill──▶ first token ──decode──▶ last token
    └────────── time to first token ───────────────┘        request TPOT = decode / (tokens - 1)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.protocol import ITERATION_TOKENS_BUCKETS, SchedulerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py): time to first token; the gaps between tokens
# (inter-token latency, time per output token, and per request); a request's latency and its phases
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's `finished_reason` values, all exported from 0
REJECTION_REASONS = ("max_num_queued_requests", "max_num_queued_tokens", "ttft_slo_ms")  # the flag a 429 met


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def scheduled_monotonic(scheduled_at: float, wall_now: float, monotonic_now: float) -> float | None:
    """A RequestEvent's `scheduled_at` (the scheduler's time.time(); 0.0: not on this event) on the
    gateway's time.monotonic(), both clocks read now; a time ahead of the gateway's wall clock is now."""
    if not scheduled_at:
        return None
    return monotonic_now - max(0.0, wall_now - scheduled_at)


def _usage(usage: str, blocks: str) -> Callable[[list[SchedulerStatus]], float]:
    """One engine group's used fraction of a pool: its schedulers' usage weighted by their pool sizes."""
    def value(statuses: list[SchedulerStatus]) -> float:
        total_blocks = sum(getattr(x, blocks) for x in statuses)
        used = sum(getattr(x, usage) * getattr(x, blocks) for x in statuses)
        return used / total_blocks if total_blocks else 0.0
    return value


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
    (GaugeMetricFamily, "pagoda:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
     _usage("kv_cache_usage", "num_gpu_blocks")),
    (GaugeMetricFamily, "pagoda:cpu_cache_usage_perc", "Fraction of the CPU swap pool's blocks in use (1 = full).",
     _usage("cpu_cache_usage", "num_cpu_blocks")),
    (CounterMetricFamily, "pagoda:num_preemptions", "Preemptions since the scheduler started.",
     _summed("num_preemptions_total")),
    (CounterMetricFamily, "pagoda:requests_routed", "Requests read from the engine group's own stream (a "
     "cache-aware router sent them there).", _summed("num_routed_total")),
    (CounterMetricFamily, "pagoda:requests_shared", "Requests read from the shared stream (--routing pull).",
     _summed("num_shared_total")),
    (CounterMetricFamily, "pagoda:requests_stolen", "Requests taken from another engine group's stream, "
     "which left them unread for --steal-after-ms.", _summed("num_stolen_total")),
    (CounterMetricFamily, "pagoda:prefix_cache_queries", "Prefix cache lookups, in tokens.",
     _summed("prefix_cache_queries_total")),
    (CounterMetricFamily, "pagoda:prefix_cache_hits", "Prefix cache hits, in tokens.",
     _summed("prefix_cache_hits_total")),
    (CounterMetricFamily, "pagoda:prefix_cache_evictions", "Prefix-cache blocks evicted to make room, in blocks.",
     _summed("num_prefix_evictions_total")),
    (CounterMetricFamily, "pagoda:cpu_prefix_cache_hits",
     "Prefix cache hits found in its CPU tier (--cpu-prefix-cache), in tokens: part of prefix_cache_hits.",
     _summed("cpu_prefix_cache_hits_total")),
    (GaugeMetricFamily, "pagoda:cpu_prefix_cache_blocks", "Blocks the prefix cache's CPU tier holds.",
     _summed("num_cpu_prefix_cache_blocks")),
    (CounterMetricFamily, "pagoda:cpu_prefix_cache_stores", "Blocks evicted from the device pool into the CPU tier.",
     _summed("num_cpu_prefix_cache_stores_total")),
    (GaugeMetricFamily, "pagoda:num_shared_blocks", "KV cache blocks held by more than one block table.",
     _summed("num_shared_blocks")),
    (GaugeMetricFamily, "pagoda:num_blocks_saved_by_sharing",
     "KV cache blocks that sharing saves: blocks in block tables less the distinct blocks they hold.",
     _summed("num_blocks_saved_by_sharing")),
    (CounterMetricFamily, "pagoda:num_cow_copies", "Copy-on-write block copies.",
     _summed("num_cow_copies_total")),
    (CounterMetricFamily, "pagoda:num_swapped_out_blocks", "Blocks swapped out to the CPU pool.",
     _summed("num_swapped_out_blocks_total")),
    (CounterMetricFamily, "pagoda:num_swapped_in_blocks", "Blocks swapped in from the CPU pool.",
     _summed("num_swapped_in_blocks_total")),
    (CounterMetricFamily, "pagoda:spec_decode_num_drafts", "Speculative verifications that had drafts "
     "(--speculative-config).", _summed("spec_num_drafts_total")),
    (CounterMetricFamily, "pagoda:spec_decode_num_draft_tokens", "Draft tokens proposed.",
     _summed("spec_num_draft_tokens_total")),
    (CounterMetricFamily, "pagoda:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     _summed("spec_num_accepted_tokens_total")),
    (CounterMetricFamily, "pagoda:mm_encoder_cache_queries", "Images a step needed encoded (docs/vision.md).",
     _summed("mm_encoder_cache_queries_total")),
    (CounterMetricFamily, "pagoda:mm_encoder_cache_hits", "Of them, images the encoder cache held.",
     _summed("mm_encoder_cache_hits_total")),
    (CounterMetricFamily, "pagoda:compiled_step_recompiles", "Graphs the compiled CPU decode step "
     "compiled while serving, after its warm-up: each one is a stall (docs/kernels.md).",
     _summed("compiled_step_recompiles_total")),
)


def iteration_tokens(statuses: list[SchedulerStatus]) -> tuple[list[int], int]:
    """One engine group's steps per bucket of ITERATION_TOKENS_BUCKETS and +Inf (cumulative, as
    Prometheus counts them), and their tokens summed."""
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    for status in statuses:
        for i, count in enumerate(status.iteration_tokens[:len(counts)]):  # [] from a scheduler without them
            counts[i] += count
    for i in range(1, len(counts)):
        counts[i] += counts[i - 1]
    return counts, sum(x.iteration_tokens_sum for x in statuses)


class SchedulerCollector(Collector):
    """The schedulers' gauges, counters and tokens-per-step histogram as of the last `render`, one
    sample per engine group."""

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
        info = GaugeMetricFamily("pagoda:cache_config_info", "The KV cache's configuration (value 1).",
                                 labels=["model_name", "engine", "block_size", "cache_dtype", "kv_bytes_per_block",
                                         "num_gpu_blocks", "num_cpu_blocks"])
        for engine, statuses in groups.items():
            s = statuses[0]  # the schedulers of one engine group share its workers' configuration
            info.add_metric([self.model_name, engine, str(s.block_size), s.kv_cache_dtype, str(s.kv_bytes_per_block),
                             str(s.num_gpu_blocks), str(s.num_cpu_blocks)], 1)
        yield info
        yield from self._lora_series({engine: statuses for engine, statuses in groups.items()
                                      if any(s.max_loras for s in statuses)})
        steps = HistogramMetricFamily("pagoda:iteration_tokens_total", "Tokens scheduled per step (prompt and "
                                      "generated).", labels=["model_name", "engine"])
        bounds = [floatToGoString(b) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]  # as Histogram writes `le`
        for engine, statuses in groups.items():
            counts, total = iteration_tokens(statuses)
            steps.add_metric([self.model_name, engine], list(zip(bounds, counts)), total)
        yield steps
        per_pos = CounterMetricFamily("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, per position in the draft.",
                                      labels=["model_name", "engine", "position"])
        for engine, statuses in groups.items():
            counts = [sum(x) for x in zip(*(s.spec_accepted_per_pos for s in statuses if s.spec_accepted_per_pos))]
            for position, count in enumerate(counts):
                per_pos.add_metric([self.model_name, engine, str(position)], count)
        yield per_pos


    def _lora_series(self, groups: dict[str, list[SchedulerStatus]]):
        """For the engine groups serving adapters: vLLM's lora_requests_info (the adapters of
        the running and waiting requests, comma-separated in labels; the value is the status's time)
        and the adapters loaded into and evicted from the workers' slots."""
        if not groups:
            return
        info = GaugeMetricFamily("pagoda:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "engine", "running_lora_adapters", "waiting_lora_adapters",
                                         "max_lora"])
        loads = CounterMetricFamily("pagoda:lora_loads", "LoRA adapters loaded into the workers' slots.",
                                    labels=["model_name", "engine"])
        evictions = CounterMetricFamily("pagoda:lora_evictions", "LoRA adapters evicted from the workers' slots.",
                                        labels=["model_name", "engine"])
        for engine, statuses in groups.items():
            running = sorted({name for s in statuses for name in s.running_lora_adapters})
            waiting = sorted({name for s in statuses for name in s.waiting_lora_adapters})
            info.add_metric([self.model_name, engine, ",".join(running), ",".join(waiting),
                             str(max(s.max_loras for s in statuses))], max(s.updated_at for s in statuses))
            loads.add_metric([self.model_name, engine], sum(s.num_lora_loads_total for s in statuses))
            evictions.add_metric([self.model_name, engine], sum(s.num_lora_evictions_total for s in statuses))
        yield from (info, loads, evictions)


@dataclass(slots=True)
class ModelLabelled:
    """A labelled metric whose first label, model_name, is given once: `.labels(route, status)`."""

    metric: MetricWrapperBase
    model_name: str

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)


@dataclass(slots=True)
class FinishedOutput:
    """One output as it ended: its times (time.monotonic() at the gateway; None: never happened) and sizes."""

    finish_reason: str
    arrival: float
    finished: float
    scheduled: float | None
    first_token: float | None
    last_token: float | None
    num_prompt_tokens: int
    num_generation_tokens: int


class GatewayMetrics:
    """One per app, in a private registry (several apps in one process do not collide).

    The token-count histograms' buckets run up to the model's context length, as vLLM's: they are
    made once it is known (`max_model_len` here, or the first statuses seen by `size_token_buckets`).
    """

    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, model = self.registry, ["model_name"]
        self.time_to_first_token = Histogram(
            "pagoda:time_to_first_token_seconds", "Arrival at the gateway to the first token back.", model,
            buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "pagoda:inter_token_latency_seconds", "Time between tokens of a request, as seen by the gateway.", model,
            buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival at the gateway to the request's end.", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.http_requests = ModelLabelled(Counter(
            "pagoda:http_requests", "HTTP requests answered, by route and status.", [*model, "route", "status"],
            registry=r), model_name)
        self.time_per_output_token = Histogram(
            "pagoda:time_per_output_token_seconds", "Time between tokens of a request (vLLM's older name of the "
            "inter-token latency: the same observations, vLLM's buckets).", model,
            buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.request_time_per_output_token = Histogram(
            "pagoda:request_time_per_output_token_seconds", "Per output: decode time / (generated tokens - 1).",
            model, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.request_queue_time = Histogram(
            "pagoda:request_queue_time_seconds", "Per output: arrival at the gateway to first scheduled.", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_prefill_time = Histogram(
            "pagoda:request_prefill_time_seconds", "Per output: first scheduled to its first token.", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_decode_time = Histogram(
            "pagoda:request_decode_time_seconds", "Per output: its first token to its last.", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        if max_model_len is not None:
            self._token_histograms(max_model_len)
        self.request_success = ModelLabelled(Counter(
            "pagoda:request_success", "Generations finished, by finish reason.", [*model, "finished_reason"],
            registry=r), model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.requests_rejected = ModelLabelled(Counter(
            "pagoda:requests_rejected", "Requests answered 429 before anything was queued, by the bound they "
            "met.", [*model, "reason"], registry=r), model_name)
        for reason in REJECTION_REASONS:
            self.requests_rejected.labels(reason)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens submitted.", model,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", model,
                                         registry=r).labels(model_name)
        self.routing_decisions = ModelLabelled(Counter(
            "pagoda:routing_decisions", "This gateway's routing of requests to engine groups: to the group "
            "holding the longest cached prefix (cache_hit), a new prefix to the group holding the fewest blocks "
            "(smallest_cache), past the balance margin to the least loaded (least_loaded), or to the shared "
            "stream (pull, engine \"\").", [*model, "engine", "reason"], registry=r), model_name)
        self.schedulers = SchedulerCollector(model_name)
        r.register(self.schedulers)

    def _token_histograms(self, max_model_len: int) -> None:
        buckets, r = build_1_2_5_buckets(max_model_len), self.registry
        self.request_prompt_tokens = Histogram(
            "pagoda:request_prompt_tokens", "Per output: its prompt's tokens.", ["model_name"], buckets=buckets,
            registry=r).labels(self.model_name)
        self.request_generation_tokens = Histogram(
            "pagoda:request_generation_tokens", "Per output: its generated tokens.", ["model_name"],
            buckets=buckets, registry=r).labels(self.model_name)

    def size_token_buckets(self, statuses: list[SchedulerStatus]) -> None:
        """Make the token-count histograms from the schedulers' context length, unless made already."""
        # a scheduler whose workers are not ready yet says max_model_len 0: wait for a real one
        max_model_len = max((x.max_model_len for x in statuses), default=0)
        if self.request_prompt_tokens is None and max_model_len >= 1:
            self._token_histograms(max_model_len)

    def observe_tokens(self, gap: float, num_tokens: int) -> None:
        """`num_tokens` tokens came `gap` seconds apart (one event's tokens share its wait)."""
        for _ in range(num_tokens):
            self.inter_token_latency.observe(gap)
            self.time_per_output_token.observe(gap)

    def observe_finished(self, out: FinishedOutput) -> None:
        """vLLM's per-request observations; the phases only for an output that got a token, the queue
        and prefill times only when the scheduler said when it was scheduled."""
        self.e2e_request_latency.observe(out.finished - out.arrival)
        self.request_success.labels(out.finish_reason).inc()
        self.generation_tokens.inc(out.num_generation_tokens)
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(out.num_prompt_tokens)
            self.request_generation_tokens.observe(out.num_generation_tokens)
        if out.first_token is None or out.last_token is None:
            return
        ttft = out.first_token - out.arrival
        if out.scheduled is not None:
            queue = min(max(out.scheduled - out.arrival, 0.0), ttft)  # two clocks: queue + prefill = ttft
            self.request_queue_time.observe(queue)
            self.request_prefill_time.observe(ttft - queue)
        decode = out.last_token - out.first_token
        self.request_decode_time.observe(decode)
        n = out.num_generation_tokens
        self.request_time_per_output_token.observe(decode / (n - 1) if n > 1 else 0.0)

    def render(self, statuses: list[SchedulerStatus]) -> bytes:
        self.size_token_buckets(statuses)
        self.schedulers.statuses = statuses  # no await between this and generate_latest
        return generate_latest(self.registry)
