"""One rank > 0 of the offline engine's tensor-parallel group, in a child process.

The offline engine (pagoda/offline.py) runs rank 0 in process and starts ranks 1..N-1 with
`serve_rank` (forked from a multiprocessing forkserver that has imported this module, so a rank
does not import torch again). Each builds its Executor (its shard of the model), says it is ready,
forms the group, agrees on the group's pool sizes, then executes every plan rank 0 hands it with
`broadcast_bytes` until the empty payload. It exits when the engine's process does, or when the
group breaks (a collective with a dead rank 0 fails).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from common.config import EngineConfig
from common.protocol import decode
from worker.executor import Executor
from worker.model_runner import resolve_device
from worker.parallel import TensorParallelGroup

STOP = b""  # rank 0 is closing the group
RESET = b"\x00reset"  # rank 0 started a fresh scheduler: forget every sequence (never an encoded plan)
OFFLINE_TIMEOUT_S = 7 * 24 * 3600.0  # ranks wait for the next plan as long as the engine lives


def serve_rank(rank: int, address: str, config_fields: dict, ready, num_threads: int, log_level: int) -> None:
    """`ready`: a multiprocessing Connection, sent the rank once its model is loaded. `log_level`:
    the engine process's (its records go to stderr, named by rank)."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s", stream=sys.stderr)
    _exit_with_parent()
    torch.set_num_threads(num_threads)
    config = EngineConfig(**config_fields)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, address, resolve_device(config.device, rank),
                                OFFLINE_TIMEOUT_S)
    executor = Executor(config, group)
    ready.send(rank)
    ready.close()
    executor.form_group(0)
    hello = executor.hello()
    group.min_over_ranks(hello.num_gpu_blocks, hello.num_cpu_blocks, hello.max_model_len)
    while (data := group.broadcast_bytes(None)) != STOP:
        if data == RESET:
            executor.reset()
        else:
            executor.execute(decode(data))
    group.destroy()


def _exit_with_parent() -> None:
    """The forkserver this rank was forked from exits with the engine's process: follow it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
