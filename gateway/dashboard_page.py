"""The memory page: GET /dashboard (gateway/static/dashboard.html) and GET /dashboard/static/<file>.

Static files written here, no build step and nothing from a CDN: the page works offline. Its data
comes from /dashboard/events and /dashboard/snapshot. With --api-key, the page and its files need
the key like the data routes do; a browser gives it as `?api_key=`, which the page passes on to
its files (the __QUERY__ marks in dashboard.html) and to its data requests.
"""
from __future__ import annotations

from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.openai_api import APIError, error_response
from gateway.static_files import STATIC_TYPES, read_static

QUERY_MARK = "__QUERY__"
NO_CACHE = {"Cache-Control": "no-cache"}  # a new release's page must not run last release's script


def require_dashboard_key(request: Request) -> Response | None:
    """None when the request may see the memory page and its data, else the 401 to answer with:
    `if (denied := require_dashboard_key(request)) is not None: return denied`."""
    try:
        request.app.state.gateway.authorize_dashboard(request)
    except APIError as exc:
        return error_response(exc)
    return None


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
