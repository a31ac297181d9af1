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
from collections import deque

from common.config import EngineConfig, ServingConfig
from common.protocol import StepPlan, StepResult
from common.gc_heap import freeze_startup_heap
from common.transport import SchedulerLink
from worker.executor import Executor
from worker.heartbeat import Heartbeat
from worker.model_runner import resolve_device
from worker.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

REHELLO_IDLE_S = 2.0  # say hello again when idle, so a restarted scheduler learns of this rank
IN_FLIGHT_POLL_MS = 1  # with a step in flight: how often to look whether it is done while no plan comes


def serve(engine_config: EngineConfig, serving: ServingConfig, rank: int = 0, heartbeat: Heartbeat | None = None) -> None:
    """`heartbeat`: started by the caller before the heavy imports (`pagoda worker --heartbeat-file`)."""
    if heartbeat is None and serving.heartbeat_file:
        heartbeat = Heartbeat(serving.heartbeat_file, serving.step_timeout_s)
    # before the hello: rank 0 hosts the group's store, which the other ranks need once plans come
    group = TensorParallelGroup(rank, engine_config.tensor_parallel_size, serving.dist_init_address,
                                resolve_device(engine_config.device, rank), serving.step_timeout_s)
    executor = Executor(engine_config, group=group)  # loads the model: the heartbeat runs meanwhile
    hello = executor.hello()
    freeze_startup_heap(f"worker {rank}")
    link = SchedulerLink(serving.zmq_address)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    link.hello(hello)
    log.info("worker %d/%d ready: %d KV blocks on %s (quantization: %s); scheduler at %s", rank, group.world_size,
             hello.num_gpu_blocks, hello.device, hello.quantization, serving.zmq_address)
    steps = _Steps(executor, group)
    idle_since = time.monotonic()
    try:
        while not stopping:
            # with a step in flight, wait for the next plan while the device still runs it: the
            # plan is launched behind it (fed its tokens on the device), then its result is sent;
            # once its tokens are on the host, no plan waiting: its result goes at once
            waiting = steps.in_flight and steps.ready()
            plan = link.recv_plan(timeout_ms=0 if waiting else IN_FLIGHT_POLL_MS if steps.in_flight else 200)
            if plan is None:  # None also for a malformed frame (logged, dropped)
                if waiting or (steps.in_flight and steps.ready()):
                    link.send_result(steps.finish())
                elif not steps.in_flight and time.monotonic() - idle_since > REHELLO_IDLE_S:
                    link.hello(hello)
                    idle_since = time.monotonic()
                _beat(heartbeat, steps)
                continue
            if heartbeat:  # the launch is timed too: from idle it may wait (a grammar, a collective)
                heartbeat.step_started = steps.oldest_launch or time.monotonic()
            for result in steps.launch(plan):  # the steps of the epoch before this plan's
                link.send_result(result)
            while steps.in_flight > 1:
                link.send_result(steps.finish())
            _beat(heartbeat, steps)
            idle_since = time.monotonic()
    finally:
        link.close()
        group.destroy()


def _beat(heartbeat: Heartbeat | None, steps: _Steps) -> None:
    """The heartbeat's step clock: since the launch of the oldest step in flight (None: idle)."""
    if heartbeat:
        heartbeat.step_started = steps.oldest_launch


class _Steps:
    """Runs each plan in its epoch: forms the group at an epoch's first plan, and once a step of
    an epoch failed, answers the rest of that epoch's plans with an error unrun. Launched steps
    are finished in plan order: each entry of `queue` is (step, its result if made already (an
    error), launch time); a None result is a step in the executor's flight."""

    def __init__(self, executor: Executor, group: TensorParallelGroup) -> None:
        self.executor = executor
        self.group = group
        self.epoch: int | None = None
        self.failed_epoch: int | None = None
        self.queue: deque[tuple[int, StepResult | None, float]] = deque()

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    @property
    def oldest_launch(self) -> float | None:
        return self.queue[0][2] if self.queue else None

    def ready(self) -> bool:
        """Whether the oldest step's result can be made without waiting for the device."""
        return self.queue[0][1] is not None or self.executor.ready()

    def launch(self, plan: StepPlan) -> list[StepResult]:
        """Queue the plan's step; returns the results of steps finished first (those of the epoch
        before a new one)."""
        finished, now = [], time.monotonic()
        if plan.epoch == self.failed_epoch:  # sent before the scheduler saw the failure
            self.queue.append((plan.step, _unrun(plan.step, plan.epoch), now))
            return finished
        try:
            if plan.epoch != self.epoch:  # a new scheduler, a failed step or a changed group: start clean
                while self.queue:
                    finished.append(self.finish())
                self.epoch = plan.epoch
                self.executor.form_group(plan.epoch)
            self.executor.launch(plan)
            self.queue.append((plan.step, None, now))
        except Exception as exc:  # reported to the scheduler, which fails the group's requests
            result = self._fail(plan.step, plan.epoch, exc)  # (a new queue: append after)
            self.queue.append((plan.step, result, now))
        return finished

    def finish(self) -> StepResult:
        step, result, _ = self.queue.popleft()
        if result is not None:
            return result
        try:
            return self.executor.finish()
        except Exception as exc:
            return self._fail(step, self.epoch, exc)

    def _fail(self, step: int, epoch: int, exc: Exception) -> StepResult:
        """The failed step's error result. The steps launched after it are answered with errors,
        unrun: the executor forgets them."""
        log.exception("step %d of epoch %d failed", step, epoch)
        self.failed_epoch = epoch
        self.group.destroy()  # unusable after a failed collective; peers waiting on this rank fail now
        self.executor.reset()
        dropped = "a step of this epoch failed while this one was in flight"
        self.queue = deque((s, StepResult(s, epoch, error=dropped) if r is None else r, t) for s, r, t in self.queue)
        return StepResult(step, epoch, error=f"{type(exc).__name__}: {exc}")


def _unrun(step: int, epoch: int) -> StepResult:
    return StepResult(step, epoch, error="an earlier step of this epoch failed")
