"""One rank > 0 of the offline engine's tensor-parallel group: `python -m worker.tp_rank`.

The offline engine (pagoda/offline.py) runs rank 0 in process and starts ranks 1..N-1 with this
module. Each builds its Executor (its shard of the model), says it is ready on the pipe it was
given, forms the group, agrees on the group's pool sizes, then executes every plan rank 0 hands it
with `broadcast_bytes` until the empty payload. It exits when its parent does, or when the group
breaks (a collective with a dead rank 0 fails).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

STOP = b""  # rank 0 is closing the group
RESET = b"\x00reset"  # rank 0 started a fresh scheduler: forget every sequence (never an encoded plan)
OFFLINE_TIMEOUT_S = 7 * 24 * 3600.0  # ranks wait for the next plan as long as the engine lives
READY = b"ready\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.tp_rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--address", required=True, help="tcp://HOST:PORT of rank 0's store")
    p.add_argument("--config", required=True, help="the EngineConfig, as JSON")
    p.add_argument("--ready-fd", type=int, required=True, help="write a line here once the model is loaded")
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{args.rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    _exit_with_parent(args.parent_pid)
    serve_rank(args.rank, args.address, json.loads(args.config), args.ready_fd)
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def serve_rank(rank: int, address: str, config_fields: dict, ready_fd: int) -> None:
    from common.config import EngineConfig
    from common.protocol import decode
    from worker.executor import Executor
    from worker.model_runner import resolve_device
    from worker.parallel import TensorParallelGroup

    config = EngineConfig(**config_fields)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, address, resolve_device(config.device, rank),
                                OFFLINE_TIMEOUT_S)
    executor = Executor(config, group)
    os.write(ready_fd, READY)
    os.close(ready_fd)
    executor.form_group(0)
    hello = executor.hello()
    group.min_over_ranks(hello.num_gpu_blocks, hello.num_cpu_blocks)
    while (data := group.broadcast_bytes(None)) != STOP:
        if data == RESET:
            executor.reset()
        else:
            executor.execute(decode(data))
    group.destroy()


if __name__ == "__main__":
    sys.exit(main())
