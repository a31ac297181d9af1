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
            threads = [threading.Thread(target=complete), threading.Thread(
                target=_poll_snapshot, args=(stack.url, polled, done))]
            for thread in threads:
                thread.start()
            for line in events.iter_lines():  # until the 4 samples have come and gone
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


# ----------------------------------------------------------------------------- metrics
