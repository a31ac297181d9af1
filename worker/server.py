"""The worker process: one rank's Executor behind a ZeroMQ link to its scheduler.

Plans run one at a time in the order they arrive, and each result is sent before the next plan
is read: with async scheduling the next plan is usually queued already, so the worker never waits
on the scheduler; a plan whose step failed fails the plans of its epoch already on their way.

The ranks of a tensor-parallel group form their torch.distributed group (worker/parallel.py) anew
for each epoch: the scheduler starts a new epoch whenever its group of ranks changes or fails, so
a rank that died and came back, or a group whose collective failed, meets the others afresh at
the first plan of the next epoch. A failed formation or collective (a peer died: gloo raises at
once; a peer hangs: at --step-timeout) fails that step, and the rank leaves the group at once, so
peers blocked in a collective with it fail too instead of waiting out their timeout.
"""
from __future__ import annotations

import logging
import signal
import time

from common.config import EngineConfig, ServingConfig
from common.protocol import StepPlan, StepResult
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
    # before the hello: rank 0 hosts the group's store, which the other ranks need once plans come
    group = TensorParallelGroup(rank, engine_config.tensor_parallel_size, serving.dist_init_address,
                                resolve_device(engine_config.device, rank), serving.step_timeout_s)
    executor = Executor(engine_config, group=group)  # loads the model: the heartbeat runs meanwhile
    hello = executor.hello()
    link = SchedulerLink(serving.zmq_address)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    link.hello(hello)
    log.info("worker %d/%d ready: %d KV blocks on %s; scheduler at %s", rank, group.world_size, hello.num_gpu_blocks,
             hello.device, serving.zmq_address)
    steps = _Steps(executor, group)
    idle_since = time.monotonic()
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
            result = steps.run(plan)
            if heartbeat:
                heartbeat.step_started = None
            link.send_result(result)
            idle_since = time.monotonic()
    finally:
        link.close()
        group.destroy()


class _Steps:
    """Runs each plan in its epoch: forms the group at an epoch's first plan, and once a step of
    an epoch failed, answers the rest of that epoch's plans with an error unrun."""

    def __init__(self, executor: Executor, group: TensorParallelGroup) -> None:
        self.executor = executor
        self.group = group
        self.epoch: int | None = None
        self.failed_epoch: int | None = None

    def run(self, plan: StepPlan) -> StepResult:
        if plan.epoch == self.failed_epoch:  # sent before the scheduler saw the failure
            return StepResult(plan.step, plan.epoch, error="an earlier step of this epoch failed")
        try:
            if plan.epoch != self.epoch:  # a new scheduler, a failed step or a changed group: start clean
                self.epoch = plan.epoch
                self.executor.form_group(plan.epoch)
            return self.executor.execute(plan)
        except Exception as exc:  # reported to the scheduler, which fails the group's requests
            log.exception("step %d of epoch %d failed", plan.step, plan.epoch)
            self.failed_epoch = plan.epoch
            self.group.destroy()  # unusable after a failed collective; peers waiting on this rank fail now
            self.executor.reset()
            return StepResult(plan.step, plan.epoch, error=f"{type(exc).__name__}: {exc}")
