"""The memory page without the real stack: its routes (GET /dashboard, /dashboard/static/<file>) on
the gateway app; `pagoda bench memory --replay`'s standalone page, made from a trace of a real
Scheduler (no model), and a synthetic 100,000-block snapshot on it; the live page's panels fed by a
scripted EventSource and fetch: all checked in headless Chromium (skipped visibly without chromium).
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
from common.tokenizer import load_tokenizer
from gateway.app import create_app
from pagoda import cli
from pagoda.bench.replay import read_trace, replay_page
from pagoda.bench.synthetic_trace import synthetic_trace
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
            const d = pagoda.panel('0').drawn.gpu, b = {prompt_blocks[2]}, scale = r.width / canvas.width;
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


# ----------------------------------------------------------------------------- 100,000 blocks


def test_a_pool_of_100000_blocks_is_drawn_one_cell_per_block_in_its_class(tmp_path):
    """A synthetic snapshot (pagoda/bench/synthetic_trace.py, as docs/dashboard.md's timing command uses) on
    the replay page: the canvas's pixels, one per block, counted by colour class."""
    (snapshot,) = synthetic_trace(100_000, 1)
    assert check_snapshot(snapshot) == []
    counts, cached = snapshot["ref_counts"], set(snapshot["cached"])
    owners: dict[int, set[str]] = {}
    for seq in snapshot["sequences"]:
        if seq["pool"] == "gpu":
            for block in seq["block_table"]:
                owners.setdefault(block, set()).add(seq["request_id"])
    expected = {"null": 1, "cached": len(cached),
                "free": sum(1 for b, c in enumerate(counts) if b and not c and b not in cached),
                "several requests": sum(1 for o in owners.values() if len(o) > 1),
                "shared": sum(1 for b, o in owners.items() if len(o) == 1 and counts[b] > 1),
                "owned": sum(1 for b, o in owners.items() if len(o) == 1 and counts[b] == 1)}
    assert sum(expected.values()) == 100_000 and min(expected.values()) > 0
    page = tmp_path / "big.html"
    page.write_text(replay_page([snapshot]))
    with Chromium() as browser:
        browser.navigate(page.as_uri())
        browser.wait_for("window.pagoda && pagoda.renders > 0", 20, "the page's first render")
        browser.evaluate(f"window.__requests = {json.dumps(sorted({s['request_id'] for s in snapshot['sequences']}))}; 0")
        drawn = browser.evaluate("""(() => {
            const rgb = (c) => c.join(",");
            const classes = new Map([["0,0,0", "null"], ["38,43,51", "free"], ["89,97,109", "cached"],
                                     ["205,210,218", "several requests"]]);
            for (const r of window.__requests) {
                classes.set(rgb(pagoda.colour(r, false)), "owned");
                classes.set(rgb(pagoda.colour(r, true)), "shared");
            }
            const canvas = document.querySelector('.map-gpu'), d = pagoda.panel().drawn.gpu;
            const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
            const found = {};
            for (let b = 0; b < d.n; b++) {  // a cell's top-left pixel (a shared cell's mark is in its middle)
                const i = 4 * (Math.floor(b / d.cols) * d.cell * canvas.width + (b % d.cols) * d.cell);
                const name = classes.get(pixels[i] + "," + pixels[i + 1] + "," + pixels[i + 2]) || "unknown";
                found[name] = (found[name] || 0) + 1;
            }
            return {found: found, cell: d.cell, blocks: canvas.dataset.blocks, used: canvas.dataset.used,
                    shared: canvas.dataset.shared};
        })()""")
        assert drawn["found"] == expected
        assert drawn["cell"] == 1  # one pixel per block at this width
        stats = snapshot["stats"]
        assert (drawn["blocks"], drawn["used"], drawn["shared"]) == (
            "100000", str(stats["num_used_blocks"]), str(stats["num_shared_blocks"]))
        assert stats["num_shared_blocks"] == expected["several requests"] + expected["shared"]
        assert browser.errors() == []


# ----------------------------------------------------------------------------- the live page, scripted data
# The gateway's page routes under uvicorn (no Redis: the data routes are not called), its EventSource
# and fetch replaced by scripts the test drives.

KEY = "sk-live&page"
FAKE_EVENT_SOURCE = """
window.__sources = [];
window.EventSource = class {
  constructor(url) { this.url = url; this.listeners = new Map(); this.readyState = 1; window.__sources.push(this); }
  addEventListener(type, f) { if (!this.listeners.has(type)) this.listeners.set(type, []); this.listeners.get(type).push(f); }
  close() { this.readyState = 2; }
  emit(type, data) { for (const f of this.listeners.get(type) || []) f({ data: JSON.stringify(data) }); }
};
window.EventSource.CLOSED = 2;
"""
FAKE_FETCH = """
window.EventSource = undefined;
window.__fetched = [];
window.__reply = { engines: [] };
window.fetch = (url) => { window.__fetched.push(url); return Promise.resolve(new Response(JSON.stringify(window.__reply))); };
"""
PANELS = """Array.from(document.querySelectorAll('section.engine')).map((e) => {
    const title = e.querySelector('h2').cloneNode(true);
    title.querySelectorAll('small').forEach((small) => small.remove());
    return [e.dataset.engine, e.dataset.scheduler, title.textContent.trim(), e.dataset.stale];
})"""


def _snap(engine: str, scheduler_id: str, version: int, time: float, events: list[dict] = (), holder: int = 1) -> dict:
    """A consistent snapshot of 8 device blocks: one sequence holding block `holder` and block 5."""
    counts = [0] * 8
    counts[holder] = counts[5] = 1
    return {"engine": engine, "scheduler_id": scheduler_id, "time": time, "step": version, "version": version,
            "block_size": 16, "num_gpu_blocks": 8, "num_cpu_blocks": 0, "ref_counts": counts, "cpu_ref_counts": [],
            "cached": [], "events": list(events), "stats": {},
            "sequences": [{"request_id": f"cmpl-{scheduler_id}", "seq_id": 0, "status": "running", "num_tokens": 20,
                           "num_slots": 20, "pool": "gpu", "block_table": [holder, 5]}]}


def _event(i: int, blocks: list[int] | None = None, num_blocks: int | None = None) -> dict:
    event = {"id": i, "step": i, "time": 1000.0, "kind": "swap_out", "request_id": "cmpl-x", "seq_id": -1,
             "blocks": blocks if blocks is not None else [i % 7 + 1]}
    if num_blocks is not None:
        event["num_blocks"] = num_blocks
    return event


@pytest.fixture(scope="module")
def gateway_url(tokenizer):
    from common.redis_server import free_port
    from tests.stack import serve_app

    port = free_port()
    with serve_app(create_app(GatewayConfig(api_key=KEY), tokenizer=tokenizer), port, lifespan="off"):
        yield f"http://127.0.0.1:{port}"


def test_the_live_page_keys_panels_by_scheduler_and_drops_those_that_leave(gateway_url):
    with Chromium() as browser:
        script = browser.send("Page.addScriptToEvaluateOnNewDocument", source=FAKE_EVENT_SOURCE)["identifier"]
        browser.navigate(f"{gateway_url}/dashboard?api_key=sk-live%26page&view=1#here")
        # the key left the address bar, and is still given to the data requests (and was to the script)
        assert browser.evaluate("location.href") == f"{gateway_url}/dashboard?view=1#here"
        assert browser.evaluate("__sources.map((s) => s.url)") == ["/dashboard/events?api_key=sk-live%26page"]
        send = lambda kind, data: browser.evaluate(f"__sources[0].emit({json.dumps(kind)}, {json.dumps(data)})")  # noqa: E731
        send("open", None)
        # one engine group, two schedulers: two panels; ids that are Object.prototype's names work
        send("snapshot", _snap("0", "sched-b", 1, 1000.0, [_event(i) for i in range(50, 53)], holder=2))
        send("snapshot", _snap("0", "sched-a", 1, 1000.0, [_event(1), _event(2), _event(3)]))
        send("snapshot", _snap("__proto__", "constructor", 1, 1000.0))
        browser.wait_for("document.querySelectorAll('section.engine').length === 3", 5, "three panels")
        assert browser.evaluate(PANELS) == [
            ["0", "sched-a", "engine 0 · scheduler sched-a", "0"], ["0", "sched-b", "engine 0 · scheduler sched-b", "0"],
            ["__proto__", "constructor", "engine __proto__ · scheduler constructor", "0"]]
        assert browser.evaluate("pagoda.blocks('sched-b')") == [0, 0, 1, 0, 0, 1, 0, 0]
        assert browser.evaluate("pagoda.blocks('sched-a')") == [0, 1, 0, 0, 0, 1, 0, 0]
        assert browser.evaluate("pagoda.tables('constructor')[0].request_id") == "cmpl-constructor"
        assert browser.evaluate("pagoda.panel('__proto__').id") == "constructor"
        assert browser.evaluate("[Object.prototype.constructor === Object, pagoda.panels.size]") == [True, 3]
        # events: a jump in one scheduler's ids is a gap line; the first snapshot's ids are no gap
        send("snapshot", _snap("0", "sched-a", 2, 1001.0, [_event(i) for i in range(8, 11)]
                               + [_event(11, list(range(1, 33)), 40), _event(12, [4, 5, 6])]))
        browser.wait_for("document.querySelector('[data-scheduler=\"sched-a\"]').dataset.version === '2'", 5)
        assert [e["id"] for e in browser.evaluate("pagoda.events('sched-a')")] == [1, 2, 3, 8, 9, 10, 11, 12]
        assert browser.evaluate("pagoda.gaps('sched-a')") == [{"gap": 4, "before": 8}]
        assert browser.evaluate("pagoda.gaps('sched-b')") == []
        rows = browser.evaluate("Array.from(document.querySelectorAll('[data-scheduler=\"sched-a\"] .events li'))"
                                ".map((li) => li.textContent)")
        assert len(rows) == 9 and rows[5] == "4 events not shown"
        assert rows[0].endswith("cmpl-x: [4, 5, 6]") and rows[1].endswith("cmpl-x: [1, 2, 3, 4, 5, 6] +34 more")
        # a snapshot more than 5 s older than the newest greys its panel
        send("snapshot", _snap("__proto__", "constructor", 2, 1006.5))
        browser.wait_for("document.querySelector('[data-scheduler=\"sched-b\"]').dataset.stale === '1'", 5)
        assert [p[3] for p in browser.evaluate(PANELS)] == ["1", "1", "0"]  # 5.5 s and 6.5 s behind
        send("snapshot", _snap("0", "sched-a", 3, 1006.0))
        browser.wait_for("document.querySelector('[data-scheduler=\"sched-a\"]').dataset.stale === '0'", 5)
        # a scheduler that leaves takes its panel along
        send("gone", {"engine": "0", "scheduler_id": "sched-b"})
        browser.wait_for("document.querySelectorAll('section.engine').length === 2", 5, "sched-b's panel to go")
        assert [p[1] for p in browser.evaluate(PANELS)] == ["sched-a", "constructor"]
        # after a reconnect, a panel no snapshot names at once left meanwhile
        send("open", None)
        send("snapshot", _snap("__proto__", "constructor", 2, 1006.5))
        browser.wait_for("document.querySelectorAll('section.engine').length === 1", 6, "sched-a's panel to go")
        assert browser.evaluate("Array.from(pagoda.panels.keys())") == ["constructor"]
        assert browser.errors() == []
        # polling: a scheduler missing from /dashboard/snapshot's reply is gone
        browser.send("Page.removeScriptToEvaluateOnNewDocument", identifier=script)
        browser.send("Page.addScriptToEvaluateOnNewDocument", source=FAKE_FETCH)
        browser.navigate(f"{gateway_url}/dashboard?api_key=sk-live%26page")
        assert browser.evaluate("location.href") == f"{gateway_url}/dashboard"
        browser.evaluate(f"window.__reply = {json.dumps({'engines': [_snap('0', 'p-1', 1, 1.0), _snap('0', 'p-2', 1, 1.0)]})}")
        browser.wait_for("document.querySelectorAll('section.engine').length === 2", 5, "two polled panels")
        browser.evaluate(f"window.__reply = {json.dumps({'engines': [_snap('0', 'p-2', 2, 2.0)]})}")
        browser.wait_for("document.querySelectorAll('section.engine').length === 1", 5, "p-1's panel to go")
        assert [p[1] for p in browser.evaluate(PANELS)] == ["p-2"]
        assert set(browser.evaluate("__fetched")) == {"/dashboard/snapshot?api_key=sk-live%26page"}
        assert browser.errors() == []


def test_the_page_and_replay_share_one_reader_of_the_static_files_and_replay_needs_no_starlette():
    from gateway import dashboard
    from gateway.static_files import read_static
    from tests.test_layering import NETWORKING, imported_after

    assert dashboard.read_static is read_static and replay_page.__globals__["read_static"] is read_static
    with pytest.raises(FileNotFoundError, match="not one of the memory page's files"):
        read_static("../app.py")
    assert imported_after("import pagoda.bench.replay, pagoda.bench.synthetic_trace", NETWORKING | {"torch"}) == []


def test_the_cpu_pool_draws_the_prefix_caches_cpu_tier_blocks_as_cached(tmp_path):
    """--cpu-prefix-cache: a snapshot's `cpu_cached` swap-pool blocks are drawn in the cached colour in
    the CPU pool's map, the other unheld ones as free."""
    (snapshot,) = synthetic_trace(1_000, 1)
    snapshot = {**snapshot, "num_cpu_blocks": 64, "cpu_ref_counts": [0] * 64, "cpu_cached": [3, 5, 40],
                "sequences": [s for s in snapshot["sequences"] if s["pool"] == "gpu"]}
    assert check_snapshot(snapshot) == []
    page = tmp_path / "tier.html"
    page.write_text(replay_page([snapshot]))
    with Chromium() as browser:
        browser.navigate(page.as_uri())
        browser.wait_for("window.pagoda && pagoda.renders > 0", 20, "the page's first render")
        found = browser.evaluate("""(() => {
            const canvas = document.querySelector('.map-cpu'), d = pagoda.panel().drawn.cpu;
            const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
            const classes = new Map([["38,43,51", "free"], ["89,97,109", "cached"]]);
            const found = {};
            for (let b = 0; b < d.n; b++) {
                const i = 4 * (Math.floor(b / d.cols) * d.cell * canvas.width + (b % d.cols) * d.cell);
                const name = classes.get(pixels[i] + "," + pixels[i + 1] + "," + pixels[i + 2]) || "unknown";
                (found[name] = found[name] || []).push(b);
            }
            return found;
        })()""")
        assert found == {"cached": [3, 5, 40], "free": [b for b in range(64) if b not in (3, 5, 40)]}
        assert browser.evaluate("[pagoda.blockInfo(undefined, 5, 'cpu'), pagoda.blockInfo(undefined, 6, 'cpu')]") == [
            "CPU block 5\ncached: in the prefix cache's CPU tier, copied back on a hit (evictable)", "CPU block 6\nfree"]
        assert "its CPU tier: --cpu-prefix-cache" in browser.evaluate("document.getElementById('legend').textContent")
        assert browser.errors() == []
