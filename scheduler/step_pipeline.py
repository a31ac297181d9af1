"""The step loop between a Scheduler and its workers, shared by the scheduler process
(scheduler/server.py, over ZeroMQ) and the offline engine (scheduler/engine.py, in process).

    step:   plan (if nothing is in flight) ─▶ plan the next one while the workers run it (async
            scheduling) ─▶ take the oldest plan's result ─▶ once no request is left, take the
            results still in flight (`settle`), so the loop ends idle

With async scheduling one plan is always in flight ahead of the result being applied: the workers
go from plan N to plan N+1 (fed N's tokens on the device) while the host applies N's result.

This base class keeps the one record of the plans in flight; each end keeps its own (the
transport's frames, the in-process executor's results) and supplies two steps: `_launch` hands a
plan to the workers, `_take_result` takes a plan's result and applies it (False when the workers
failed: the end then clears `in_flight`).
"""
from __future__ import annotations

from collections import deque

from common.protocol import StepPlan
from scheduler.scheduler import Scheduler


class StepPipeline:
    scheduler: Scheduler | None

    def __init__(self) -> None:
        self.in_flight: deque[StepPlan] = deque()  # plans launched, oldest first

    def _launch(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def _take_result(self, plan: StepPlan) -> bool:
        raise NotImplementedError

    def run_step(self) -> StepPlan:
        """One step; returns the plan whose result it took."""
        scheduler = self.scheduler
        if not self.in_flight:
            self.launch(scheduler.schedule())
        if scheduler.config.async_scheduling:
            self.launch(scheduler.schedule())  # planned while the workers run the plan before it
        oldest = self.in_flight[0]
        if self.collect() and not scheduler.has_unfinished_requests():
            self.settle()
        return oldest

    def launch(self, plan: StepPlan) -> None:
        self._launch(plan)  # even an empty plan: it carries the ids the workers must drop
        self.in_flight.append(plan)

    def collect(self) -> bool:
        """The oldest plan's result taken and applied; False when the workers failed."""
        return self._take_result(self.in_flight.popleft())

    def settle(self) -> None:
        """Once no request is left, the results still in flight (they end nothing new)."""
        while self.in_flight and not self.scheduler.has_unfinished_requests() and self.collect():
            pass
