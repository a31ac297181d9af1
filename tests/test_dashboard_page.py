"""The memory page without the real stack: its routes (GET /dashboard, /dashboard/static/<file>) on
the gateway app, and `pagoda bench memory --replay`'s standalone page, made from a trace of a real
Scheduler (no model) and checked in headless Chromium (skipped visibly without chromium).
The live page against `pagoda up` is tested in tests/test_dashboard.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from common.config import EngineConfig, GatewayConfig
from common.memory_snapshot import check_snapshot, snapshot_json
from common.protocol import SamplingParams
from gateway.app import create_app
from gateway.tokenizer import load_tokenizer
from pagoda import cli
from pagoda.bench.replay import read_trace, replay_page
from scheduler.engine import LLMEngine
from scheduler.memory_view import build_snapshot, memory_version
from scheduler.scheduler import Scheduler
from tests.chromium import Chromium
from tests.fakes import FakeExecutor

STATIC = Path(__file__).resolve().parent.parent / "gateway" / "static"
API_KEY = "sk-page&key=\"1\""  # a key that must be escaped in a URL and in HTML


# ----------------------------------------------------------------------------- the routes


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def client(tokenizer, api_key: str | None) -> TestClient:
    """The app without its lifespan: these routes need no Redis."""
    return TestClient(create_app(GatewayConfig(api_key=api_key), tokenizer=tokenizer))


def test_the_page_and_its_files_are_served_with_the_api_key_passed_on(tokenizer):
    http = client(tokenizer, API_KEY)
    response = http.get("/dashboard", params={"api_key": API_KEY})
    assert response.status_code == 200 and response.headers["content-type"] == "text/html; charset=utf-8"
    query = "?api_key=sk-page%26key%3D%221%22"
    assert f'href="/dashboard/static/dashboard.css{query}"' in response.text
    assert f'src="/dashboard/static/dashboard.js{query}"' in response.text
    assert "__QUERY__" not in response.text
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = http.get(f"/dashboard/static/{name}" + query)
        assert response.status_code == 200 and response.headers["content-type"] == f"{kind}; charset=utf-8"
        assert response.text == (STATIC / name).read_text()
    response = http.get("/dashboard/static/dashboard.js", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/static/dashboard.js"])
def test_the_page_needs_the_api_key_when_the_gateway_has_one(tokenizer, path):
    http = client(tokenizer, API_KEY)
    missing = http.get(path)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key" and missing.json()["error"]["type"] == "invalid_request_error"
    wrong = http.get(path, params={"api_key": "sk-wrong"})
    assert wrong.status_code == 401
    assert wrong.json()["error"] == {"message": "incorrect API key provided", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_api_key"}


def test_without_a_key_the_page_links_its_files_plainly_and_serves_no_other_file(tokenizer):
    http = client(tokenizer, None)
    page = http.get("/dashboard")
    assert page.status_code == 200
    assert page.text == (STATIC / "dashboard.html").read_text().replace("__QUERY__", "")
    for name in ("dashboard.html", "nothing.js", "..%2Fapp.py"):
        response = http.get(f"/dashboard/static/{name}")
        assert response.status_code == 404, name
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert http.get("/dashboard/static/dashboard.css").text == (STATIC / "dashboard.css").read_text()


def test_the_page_loads_nothing_from_elsewhere():
    """No CDN, no web font: the page works offline."""
    for name in ("dashboard.html", "dashboard.css", "dashboard.js"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://", text), name
        assert "@import" not in text and "prompt" not in text.lower().replace("prompt_", ""), name


# ----------------------------------------------------------------------------- a trace of a real Scheduler

PROMPT_LEN = 100  # 6 full blocks of 16 and 4 tokens: the n=4 samples share 6 blocks once they decode


def make_trace(path: Path) -> list[dict]:
    """JSON Lines of snapshots, as `pagoda generate --memory-trace` writes them, from a real Scheduler
    with a fake executor: a request with n=4, one with beam search and five plain ones in a pool
    small enough that one group is swapped out and back in."""
    config = EngineConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=512, preemption_mode="swap")
    scheduler = Scheduler(config, 64, 512, [2], num_cpu_blocks=32)
    engine = LLMEngine(scheduler, FakeExecutor(16, forks=True))
    engine.add_request("cmpl-n4", list(range(10, 10 + PROMPT_LEN)), SamplingParams(n=4, max_tokens=40, seed=1))
    engine.add_request("cmpl-beam", list(range(300, 340)), SamplingParams(n=2, beam_width=3, max_tokens=30))
    for i in range(5):
        engine.add_request(f"cmpl-{i}", [400 + i] * (90 + 10 * i),
                           SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
    snapshots, last = [], None
    while engine.has_unfinished_requests():
        engine.step()
        if (version := memory_version(scheduler)) != last:
            last = version
            snapshots.append(snapshot_json(build_snapshot(scheduler, "0", "sched-1")))
    path.write_text("".join(json.dumps(s) + "\n" for s in snapshots))
    assert all(check_snapshot(s) == [] for s in snapshots)
    return snapshots


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("trace") / "memory.jsonl"
    return path, make_trace(path)


def test_replay_writes_one_page_with_every_snapshot_embedded(trace, tmp_path, capsys):
    path, snapshots = trace
    assert cli.main(["bench", "memory", "--replay", str(path), "--output", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    embedded = re.search(r'<script type="application/json" id="pagoda-trace">(.*?)</script>', page, re.S).group(1)
    assert json.loads(embedded) == snapshots
    assert "/dashboard/static/" not in page and "__QUERY__" not in page
    assert (STATIC / "dashboard.js").read_text() in page and (STATIC / "dashboard.css").read_text() in page
    assert f"{len(snapshots)} snapshots of engine(s) 0" in capsys.readouterr().err


def test_replay_writes_next_to_the_trace_by_default_and_names_a_bad_line(trace, tmp_path):
    path, snapshots = trace
    copy = tmp_path / "run.jsonl"
    copy.write_text(path.read_text())
    assert cli.main(["bench", "memory", "--replay", str(copy)]) == 0
    assert (tmp_path / "run.html").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(snapshots[0]) + "\n\n{\"engine\": \"0\"}\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not an engine snapshot \(missing step, block_size"):
        read_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        read_trace(bad)


def test_a_request_id_cannot_end_the_embedding_script():
    snapshot = {"engine": "0", "sequences": [{"request_id": "</script><script>alert(1)</script>"}]}
    page = replay_page([snapshot])
    assert "</script><script>alert" not in page
    embedded = re.search(r'id="pagoda-trace">(.*?)</script>', page, re.S).group(1)
    assert json.loads(embedded) == [snapshot]


# ----------------------------------------------------------------------------- the replay in Chromium


def _fork_snapshot(snapshots: list[dict]) -> int:
    """The first snapshot in which all four samples of cmpl-n4 run and have decoded past the prompt."""
    for i, s in enumerate(snapshots):
        seqs = [q for q in s["sequences"] if q["request_id"] == "cmpl-n4"]
        if len(seqs) == 4 and all(q["num_tokens"] > PROMPT_LEN + 1 for q in seqs):
            return i
    raise AssertionError("the n=4 request never ran its 4 samples")


def test_the_replay_page_in_chromium_draws_each_snapshot_as_it_is(trace, tmp_path):
    path, snapshots = trace
    page = tmp_path / "page.html"
    page.write_text(replay_page(snapshots))
    with Chromium() as browser:
        browser.navigate(page.as_uri())
        browser.wait_for("window.pagoda && pagoda.renders > 0", 20, "the page's first render")
        assert browser.evaluate("pagoda.source") == "replay"
        at = _fork_snapshot(snapshots)
        browser.evaluate(f"pagoda.seek({at})")
        assert browser.evaluate("document.body.dataset.position") == str(at)
        snapshot = snapshots[at]
        # the map draws every block's reference count; the n=4 samples share the prompt's 6 full blocks
        assert browser.evaluate("pagoda.blocks('0')") == snapshot["ref_counts"]
        assert browser.evaluate("pagoda.blocks('0', 'cpu')") == snapshot["cpu_ref_counts"]
        tables = [r for r in browser.evaluate("pagoda.tables('0')") if r["request_id"] == "cmpl-n4"]
        assert len(tables) == 4 and all(r["status"] == "running" for r in tables)
        prompt_blocks = tables[0]["block_table"][:PROMPT_LEN // 16]
        assert all(r["block_table"][:PROMPT_LEN // 16] == prompt_blocks for r in tables)
        assert [snapshot["ref_counts"][b] for b in prompt_blocks] == [4] * 6
        by_seq = {q["seq_id"]: q for q in snapshot["sequences"]}
        for row in tables:
            seq = by_seq[row["seq_id"]]
            assert row["block_table"] == seq["block_table"]
            assert row["last_block_slots"] == seq["num_slots"] - (len(seq["block_table"]) - 1) * 16
        # hovering a shared block tells its count and its holders
        box = browser.evaluate(f"""(() => {{
            const canvas = document.querySelector('[data-engine="0"] .map-gpu'), r = canvas.getBoundingClientRect();
            const d = pagoda.engines['0'].drawn.gpu, b = {prompt_blocks[2]}, scale = r.width / canvas.width;
            return [r.left + ((b % d.cols) + 0.5) * d.cell * scale, r.top + (Math.floor(b / d.cols) + 0.5) * d.cell * scale];
        }})()""")
        browser.mouse_move(*box)
        hover = browser.wait_for("!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent",
                                 5, "the tooltip")
        seq_ids = sorted(r["seq_id"] for r in tables)
        assert hover == (f"GPU block {prompt_blocks[2]}\nreference count 4 (shared)\ncmpl-n4: "
                         + ", ".join(f"seq {s} [2]" for s in seq_ids))
        # selecting the request highlights its blocks and, of them, those its samples share
        browser.evaluate("pagoda.select('cmpl-n4')")
        browser.wait_for("document.body.dataset.selected === 'cmpl-n4'", 5)
        lit = browser.evaluate("pagoda.highlighted('0')")
        assert lit["blocks"] == sorted({b for r in tables for b in r["block_table"]})
        assert lit["shared"] == sorted(prompt_blocks)
        # the map is drawn again only when its snapshot (or the selection) changes
        draws = "Number(document.querySelector('[data-engine=\"0\"] .map-gpu').dataset.draws)"
        before = browser.evaluate(draws)
        browser.evaluate(f"pagoda.seek({at})")
        assert browser.evaluate(f"pagoda.renders > 0 && {draws}") == before
        browser.evaluate(f"pagoda.seek({at + 1})")
        assert browser.evaluate(draws) == before + 1
        # the slider and the step buttons
        browser.evaluate("(() => { const s = document.getElementById('replay-slider'); s.value = '3';"
                         " s.dispatchEvent(new Event('input')); document.getElementById('replay-next').click(); })()")
        assert browser.evaluate("document.body.dataset.position") == "4"
        assert browser.evaluate("pagoda.blocks('0')") == snapshots[4]["ref_counts"]
        # back to the start and forward again: the event log holds each event once
        browser.evaluate("pagoda.seek(0)")
        browser.evaluate(f"pagoda.seek({len(snapshots) - 1})")
        events = browser.evaluate("pagoda.events('0')")
        ids = [e["id"] for e in events]
        assert ids == sorted(set(ids)) and ids == sorted({e["id"] for s in snapshots for e in s["events"]})
        assert [e["kind"] for e in events if e["request_id"] == "cmpl-n4"][:3] == ["fork"] * 3
        assert {"swap_out", "swap_in", "cow"} <= {e["kind"] for e in events}
        assert browser.evaluate("pagoda.blocks('0')") == snapshots[-1]["ref_counts"]
        assert browser.errors() == []
        # a script error is caught into the page, and seen by the test
        browser.evaluate("setTimeout(() => { throw new Error('boom') }, 0)")
        browser.wait_for("document.body.dataset.errors === '1'", 5, "the error in the page")
        assert "boom" in browser.evaluate("document.getElementById('errors').textContent")
        assert [e.split("\n")[0] for e in browser.errors()] == ["exception: Error: boom", "page: Error: boom"]
