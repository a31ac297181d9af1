"""The memory page and its data, outside the OpenAI API and /openapi.json (an endless event stream):

    GET /dashboard                    the page (gateway/static/dashboard.html)
    GET /dashboard/static/<file>      its CSS and JavaScript
    GET /dashboard/snapshot           each scheduler's memory snapshot (common/memory_snapshot.py)
    GET /dashboard/events (SSE)       the same, then each change

Static files written here, no build step and nothing from a CDN: the page works offline. Its data
comes from /dashboard/events and /dashboard/snapshot. With --api-key, the page and its files need
the key like the data routes do; a browser gives it as `?api_key=`, which the page passes on to
its files (the __QUERY__ marks in dashboard.html) and to its data requests.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import redis
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.engine_client import EngineMemory
from gateway.openai_api import APIError, error_response, unavailable
from gateway.static_files import STATIC_TYPES, read_static

if TYPE_CHECKING:
    from gateway.app import Gateway

DASHBOARD_ROUTES = ("/dashboard", "/dashboard/snapshot", "/dashboard/events")
DASHBOARD_POLL_S = 0.25  # how often an event stream looks for new snapshots (the schedulers publish as often)
DASHBOARD_KEEPALIVE_S = 15.0
QUERY_MARK = "__QUERY__"
NO_CACHE = {"Cache-Control": "no-cache"}  # a new release's page must not run last release's script


def routes(gateway: Gateway) -> list[Route]:
    data = DashboardData(gateway)
    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/static/{name}", static_file, methods=["GET"]),
        Route("/dashboard/snapshot", data.snapshot, methods=["GET"]),
        Route("/dashboard/events", data.events, methods=["GET"]),
    ]


def require_dashboard_key(request: Request) -> Response | None:
    """None when the request may see the memory page and its data, else the 401 to answer with:
    `if (denied := require_dashboard_key(request)) is not None: return denied`."""
    try:
        request.app.state.gateway.authorize_dashboard(request)
    except APIError as exc:
        return error_response(exc)
    return None


# ----------------------------------------------------------------------------- the page
async def page(request: Request) -> Response:
    if (denied := require_dashboard_key(request)) is not None:
        return denied
    key = request.query_params.get("api_key")
    query = "?" + urlencode({"api_key": key}) if key else ""  # percent-encoded: safe inside an HTML attribute
    return Response(read_static("dashboard.html").replace(QUERY_MARK, query), media_type=STATIC_TYPES["dashboard.html"],
                    headers=NO_CACHE)


async def static_file(request: Request) -> Response:
    if (denied := require_dashboard_key(request)) is not None:
        return denied
    name = request.path_params["name"]
    if name not in STATIC_TYPES or name.endswith(".html"):
        raise HTTPException(404)  # the gateway's own 404: "no route /dashboard/static/NAME"
    return Response(read_static(name), media_type=STATIC_TYPES[name], headers=NO_CACHE)


# ----------------------------------------------------------------------------- its data
class DashboardData:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def snapshot(self, request: Request) -> Response:
        """{"engines": [each scheduler's snapshot JSON (common/memory_snapshot.py)]}."""
        if (denied := require_dashboard_key(request)) is not None:
            return denied
        try:
            engines = await self.gateway.engine.first_memory_snapshots()
        except (redis.RedisError, OSError) as exc:  # anything else is a bug: a 500 (app's _unexpected)
            return error_response(unavailable(f"Redis is unreachable ({exc}); no memory snapshot to show"))
        body = '{"engines":[' + ",".join(memory.json for memory in engines) + "]}"
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    async def events(self, request: Request) -> Response:
        """Server-Sent Events: each engine's snapshot at once, then again whenever its version
        changes, and `event: gone` ({"engine", "scheduler_id"}) once its snapshot is no longer
        there (the scheduler stopped, or lost its workers); a comment every DASHBOARD_KEEPALIVE_S.
        Ends when the gateway drains."""
        if (denied := require_dashboard_key(request)) is not None:
            return denied
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self):
        sent: dict[tuple[str, str], int] = {}  # (engine, scheduler id) -> the version sent last
        quiet_since = time.monotonic()
        while not self.gateway.draining:
            try:
                events = _dashboard_changes(sent, await self.gateway.engine.memory_snapshots())
            except (redis.RedisError, OSError):  # Redis down: the stream stays open, the page keeps what it has
                events = []
            for event in events:
                quiet_since = time.monotonic()
                yield event
            if time.monotonic() - quiet_since >= DASHBOARD_KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            await asyncio.sleep(DASHBOARD_POLL_S)


def _dashboard_changes(sent: dict[tuple[str, str], int], engines: list[EngineMemory]) -> list[str]:
    """The SSE events that bring a page that saw `sent` ((engine, scheduler id) -> version) up to
    `engines` (EngineClient.memory_snapshots); `sent` is updated."""
    events = []
    for memory in engines:
        if sent.get((memory.engine, memory.scheduler_id)) != memory.version:
            sent[memory.engine, memory.scheduler_id] = memory.version
            events.append(f"event: snapshot\ndata: {memory.json}\n\n")
    for engine, scheduler_id in sorted(sent.keys() - {(memory.engine, memory.scheduler_id) for memory in engines}):
        del sent[engine, scheduler_id]
        gone = json.dumps({"engine": engine, "scheduler_id": scheduler_id}, separators=(",", ":"))
        events.append(f"event: gone\ndata: {gone}\n\n")
    return events
