"""The worker process's loop (worker/server.py) around a fake Executor and a fake scheduler link:
the heartbeat's step clock, results in plan order across an epoch change, and a failed launch
answered with its error (the real path: tests/test_faults.py, tests/test_e2e.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import worker.server as server
from common.protocol import StepPlan, StepResult


class _Stop(Exception):
    pass


def _run_loop(monkeypatch, plans, on_launch, freezes=None):
    """`freezes`: a list the loop's freezes of its startup heap go to (never this process's own heap)."""
    heartbeat = SimpleNamespace(step_started=None)
    sent = []
    freezes = [] if freezes is None else freezes

    class FakeGroup:
        world_size = 1

        def __init__(self, *args):
            pass

        def destroy(self):
            pass

    class FakeExecutor:
        def __init__(self, config, group):
            self.in_flight = []

        def hello(self):
            return SimpleNamespace(num_gpu_blocks=1, device="cpu", quantization="none")

        def form_group(self, epoch):
            pass

        def launch(self, plan):
            on_launch(heartbeat)
            self.in_flight.append(plan)

        def ready(self):
            return True

        def finish(self):
            plan = self.in_flight.pop(0)
            return StepResult(plan.step, plan.epoch)

        def reset(self):
            self.in_flight.clear()

    class FakeLink:
        def __init__(self, address):
            self.plans = list(plans)

        def hello(self, hello):
            pass

        def recv_plan(self, timeout_ms=None):
            if self.plans:
                return self.plans.pop(0)
            if len(sent) == len(plans):
                raise _Stop
            return None

        def send_result(self, result):
            sent.append(result)

        def close(self):
            pass

    monkeypatch.setattr(server, "TensorParallelGroup", FakeGroup)
    monkeypatch.setattr(server, "Executor", FakeExecutor)
    monkeypatch.setattr(server, "SchedulerLink", FakeLink)
    monkeypatch.setattr(server, "resolve_device", lambda device, rank: "cpu")
    monkeypatch.setattr(server, "freeze_startup_heap", lambda process: freezes.append(("freeze", process)))
    serving = SimpleNamespace(heartbeat_file=None, dist_init_address=None, step_timeout_s=1.0, zmq_address="x")
    with pytest.raises(_Stop):
        server.serve(SimpleNamespace(device="cpu", tensor_parallel_size=1), serving, 0, heartbeat)
    return sent


def test_the_heartbeat_clock_runs_while_a_plan_is_launched_from_idle(monkeypatch):
    """Before the token feed, `step_started` was set before the step ran: a step stuck in the
    executor (a grammar compile, a CPU forward, a collective) stopped the heartbeat. Now a plan
    launched with no step in flight runs with the clock at None: a hang there is never seen."""
    clocks = []
    sent = _run_loop(monkeypatch, [StepPlan(1, 0)], lambda hb: clocks.append(hb.step_started))
    assert [r.step for r in sent] == [1]
    assert clocks[0] is not None  # fails: None, the supervisor would think the worker idle


def test_results_in_plan_order_across_an_epoch_change(monkeypatch):
    sent = _run_loop(monkeypatch, [StepPlan(1, 0), StepPlan(2, 0), StepPlan(1, 1)], lambda hb: None)
    assert [(r.epoch, r.step) for r in sent] == [(0, 1), (0, 2), (1, 1)]


def test_a_launch_failure_behind_a_step_in_flight_blames_the_right_step(monkeypatch):
    """Step 1 launched fine; step 2's launch raises. Step 1's result says 'an earlier step of this
    epoch failed', though the failing step (2) came after it."""
    class Executor:
        def __init__(self):
            self.n = 0

        def form_group(self, epoch):
            pass

        def launch(self, plan):
            if plan.step == 2:
                raise RuntimeError("boom")

        def reset(self):
            pass

    steps = server._Steps(Executor(), SimpleNamespace(destroy=lambda: None))
    assert steps.launch(StepPlan(1, 0)) == []
    assert steps.launch(StepPlan(2, 0)) == []
    first, second = steps.finish(), steps.finish()
    assert second.error == "RuntimeError: boom"
    assert (first.step, first.error) == (1, "a step of this epoch failed while this one was in flight")
    assert second.step == 2  # fails: step 1 is told an earlier step failed


def test_a_failed_launch_is_answered_with_its_error(monkeypatch):
    """A plan whose launch raises (a ProtocolError, an OOM) must be answered. `_Steps.launch` does
    `self.queue.append((..., self._fail(...), ...))`: `self.queue.append` is looked up before
    `_fail` replaces `self.queue` with a new deque, so the error goes into the discarded one."""
    class Executor:
        def form_group(self, epoch):
            pass

        def launch(self, plan):
            raise RuntimeError("boom")

        def reset(self):
            pass

    steps = server._Steps(Executor(), SimpleNamespace(destroy=lambda: None))
    assert steps.launch(StepPlan(1, 0)) == []
    assert steps.in_flight == 1  # fails: 0, step 1's error result is lost
    assert steps.finish().error == "RuntimeError: boom"


def test_the_startup_heap_is_frozen_once_the_model_is_loaded_before_the_first_plan(monkeypatch):
    """A collection of the oldest generation walks every object the model's load left (about 150
    ms a step at batch 256 on this CPU, `pagoda bench step`'s worst step): the worker freezes them
    after its Executor is built and before it serves."""
    events = []
    _run_loop(monkeypatch, [StepPlan(1, 0)], lambda hb: events.append(("launch", 1)), freezes=events)
    assert events == [("freeze", "worker 0"), ("launch", 1)]


def test_freeze_startup_heap_moves_what_lives_to_the_permanent_generation():
    import gc

    from common.gc_heap import freeze_startup_heap

    kept = [[i] for i in range(1000)]  # containers: the collector tracks them
    try:
        frozen = freeze_startup_heap("test")
        assert frozen >= len(kept)  # (not == get_freeze_count(): another thread may free a frozen object between)
        walked = {id(x) for x in gc.get_objects(generation=2)}  # what a full collection walks
        assert not any(id(x) in walked for x in kept)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
