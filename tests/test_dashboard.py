"""The memory dashboard through the real stack: one `pagoda up` (the default model on CPU) for the memory
page's data, the page in headless Chromium, and the vLLM-compatible metrics."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(default_stack):
    """The `pagoda up` of the default model (--num-gpu-blocks 2048 --num-cpu-blocks 256) that
    the modules of tests/conftest.py's DEFAULT_STACK_MODULES share."""
    return default_stack


# ----------------------------------------------------------------------------- the page's data
# (/dashboard/snapshot, /dashboard/events)


import json  # noqa: E402 (this section's imports, here: the sections merge apart)
import threading  # noqa: E402
import time  # noqa: E402

from common.memory_snapshot import check_snapshot  # noqa: E402
from tests.prompts import LONG_TEXT  # noqa: E402

try:  # as tests/test_gateway.py
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


def _samples(snapshot: dict) -> list[dict]:
    """The snapshot's sequences of a completion request (every test here sends its own)."""
    return [s for s in snapshot["sequences"] if s["request_id"].startswith("cmpl-")]


def _poll_snapshot(url: str, polled: list[dict], done: threading.Event) -> None:
    """/dashboard/snapshot into `polled` until one shows 4 samples or the request is `done`."""
    with httpx.Client(base_url=url, timeout=30) as http:
        while not done.is_set():
            (snapshot,) = http.get("/dashboard/snapshot").json()["engines"]
            polled.append(snapshot)
            if len(_samples(snapshot)) == 4:
                return
            time.sleep(0.05)


def test_the_snapshot_shows_the_samples_of_n4_sharing_the_prompts_blocks_and_the_events_stream(stack):
    """A request of 4 samples over a long prompt, seen through /dashboard/snapshot and /dashboard/events
    while it runs, then no block held once it ended (tests/test_memory_view.py checks every step offline)."""
    body = {"prompt": LONG_TEXT, "n": 4, "max_tokens": 48, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    answer, polled, streamed, done = {}, [], [], threading.Event()

    def complete() -> None:
        try:
            answer.update(httpx.post(stack.url + "/v1/completions", json=body, timeout=120).json())
        finally:
            done.set()

    with httpx.Client(base_url=stack.url, timeout=httpx.Timeout(30.0, read=20.0)) as http:
        with http.stream("GET", "/dashboard/events") as events:  # opened first: it sees the request start
            assert events.status_code == 200
            lines = events.iter_lines()
            # the scheduler publishes once a page watches (its next status, within 0.5 s)
            streamed.append(json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):]))
            threads = [threading.Thread(target=complete), threading.Thread(
                target=_poll_snapshot, args=(stack.url, polled, done))]
            for thread in threads:
                thread.start()
            for line in lines:  # until the 4 samples have come and gone
                if line.startswith("data: "):
                    streamed.append(json.loads(line[len("data: "):]))
                    if not streamed[-1]["sequences"] and any(len(_samples(s)) == 4 for s in streamed):
                        break
    for thread in threads:
        thread.join(120)
    assert len(answer["choices"]) == 4 and answer["usage"]["completion_tokens"] == 4 * 48
    assert all(check_snapshot(s) == [] for s in polled + streamed) and {s["engine"] for s in streamed} == {"0"}
    assert polled and len(_samples(polled[-1])) == 4, "the request ended before a snapshot showed its 4 samples"
    seen = polled[-1]
    full_prompt_blocks = answer["usage"]["prompt_tokens"] // seen["block_size"]
    assert full_prompt_blocks >= 16  # LONG_TEXT: about 350 tokens
    for snapshot in (seen, *[s for s in streamed if len(_samples(s)) == 4]):
        tables = [s["block_table"] for s in _samples(snapshot)]
        prompt = tables[0][:full_prompt_blocks]
        assert all(table[:full_prompt_blocks] == prompt for table in tables)
        assert [snapshot["ref_counts"][block] for block in prompt] == [4] * full_prompt_blocks
        assert snapshot["stats"]["blocks_saved_by_sharing"] >= 3 * full_prompt_blocks
    assert sum(len(_samples(s)) == 4 for s in streamed) >= 1
    versions = [s["version"] for s in streamed]
    assert len(versions) >= 3 and all(a != b for a, b in zip(versions, versions[1:]))
    assert streamed[-1]["sequences"] == [] and set(streamed[-1]["ref_counts"]) == {0}  # no block held
    (after,) = httpx.get(stack.url + "/dashboard/snapshot").json()["engines"]
    assert after["sequences"] == [] and set(after["ref_counts"]) == {0}


