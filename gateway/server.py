"""Run the gateway under uvicorn: `pagoda gateway` and `pagoda up` call `run`."""
from __future__ import annotations

import signal

import uvicorn

from common.config import GatewayConfig
from gateway.app import create_app


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT uvicorn stops accepting connections and waits for those open; the
    gateway also answers new requests on them with 503 and, after `drain_timeout_s`, ends the
    requests still in flight with an error (a 503 body, or an SSE error event and [DONE])."""

    def __init__(self, config: uvicorn.Config, gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self.gateway.drain()


def run(config: GatewayConfig, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until SIGINT/SIGTERM, then drain and return (exit 0). Loads the tokenizer first, so the
    port opens ready to tokenize. A port that cannot be bound exits 1 (uvicorn)."""
    app = create_app(config)
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=config.drain_timeout_s + 5, server_header=False,
    ), app.state.gateway)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught once it has drained
        signal.signal(sig, lambda *_: None)
    server.run()
