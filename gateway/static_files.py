"""The memory page's files (gateway/static/): served by gateway/dashboard.py, inlined into one
standalone page by `pagoda bench memory --replay` (pagoda/bench/replay.py, which runs without
starlette: this module imports nothing but the standard library)."""
from __future__ import annotations

from importlib import resources

STATIC_TYPES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}


def read_static(name: str) -> str:
    """gateway/static/NAME; FileNotFoundError for a name that is not one of the page's files."""
    if name not in STATIC_TYPES:
        raise FileNotFoundError(f"gateway/static/{name} is not one of the memory page's files")
    return (resources.files("gateway") / "static" / name).read_text(encoding="utf-8")
