"""The operator's routes, beside the OpenAI API (gateway/app.py):

    GET  /health                      200 while a scheduler has its workers ready, else 503
    GET  /metrics                     Prometheus text: this gateway's metrics and the schedulers' statuses
    POST /v1/load_lora_adapter        vLLM's runtime LoRA updates, with --allow-runtime-lora-updating
    POST /v1/unload_lora_adapter
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.lora import LoRAAdapterError
from gateway.metrics import CONTENT_TYPE
from gateway.openai_api import APIError, bad_request, parse_json

if TYPE_CHECKING:
    from gateway.app import Gateway


def routes(gateway: Gateway) -> list[Route]:
    admin = Admin(gateway)
    lora_routes = [
        Route("/v1/load_lora_adapter", admin.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", admin.unload_lora_adapter, methods=["POST"]),
    ] if gateway.config.allow_runtime_lora_updating else []
    return [
        *lora_routes,
        Route("/health", admin.health, methods=["GET"]),
        Route("/metrics", admin.metrics_endpoint, methods=["GET"]),
    ]


class Admin:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def health(self, request: Request) -> Response:
        self.gateway._check_open()
        self.gateway._ready(await self.gateway._statuses(fresh=True))
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            statuses = await self.gateway.engine.statuses(fresh=True)
        except Exception:  # Redis down: this gateway's own metrics still help
            statuses = []
        return Response(self.gateway.metrics.render(statuses), media_type=CONTENT_TYPE)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"} (--allow-runtime-lora-updating)."""
        gateway = self.gateway
        gateway._authorize(request)
        name, path = _lora_fields(parse_json(await gateway._read_body(request)), ("lora_name", "lora_path"))
        try:
            await asyncio.to_thread(gateway.loras.add, name, path)  # reads the adapter's files
        except LoRAAdapterError as exc:
            raise bad_request(str(exc), "lora_path") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: requests already queued keep it."""
        gateway = self.gateway
        gateway._authorize(request)
        (name,) = _lora_fields(parse_json(await gateway._read_body(request)), ("lora_name",))
        try:
            gateway.loras.remove(name)
        except KeyError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def _lora_fields(body: object, names: tuple[str, ...]) -> list[str]:
    """The runtime LoRA endpoints' string fields, each required (a 400 naming the one missing)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name} must be a non-empty string", name)
        values.append(value)
    return values
