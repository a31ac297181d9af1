"""`pagoda bench memory --replay TRACE [--output PAGE.html]`: a memory trace as one standalone page.

A trace is JSON Lines, one engine snapshot per line (the JSON of common/memory_snapshot.py, as
`pagoda generate --memory-trace` writes it). The page is the gateway's live memory page
(gateway/static/) with its CSS and JavaScript inlined and the snapshots embedded, plus a slider
to step through them: one file that opens in a browser with no server and no network.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from gateway.static_files import read_static
from scheduler.memory_trace import read_trace

CSS_LINK = '<link rel="stylesheet" href="/dashboard/static/dashboard.css__QUERY__">'
JS_SCRIPT = '<script src="/dashboard/static/dashboard.js__QUERY__"></script>'


def _script_safe(text: str) -> str:
    """JSON that cannot end the <script> element holding it ('<' appears only inside strings)."""
    return text.replace("<", "\\u003c")


def replay_page(snapshots: list[dict], title: str = "trace") -> str:
    """The standalone HTML page of `snapshots`."""
    page = read_static("dashboard.html")
    for tag in (CSS_LINK, JS_SCRIPT):
        if page.count(tag) != 1:
            raise RuntimeError(f"gateway/static/dashboard.html no longer holds {tag}")
    page = page.replace("<title>Pagoda · KV memory</title>", f"<title>Pagoda · KV memory · {_escape(title)}</title>")
    page = page.replace(CSS_LINK, f"<style>\n{read_static('dashboard.css')}</style>")
    data = _script_safe(json.dumps(snapshots, separators=(",", ":")))
    return page.replace(JS_SCRIPT, f'<script type="application/json" id="pagoda-trace">{data}</script>\n'
                                   f"<script>\n{read_static('dashboard.js')}</script>")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def run(args) -> int:
    """The `pagoda bench memory --replay` command."""
    trace = Path(args.replay)
    snapshots = read_trace(trace)
    if not snapshots:
        raise ValueError(f"{trace} holds no snapshot: write one with `pagoda generate --memory-trace {trace}`")
    output = Path(args.output) if args.output else trace.with_suffix(".html")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(replay_page(snapshots, trace.name), encoding="utf-8")
    engines = sorted({s["engine"] for s in snapshots})
    print(f"wrote {output}: {len(snapshots)} snapshots of engine(s) {', '.join(engines)}, "
          f"steps {snapshots[0]['step']} to {snapshots[-1]['step']}", file=sys.stderr, flush=True)
    return 0
