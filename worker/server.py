"""The worker process: the offline engine's Executor behind a ZeroMQ link to its scheduler.

Plans run one at a time in the order they arrive, and each result is sent before the next plan
is read: with async scheduling the next plan is usually queued already, so the worker never waits
on the scheduler; a plan whose step failed fails the plans of its epoch already on their way.
"""
from __future__ import annotations

import logging
import signal
import time

from common.config import EngineConfig, ServingConfig
from common.protocol import StepResult
from common.transport import SchedulerLink
from worker.executor import Executor
from worker.heartbeat import Heartbeat
from worker.model_runner import resolve_device
from worker.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

REHELLO_IDLE_S = 2.0  # say hello again when idle, so a restarted scheduler learns of this rank


def serve(engine_config: EngineConfig, serving: ServingConfig, rank: int = 0, heartbeat: Heartbeat | None = None) -> None:
    """`heartbeat`: started by the caller before the heavy imports (`pagoda worker --heartbeat-file`)."""
    if heartbeat is None and serving.heartbeat_file:
        heartbeat = Heartbeat(serving.heartbeat_file, serving.step_timeout_s)
    group = TensorParallelGroup(rank, engine_config.tensor_parallel_size, serving.dist_init_address,
                                resolve_device(engine_config.device, rank), serving.step_timeout_s)
    executor = Executor(engine_config, group)  # loads the model: the heartbeat runs meanwhile
    hello = executor.hello()
    link = SchedulerLink(serving.zmq_address)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    link.hello(hello)
    log.info("worker %d ready: %d KV blocks on %s; scheduler at %s", rank, hello.num_gpu_blocks, hello.device,
             serving.zmq_address)
    epoch, failed_epoch, idle_since = None, None, time.monotonic()
    try:
        while not stopping:
            plan = link.recv_plan(timeout_ms=200)  # None also for a malformed frame (logged, dropped)
            if plan is None:
                if time.monotonic() - idle_since > REHELLO_IDLE_S:
                    link.hello(hello)
                    idle_since = time.monotonic()
                continue
            if heartbeat:
                heartbeat.step_started = time.monotonic()
            if plan.epoch != epoch:  # a new scheduler or a failed step: start clean
                executor.form_group(plan.epoch)
                epoch = plan.epoch
            try:
                if plan.epoch == failed_epoch:  # sent before the scheduler saw the failure
                    result = StepResult(plan.step, plan.epoch, error="an earlier step of this epoch failed")
                else:
                    result = executor.execute(plan)
            except Exception as exc:  # reported to the scheduler, which fails the group's requests
                log.exception("step %d failed", plan.step)
                executor.reset()
                failed_epoch = plan.epoch
                result = StepResult(plan.step, plan.epoch, error=f"{type(exc).__name__}: {exc}")
            if heartbeat:
                heartbeat.step_started = None
            link.send_result(result)
            idle_since = time.monotonic()
    finally:
        link.close()