# ----------------------------------------------------------------------------- the page in Chromium
# A request with n=4 over a long prompt, watched from the page itself (tests/chromium.py drives headless
# Chromium over the DevTools protocol; skipped, visibly, without chromium). With
# PAGODA_DASHBOARD_SCREENSHOT=docs/dashboard.png the test also runs three plain requests beside it
# and saves the page as the README shows it.
PAGE_PROMPT_LEN = 600  # 37 full blocks of 16 and 8 tokens: the samples share 37 blocks once each wrote its own
PAGE_MAX_TOKENS = 48
PAGE_STATE = """(() => {
    const rows = (pagoda.tables('0') || []).filter((r) => r.request_id === %s);
    if (rows.length !== 4 || rows.some((r) => r.status !== 'running' || r.num_tokens < %d)) return null;
    return {rows: rows, counts: pagoda.blocks('0'), events: pagoda.events('0')};
})()"""
HOVER_AT = """(() => {
    const canvas = document.querySelector('[data-engine="0"] .map-gpu'), r = canvas.getBoundingClientRect();
    const d = pagoda.panel('0').drawn.gpu, b = %d, scale = r.width / canvas.width;
    return [r.left + ((b %% d.cols) + 0.5) * d.cell * scale, r.top + (Math.floor(b / d.cols) + 0.5) * d.cell * scale];
})()"""


def _stream_completion(stack, prompt, n: int, ids: list, errors: list, started) -> None:
    import openai

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, n=n, max_tokens=PAGE_MAX_TOKENS,
                                           temperature=1.0, seed=7, stream=True, extra_body={"min_tokens": PAGE_MAX_TOKENS})
        for chunk in stream:
            if not ids:
                ids.append(chunk.id)
                started.set()
    except Exception as exc:  # raised in the test
        errors.append(exc)
        started.set()


def test_the_page_in_chromium_shows_the_samples_of_a_request_sharing_its_prompt_blocks(stack):
    import json
    import os
    import threading

    from tests.chromium import Chromium

    screenshot = os.environ.get("PAGODA_DASHBOARD_SCREENSHOT")
    with Chromium() as browser:
        browser.navigate(stack.url + "/dashboard")
        browser.wait_for("window.pagoda && pagoda.renders > 0 && pagoda.source === 'events'", 30,
                         "the page to show an engine's snapshot from /dashboard/events")
        prompt = [1000 + (7 * i) % 3000 for i in range(PAGE_PROMPT_LEN)]
        ids, errors, started = [], [], threading.Event()
        threads = [threading.Thread(target=_stream_completion, args=(stack, prompt, 4, ids, errors, started))]
        if screenshot:  # company for the picture
            threads += [threading.Thread(target=_stream_completion, args=(stack, [2000 + i] * (150 + 90 * i), 1, [], errors,
                                                                          threading.Event())) for i in range(3)]
        for thread in threads:
            thread.start()
        assert started.wait(120) and not errors, errors
        request_id = ids[0] + "-0"  # the gateway's one request per prompt
        state = browser.wait_for(PAGE_STATE % (json.dumps(request_id), PAGE_PROMPT_LEN + 2), 60,
                                 "the page to list the 4 samples decoding")
        rows, counts = state["rows"], state["counts"]
        full = PAGE_PROMPT_LEN // 16
        prompt_blocks = rows[0]["block_table"][:full]
        assert all(row["block_table"][:full] == prompt_blocks for row in rows)
        assert [counts[b] for b in prompt_blocks] == [4] * full
        own = [b for row in rows for b in row["block_table"][full:]]  # each sample's blocks past the shared ones
        assert len(set(own)) == len(own) and [counts[b] for b in own] == [1] * len(own)
        if not screenshot:  # no other request runs: the prompt's blocks are the only ones shared
            assert sorted(b for b, count in enumerate(counts) if count > 1) == sorted(prompt_blocks)
        forks = [e for e in state["events"] if e["request_id"] == request_id and e["kind"] == "fork"]
        assert sorted(e["seq_id"] for e in forks) == sorted(row["seq_id"] for row in rows)[1:]
        # the count on hover, over the real canvas
        browser.mouse_move(*browser.evaluate(HOVER_AT % prompt_blocks[0]))
        hover = browser.wait_for("!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent",
                                 5, "the tooltip")
        assert hover.splitlines()[:2] == [f"GPU block {prompt_blocks[0]}", "reference count 4 (shared)"]
        assert hover.splitlines()[2] == f"{request_id}: " + ", ".join(f"seq {row['seq_id']} [0]" for row in rows)
        if screenshot:
            browser.wait_for(PAGE_STATE % (json.dumps(request_id), PAGE_PROMPT_LEN + 20), 60, "the samples' own blocks")
            browser.evaluate(f"pagoda.select({json.dumps(request_id)})")
            browser.wait_for(f"document.body.dataset.selected === {json.dumps(request_id)}", 5)
            browser.mouse_move(*browser.evaluate(HOVER_AT % prompt_blocks[5]))  # the tooltip in the picture
            size = browser.screenshot(screenshot)
            assert size < 300_000, f"{screenshot} is {size} bytes"
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        browser.wait_for(f"!pagoda.tables('0').some((r) => r.request_id === {json.dumps(request_id)})", 30,
                         "the finished request's tables to leave the page")
        assert browser.errors() == []


