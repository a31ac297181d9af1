"""`pagoda up`: the whole stack on one machine, as separate processes, stopped cleanly on Ctrl-C.

    private redis-server (unless a Redis URL is given) ─ scheduler ─ worker ─ gateway
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from common.redis_server import RedisServer, free_port


def up(args, engine_flags: list[str]) -> int:
    redis_server = None
    redis_url = args.redis_url
    if not redis_url:
        redis_server = RedisServer().start()
        redis_url = redis_server.url
        print(f"pagoda: private Redis at {redis_url}", file=sys.stderr)
    zmq_address = f"tcp://127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "pagoda.cli"]
    http = ["--host", args.host, "--port", str(args.port)]
    if args.api_key:
        http += ["--api-key", args.api_key]
    if args.served_model_name:
        http += ["--served-model-name", args.served_model_name]
    commands = {
        "scheduler": cli + ["scheduler", "--redis-url", redis_url, "--zmq-address", zmq_address, *engine_flags],
        "worker": cli + ["worker", "--zmq-address", zmq_address, *engine_flags],
        "gateway": cli + ["gateway", "--redis-url", redis_url, "--model", args.model, *http],
    }
    # Own sessions: Ctrl-C reaches `pagoda up` alone, which then stops the children in order.
    children = {name: subprocess.Popen(cmd, start_new_session=True) for name, cmd in commands.items()}
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):  # explicit: a shell may start us with SIGINT ignored
        signal.signal(sig, lambda *_: stop.update(now=True))
    try:
        code = _supervise(children, args, stop)
    except KeyboardInterrupt:
        code = 0
    print("\npagoda: stopping", file=sys.stderr)
    _stop(children)
    if redis_server:
        redis_server.stop()
    return code


def _supervise(children: dict[str, subprocess.Popen], args, stop: dict) -> int:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    ready = False
    print("pagoda: loading the model and starting the gateway...", file=sys.stderr)
    while not stop["now"]:
        for name, child in children.items():
            if child.poll() is not None:
                print(f"pagoda: the {name} exited with code {child.returncode}", file=sys.stderr)
                return 1
        if not ready and _healthy(url):
            ready = True
            _banner(url, args)
        time.sleep(0.5)
    return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _banner(url: str, args) -> None:
    auth = f" \\\n  -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    print(
        f"\nPagoda is serving at {url}  (OpenAI-compatible: {url}/v1)\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n  -d '{body}'\n\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )


def _stop(children: dict[str, subprocess.Popen]) -> None:
    for name in ("gateway", "worker", "scheduler"):
        child = children[name]
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for child in children.values():
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
