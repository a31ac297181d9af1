"""gateway/metrics.py's vLLM-compatible families, exactly: their names, bucket boundaries and labels,
their values from given statuses and observations; and the scheduler's first-scheduled time on
the way to the gateway (RequestOutput, then the first token-bearing RequestEvent)."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import EngineConfig, ServingConfig
from common.protocol import ITERATION_TOKENS_BUCKETS, GenerateRequest, SamplingParams, SchedulerStatus
from gateway.metrics import FinishedOutput, GatewayMetrics, build_1_2_5_buckets, scheduled_monotonic
from scheduler.engine import LLMEngine
from scheduler.inbox import Arrival
from scheduler.outbox import SendEvent
from scheduler.request_stream import RequestStream
from scheduler.scheduler import Scheduler
from scheduler.sequence import RequestOutput, SequenceOutput
from tests.fakes import FakeExecutor

MODEL = "m"
# vLLM's boundaries, copied from vllm/v1/metrics/loggers.py (not from gateway/metrics.py)
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def status(scheduler_id: str = "s0", engine: str = "0", **fields) -> SchedulerStatus:
    base = dict(scheduler_id=scheduler_id, model=MODEL, max_model_len=2048, block_size=16, num_gpu_blocks=100,
                max_request_tokens=1600, workers_ready=True, num_running=0, num_waiting=0, num_swapped=0,
                kv_cache_usage=0.0, num_preemptions_total=0, prefix_cache_queries_total=0,
                prefix_cache_hits_total=0, updated_at=0.0, engine=engine)
    return SchedulerStatus(**{**base, **fields})


def families(metrics: GatewayMetrics, statuses: list[SchedulerStatus] = ()) -> dict:
    """The exposition parsed back: family name -> family (names without _total, as the parser gives them)."""
    return {f.name: f for f in text_string_to_metric_families(metrics.render(list(statuses)).decode())}


def samples(family) -> dict[tuple, float]:
    """(sample name, its labels sorted, without model_name) -> value; asserts model_name on each."""
    out = {}
    for s in family.samples:
        if s.name.endswith("_created"):
            continue
        assert s.labels["model_name"] == MODEL, s
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
        out[(s.name, labels)] = s.value
    return out


def bucket_bounds(family) -> list[float]:
    bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
    return bounds


def histogram(family, engine: str | None = None) -> tuple[list[float], float, float]:
    """(cumulative bucket counts, count, sum) of one series."""
    keep = [s for s in family.samples if engine is None or s.labels.get("engine") == engine]
    buckets = [s.value for s in keep if s.name.endswith("_bucket")]
    count = next(s.value for s in keep if s.name.endswith("_count"))
    total = next(s.value for s in keep if s.name.endswith("_sum"))
    return buckets, count, total


# ----------------------------------------------------------------------------- the gateway's families


def test_every_gateway_histogram_has_vllms_name_and_bucket_boundaries():
    metrics = GatewayMetrics(MODEL, max_model_len=2048)
    found = families(metrics)
    expected = {
        "pagoda:time_to_first_token_seconds": VLLM_TTFT,
        "pagoda:inter_token_latency_seconds": VLLM_TPOT,
        "pagoda:time_per_output_token_seconds": VLLM_TPOT,
        "pagoda:request_time_per_output_token_seconds": VLLM_TPOT,
        "pagoda:e2e_request_latency_seconds": VLLM_REQUEST_LATENCY,
        "pagoda:request_queue_time_seconds": VLLM_REQUEST_LATENCY,
        "pagoda:request_prefill_time_seconds": VLLM_REQUEST_LATENCY,
        "pagoda:request_decode_time_seconds": VLLM_REQUEST_LATENCY,
        "pagoda:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
        "pagoda:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    }
    assert {name for name, f in found.items() if f.type == "histogram"} == {*expected, "pagoda:iteration_tokens_total"}
    for name, bounds in expected.items():
        assert found[name].type == "histogram", name
        assert bucket_bounds(found[name]) == [*bounds, float("inf")], name
        assert histogram(found[name]) == ([0.0] * (len(bounds) + 1), 0.0, 0.0), name
        assert {tuple(sorted(s.labels)) for s in found[name].samples if not s.name.endswith("_bucket")} == {
            ("model_name",)}, name


def test_build_1_2_5_buckets_is_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(1) == (1,)
    assert build_1_2_5_buckets(8191) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def test_token_histograms_are_sized_by_the_first_statuses_seen_and_then_kept():
    metrics = GatewayMetrics(MODEL)
    assert "pagoda:request_prompt_tokens" not in families(metrics)  # the context length is not known yet
    # a scheduler whose workers are still loading says 0: /metrics still renders, unsized
    assert "pagoda:request_prompt_tokens" not in families(metrics, [status("a", max_model_len=0, workers_ready=False)])
    found = families(metrics, [status("a", max_model_len=100), status("b", max_model_len=300)])
    assert bucket_bounds(found["pagoda:request_prompt_tokens"]) == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]
    found = families(metrics, [status("a", max_model_len=5000)])
    assert bucket_bounds(found["pagoda:request_generation_tokens"]) == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]


def test_request_success_counts_by_vllms_finished_reasons_each_from_zero():
    metrics = GatewayMetrics(MODEL, max_model_len=64)
    for reason in ("length", "length", "stop", "abort"):
        metrics.observe_finished(FinishedOutput(reason, 0.0, 1.0, None, None, None, 3, 0))
    assert samples(families(metrics)["pagoda:request_success"]) == {
        ("pagoda:request_success_total", (("finished_reason", reason),)): value
        for reason, value in (("stop", 1.0), ("length", 2.0), ("abort", 1.0), ("error", 0.0))}


def test_a_finished_output_is_observed_in_vllms_phases():
    """arrival 10, scheduled 10.25, first token 11, last token 13, finished 13.5, 7 prompt tokens, 5 generated."""
    metrics = GatewayMetrics(MODEL, max_model_len=2048)
    metrics.observe_finished(FinishedOutput("length", 10.0, 13.5, 10.25, 11.0, 13.0, 7, 5))
    found = families(metrics)
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5]  # the first buckets of VLLM_REQUEST_LATENCY

    def first_buckets(name: str, n: int) -> list[float]:
        return histogram(found[name])[0][:n]

    assert histogram(found["pagoda:request_queue_time_seconds"])[1:] == (1.0, 0.25)
    assert first_buckets("pagoda:request_queue_time_seconds", len(latency)) == [1.0] * 7
    assert histogram(found["pagoda:request_prefill_time_seconds"])[1:] == (1.0, 0.75)
    assert first_buckets("pagoda:request_prefill_time_seconds", len(latency)) == [0, 0, 1, 1, 1, 1, 1]  # le 0.8
    assert histogram(found["pagoda:request_decode_time_seconds"])[1:] == (1.0, 2.0)
    assert first_buckets("pagoda:request_decode_time_seconds", len(latency)) == [0, 0, 0, 0, 0, 1, 1]  # le 2.0
    assert histogram(found["pagoda:request_time_per_output_token_seconds"])[1:] == (1.0, 0.5)  # 2 s / (5 - 1)
    assert histogram(found["pagoda:e2e_request_latency_seconds"])[1:] == (1.0, 3.5)
    prompt_buckets, count, total = histogram(found["pagoda:request_prompt_tokens"])
    assert (prompt_buckets[:4], count, total) == ([0, 0, 0, 1], 1.0, 7.0)  # le 1, 2, 5, 10
    generation_buckets, count, total = histogram(found["pagoda:request_generation_tokens"])
    assert (generation_buckets[:3], count, total) == ([0, 0, 1], 1.0, 5.0)
    assert samples(found["pagoda:generation_tokens"]) == {("pagoda:generation_tokens_total", ()): 5.0}


@pytest.mark.parametrize("scheduled, queue, prefill", [
    (9.0, 0.0, 1.0),  # the scheduler's clock behind the gateway's: no negative queue
    (11.5, 1.0, 0.0),  # ahead of it: the queue ends by the first token
    (10.5, 0.5, 0.5),
])
def test_queue_and_prefill_add_up_to_the_time_to_first_token(scheduled, queue, prefill):
    metrics = GatewayMetrics(MODEL, max_model_len=64)
    metrics.observe_finished(FinishedOutput("stop", 10.0, 12.0, scheduled, 11.0, 12.0, 4, 1))
    found = families(metrics)
    assert histogram(found["pagoda:request_queue_time_seconds"])[1:] == (1.0, queue)
    assert histogram(found["pagoda:request_prefill_time_seconds"])[1:] == (1.0, prefill)
    assert histogram(found["pagoda:request_time_per_output_token_seconds"])[1:] == (1.0, 0.0)  # one token


WALL_OFFSET = 1_764_000_000.0  # the gateway's time.time() - time.monotonic(): any offset will do


@pytest.mark.parametrize("scheduled_after, queue, prefill", [
    (0.1, 0.1, 0.2),
    (0.5, 0.3, 0.0),  # the scheduler's clock ahead of the gateway's: scheduled when the token came
    (-0.2, 0.0, 0.3),  # behind it: scheduled on arrival
])
def test_the_events_scheduled_at_gives_the_queue_and_prefill_times(scheduled_after, queue, prefill):
    """Arrival at 50 s on the gateway's monotonic clock; the scheduler says (on its wall clock) that
    it first scheduled the request `scheduled_after` s later, on the first token, which comes at 50.3 s."""
    arrival, first_token, metrics = 50.0, 50.3, GatewayMetrics(MODEL, max_model_len=64)
    scheduled = scheduled_monotonic(WALL_OFFSET + arrival + scheduled_after, WALL_OFFSET + first_token, first_token)
    metrics.observe_finished(FinishedOutput("length", arrival, 50.6, scheduled, first_token, 50.5, 4, 3))
    found = families(metrics)
    count, total = histogram(found["pagoda:request_queue_time_seconds"])[1:]
    assert count == 1 and total == pytest.approx(queue, abs=1e-6)
    count, total = histogram(found["pagoda:request_prefill_time_seconds"])[1:]
    assert count == 1 and total == pytest.approx(prefill, abs=1e-6)


def test_an_event_without_scheduled_at_gives_no_queue_or_prefill_time():
    assert scheduled_monotonic(0.0, WALL_OFFSET + 50.3, 50.3) is None  # 0.0: not the first token-bearing event
    metrics = GatewayMetrics(MODEL, max_model_len=64)
    metrics.observe_finished(FinishedOutput("length", 50.0, 50.6, None, 50.3, 50.5, 4, 3))
    found = families(metrics)
    for name in ("pagoda:request_queue_time_seconds", "pagoda:request_prefill_time_seconds"):
        assert histogram(found[name])[1:] == (0.0, 0.0), name
    assert histogram(found["pagoda:request_decode_time_seconds"])[1:] == (1.0, pytest.approx(0.2))


def test_an_output_without_tokens_or_a_scheduled_time_skips_the_phases_it_lacks():
    metrics = GatewayMetrics(MODEL, max_model_len=64)
    metrics.observe_finished(FinishedOutput("error", 0.0, 1.0, None, None, None, 4, 0))  # failed before a token
    metrics.observe_finished(FinishedOutput("length", 0.0, 3.0, None, 1.0, 3.0, 4, 3))  # an older scheduler
    found = families(metrics)
    assert histogram(found["pagoda:e2e_request_latency_seconds"])[1:] == (2.0, 4.0)
    assert histogram(found["pagoda:request_prompt_tokens"])[1:] == (2.0, 8.0)
    assert histogram(found["pagoda:request_queue_time_seconds"])[1:] == (0.0, 0.0)
    assert histogram(found["pagoda:request_prefill_time_seconds"])[1:] == (0.0, 0.0)
    assert histogram(found["pagoda:request_decode_time_seconds"])[1:] == (1.0, 2.0)
    assert histogram(found["pagoda:request_time_per_output_token_seconds"])[1:] == (1.0, 1.0)


def test_each_token_gap_is_an_inter_token_latency_and_a_time_per_output_token():
    metrics = GatewayMetrics(MODEL)
    metrics.observe_tokens(0.0625, 3)
    found = families(metrics)
    for name in ("pagoda:inter_token_latency_seconds", "pagoda:time_per_output_token_seconds"):
        assert histogram(found[name])[1:] == (3.0, 0.1875), name
        assert histogram(found[name])[0][:5] == [0, 0, 0, 3, 3], name  # le 0.075


# ----------------------------------------------------------------------------- the schedulers' families


def test_scheduler_series_per_engine_sum_its_schedulers_and_weigh_usage_by_pool_size():
    statuses = [
        status("a", "0", num_cpu_blocks=100, cpu_cache_usage=0.5, num_shared_blocks=3, num_blocks_saved_by_sharing=9,
               num_cow_copies_total=4, num_swapped_out_blocks_total=20, num_swapped_in_blocks_total=12,
               num_prefix_evictions_total=7, cpu_prefix_cache_hits_total=64, num_cpu_prefix_cache_blocks=6,
               num_cpu_prefix_cache_stores_total=9),
        status("b", "0", num_cpu_blocks=300, cpu_cache_usage=0.25, num_shared_blocks=1, num_blocks_saved_by_sharing=2,
               num_cow_copies_total=1, num_swapped_out_blocks_total=5, num_swapped_in_blocks_total=5,
               num_prefix_evictions_total=0, cpu_prefix_cache_hits_total=32, num_cpu_prefix_cache_blocks=1,
               num_cpu_prefix_cache_stores_total=1),
        status("c", "1"),  # no swap pool: usage 0, not a division by zero
    ]
    found = families(GatewayMetrics(MODEL), statuses)
    expected = {  # name: (type, exposition sample name, engine 0, engine 1)
        "pagoda:cpu_cache_usage_perc": ("gauge", "", (0.5 * 100 + 0.25 * 300) / 400, 0.0),
        "pagoda:num_shared_blocks": ("gauge", "", 4.0, 0.0),
        "pagoda:num_blocks_saved_by_sharing": ("gauge", "", 11.0, 0.0),
        "pagoda:num_cow_copies": ("counter", "_total", 5.0, 0.0),
        "pagoda:num_swapped_out_blocks": ("counter", "_total", 25.0, 0.0),
        "pagoda:num_swapped_in_blocks": ("counter", "_total", 17.0, 0.0),
        "pagoda:prefix_cache_evictions": ("counter", "_total", 7.0, 0.0),
        "pagoda:cpu_prefix_cache_hits": ("counter", "_total", 96.0, 0.0),
        "pagoda:cpu_prefix_cache_blocks": ("gauge", "", 7.0, 0.0),
        "pagoda:cpu_prefix_cache_stores": ("counter", "_total", 10.0, 0.0),
    }
    for name, (kind, suffix, engine_0, engine_1) in expected.items():
        assert found[name].type == kind, name
        assert samples(found[name]) == {(name + suffix, (("engine", "0"),)): engine_0,
                                        (name + suffix, (("engine", "1"),)): engine_1}, name


def test_iteration_tokens_is_one_histogram_per_engine_with_vllms_buckets():
    per_bucket = [3, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # the last: more than 16384 tokens
    statuses = [
        status("a", "0", iteration_tokens=per_bucket, iteration_tokens_sum=3 + 5 + 2 * 60 + 20000),
        status("b", "0", iteration_tokens=[0, 2] + [0] * 12, iteration_tokens_sum=14),
        status("c", "1"),  # a scheduler that predates the field: no steps
        status("d", "2", iteration_tokens=[1] + [0] * 13, iteration_tokens_sum=1),
    ]
    assert list(ITERATION_TOKENS_BUCKETS) == VLLM_ITERATION_TOKENS
    family = families(GatewayMetrics(MODEL), statuses)["pagoda:iteration_tokens_total"]
    assert family.type == "histogram"
    assert bucket_bounds(family)[:14] == [*VLLM_ITERATION_TOKENS, float("inf")]
    assert histogram(family, "0") == ([3, 6, 6, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8, 9], 9.0, 20142.0)
    assert histogram(family, "1") == ([0] * 14, 0.0, 0.0)
    assert histogram(family, "2") == ([1] * 14, 1.0, 1.0)
    assert {s.labels["engine"] for s in family.samples} == {"0", "1", "2"}


# ----------------------------------------------------------------------------- the first-scheduled time


def test_a_request_output_carries_its_groups_first_scheduled_time():
    config = EngineConfig(block_size=16, enable_prefix_caching=False, async_scheduling=False)
    engine = LLMEngine(Scheduler(config, 64, 256, [2]), FakeExecutor(16))
    before = time.time()
    engine.add_request("r", list(range(100, 120)), SamplingParams(temperature=0.0, max_tokens=3))
    first = engine.step()
    scheduled = engine.scheduler.groups["r"].first_scheduled_time
    assert before <= scheduled <= time.time()
    later = [out for _ in range(2) for out in engine.step()]
    assert [out.first_scheduled_time for out in first + later] == [scheduled] * 3 and later[-1].finished


def test_only_the_first_token_bearing_event_carries_scheduled_at():
    stream = RequestStream(ServingConfig(), "s")
    stream.flush = lambda: None  # no Redis: the events stay in the outbox
    stream.track(Arrival(b"1-0", GenerateRequest("r", [1, 2], SamplingParams(n=2), "replies", 0.0)))

    def output(new: list[int], reason: str | None = None) -> RequestOutput:
        seqs = [SequenceOutput(i, [5] * n, n, 0.0, None, reason) for i, n in enumerate(new)]
        return RequestOutput("r", [1, 2], seqs, reason is not None, 123.5)

    for out in (output([0, 0]), output([1, 1]), output([1, 1], "length")):
        stream.emit([out])
    events = [entry.event for entry in stream.outbox.entries if isinstance(entry, SendEvent)]
    assert [(e.index, e.seq, e.scheduled_at) for e in events] == [
        (0, 1, 123.5), (1, 2, 0.0), (0, 3, 0.0), (1, 4, 0.0)]
