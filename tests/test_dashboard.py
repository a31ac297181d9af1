"""[observability] through the real stack: one `pagoda up` (the default model on CPU) for the memory
page's data, the page in headless Chromium, and the vLLM-compatible metrics."""
from __future__ import annotations

import pytest

from tests.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


# ----------------------------------------------------------------------------- the page's data
# (/dashboard/snapshot, /dashboard/events)


# ----------------------------------------------------------------------------- the page in Chromium


# ----------------------------------------------------------------------------- metrics


def _exposition(stack) -> dict[str, dict[tuple, float]]:
    """/metrics parsed by prometheus_client: sample name -> {labels other than model_name: value},
    asserting that every pagoda sample carries the served model's name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(stack.url + "/metrics", timeout=10).text):
        for s in family.samples:
            assert s.labels.get("model_name") == model, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples.setdefault(s.name, {})[labels] = s.value
    return samples


PER_OUTPUT = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_time_per_output_token_seconds",
              "request_prompt_tokens", "request_generation_tokens")
PER_ENGINE = ("cpu_cache_usage_perc", "num_shared_blocks", "num_blocks_saved_by_sharing", "num_cow_copies_total",
              "num_swapped_out_blocks_total", "num_swapped_in_blocks_total", "prefix_cache_evictions_total",
              "iteration_tokens_total_count", "iteration_tokens_total_sum")


def test_metrics_count_a_request_in_vllms_families_and_its_queue_ends_before_its_first_token(stack):
    import httpx

    before = _exposition(stack)
    body = {"prompt": "The paged KV cache keeps", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(stack.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    after = _exposition(stack)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[f"pagoda:{name}"][labels] - before.get(f"pagoda:{name}", {}).get(labels, 0.0)

    for name in PER_OUTPUT:  # one output: one observation each
        assert delta(f"{name}_count") == 1, name
        assert sum(after[f"pagoda:{name}_bucket"].values()) > 0, name
    assert delta("request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta("request_generation_tokens_sum") == usage["completion_tokens"] == 6
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):  # each token after the first
        assert delta(f"{name}_count") == 5, name
    assert delta("request_success_total", (("finished_reason", "length"),)) == 1
    queue, prefill = delta("request_queue_time_seconds_sum"), delta("request_prefill_time_seconds_sum")
    ttft, decode = delta("time_to_first_token_seconds_sum"), delta("request_decode_time_seconds_sum")
    assert 0 <= queue <= ttft and prefill >= 0 and queue + prefill == pytest.approx(ttft, abs=1e-9)
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 5)
    assert delta("e2e_request_latency_seconds_sum") >= ttft + decode - 1e-9
    for name in PER_ENGINE:  # the schedulers' series: one sample for the one engine group
        assert list(after[f"pagoda:{name}"]) == [(("engine", "0"),)], name
    buckets = after["pagoda:iteration_tokens_total_bucket"]
    assert [float(dict(labels)["le"]) for labels in buckets] == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")]
