"""Run the gateway under uvicorn: `pagoda gateway` and `pagoda up` call `run`."""
from __future__ import annotations

import uvicorn

from common.config import GatewayConfig
from gateway.app import create_app


def run(config: GatewayConfig, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until SIGINT/SIGTERM. Loads the tokenizer first, so the port opens ready to tokenize."""
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, access_log=access_log,
                timeout_graceful_shutdown=5, server_header=False)