def test_the_page_passes_the_api_key_on_and_polls_where_server_sent_events_do_not_work(stack):
    """One more gateway with --api-key on the stack's Redis: the page needs the key and hands it to its
    files and data; without EventSource it polls /dashboard/snapshot."""
    import json

    from tests.chromium import Chromium
    from tests.stack import Gateway

    key = "sk-memory-page"
    with Chromium() as browser:  # first: it skips without chromium
        gateway = Gateway(stack.redis_url, "--api-key", key).wait_ready()
        try:
            browser.navigate(gateway.url + "/dashboard")
            assert json.loads(browser.evaluate("document.body.innerText"))["error"]["code"] == "invalid_api_key"
            # engine 0's panel may come a render after the source is chosen: no panel yet reads as not drawn
            drawn = ("window.pagoda && pagoda.source === '%s' && (() => { try { const b = pagoda.blocks('0');"
                     " return b !== null && b.length; } catch (e) { return false; } })()")
            browser.navigate(gateway.url + f"/dashboard?api_key={key}")
            assert browser.wait_for(drawn % "events", 30, "the page to draw engine 0 from its events") == 2048
            assert browser.evaluate("location.href") == gateway.url + "/dashboard"  # the key left the address bar
            assert browser.errors() == []
            browser.send("Page.addScriptToEvaluateOnNewDocument", source="window.EventSource = undefined;")
            browser.navigate(gateway.url + f"/dashboard?api_key={key}")
            assert browser.wait_for(drawn % "polling", 30, "the page to draw engine 0 from /dashboard/snapshot") == 2048
            assert browser.errors() == []
        finally:
            gateway.stop()


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
    assert queue + prefill == pytest.approx(ttft, abs=1e-9)
    # each phase takes time: the queue the hops to the scheduler (not the exact 0 an unset scheduled_at
    # clamps to), the prefill a forward pass, as each later token does (here ~1.5 times their mean gap;
    # a scheduled_at taken at the first token would make it microseconds)
    assert 0 < queue < ttft and prefill > 0.25 * decode / 5
    assert delta("request_time_per_output_token_seconds_sum") == pytest.approx(decode / 5)
    assert delta("e2e_request_latency_seconds_sum") >= ttft + decode - 1e-9
    for name in PER_ENGINE:  # the schedulers' series: one sample for the one engine group
        assert list(after[f"pagoda:{name}"]) == [(("engine", "0"),)], name
    buckets = after["pagoda:iteration_tokens_total_bucket"]
    assert [float(dict(labels)["le"]) for labels in buckets] == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf")]
