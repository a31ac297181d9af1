"""`pagoda bench step` through the real scheduler, wire codec, executor and sampler, the forward simulated.

The worker runs in a process of its own: a test changes a part of it with a `setup` function that
the spawned process runs first (a monkeypatch of this process would not reach it)."""
import gc
import json
import time
import os
import threading
import types
from pathlib import Path

import pytest
import zmq

from common.protocol import CachedSequence, StepPlan, StepResult
import pagoda.bench.step as step_module
from pagoda.bench.step import (
    END, PartClock, RowServer, RowSpec, SchedulerLoop, WorkerProcess, WorkerSocket, dummy_model_config, measure,
)
from pagoda.cli import main

ROW_KEYS = ["batch", "context", "sampling", "simulated_forward_ms", "async_scheduling", "steps", "decode_tokens",
            "step_ms", "host_ms", "host_max_ms", "gc_freeze", "forward_ms", "breakdown_ms", "load_1m"]
PARTS = ["schedule", "encode_plan", "decode_plan", "apply", "prepare", "sampler", "execute_other", "encode_result",
         "decode_result", "update"]


def test_cli_writes_one_row_per_workload_with_the_documented_keys(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--batch-sizes", "3,4", "--context-lens", "40", "--sampling", "greedy,random",
                 "--simulated-forward-ms", "0,2", "--steps", "3", "--warmup-steps", "1", "--no-async-scheduling",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:5] == ["benchmark", "command", "commit", "date", "device"]
    assert result["benchmark"] == "step"
    assert result["command"].startswith("pagoda bench step --batch-sizes 3,4 --context-lens 40 --sampling greedy,random "
                                        "--simulated-forward-ms 0,2 --steps 3 --warmup-steps 1 --no-async-scheduling ")
    assert result["vocab_size"] == 49152
    rows = result["rows"]
    assert [(r["batch"], r["context"], r["sampling"], r["simulated_forward_ms"]) for r in rows] == [
        (b, 40, s, f) for b in (3, 4) for s in ("greedy", "random") for f in (0.0, 2.0)]
    for row in rows:
        assert list(row) == ROW_KEYS
        assert list(row["breakdown_ms"]) == PARTS
        assert row["async_scheduling"] is False
        assert row["steps"] == 3 and row["decode_tokens"] == 3 * row["batch"]
        assert all(v >= 0 for v in row["breakdown_ms"].values()) and row["host_ms"] > 0
        assert row["host_max_ms"] >= row["host_ms"] and row["gc_freeze"] is True
        assert row["forward_ms"] >= row["simulated_forward_ms"]
        # serial: a step takes at least its simulated forward, and the host work around it
        assert row["step_ms"] >= row["simulated_forward_ms"]


def test_bad_sampling_is_a_usage_error(capsys):
    assert main(["bench", "step", "--sampling", "beam"]) == 2
    assert "unknown sampling 'beam'" in capsys.readouterr().err


def test_gc_freeze_off_runs_unfrozen_rows_and_a_bad_value_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--batch-sizes", "2", "--context-lens", "20", "--sampling", "greedy",
                 "--simulated-forward-ms", "0", "--steps", "2", "--warmup-steps", "1", "--gc-freeze", "off",
                 "--output", str(out)]) == 0
    assert [row["gc_freeze"] for row in json.loads(out.read_text())["rows"]] == [False]
    assert gc.get_freeze_count() == 0  # each row unfreezes what it froze
    assert main(["bench", "step", "--gc-freeze", "maybe"]) == 2
    assert "--gc-freeze takes on, off or both" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return dummy_model_config(tmp_path_factory.mktemp("model"), 256)


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess() as process:
        yield process


def test_the_worker_is_a_process_of_its_own_with_this_ones_threads(worker):
    import torch

    assert worker.hello == {"pid": worker.process.pid, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                            "torch_num_threads": torch.get_num_threads()}
    assert worker.process.pid != os.getpid()


def run_row(model_path, worker, **overrides):
    spec = RowSpec(**{"batch": 5, "context": 70, "sampling": "random", "simulated_forward_ms": 0.0, "steps": 4,
                      "warmup_steps": 2, "max_num_batched_tokens": 96, **overrides})
    return spec, *measure(spec, model_path, worker=worker)


def test_serial_row_counts_every_step_and_token_exactly(model_path, worker):
    """Prefill in chunks of 96 tokens (some sequences decode while others prefill), then 2 untimed
    and 4 measured steps of exactly one token per sequence; no plan is made past the last one."""
    spec, row, run = run_row(model_path, worker, async_scheduling=False)
    scheduler = run.scheduler
    assert row["async_scheduling"] is False
    assert len(run.steps) == 4 and row["steps"] == 4
    assert scheduler.step == run.steps[-1]
    assert [run.decode_tokens[step] for step in run.steps] == [5, 5, 5, 5]
    assert row["decode_tokens"] == 20
    seqs = [seq for group in scheduler.groups.values() for seq in group.seqs]
    assert len(seqs) == 5 and not any(seq.status.finished for seq in seqs)
    # every token the sequences hold came through a result, counted once
    assert sum(len(seq.output_token_ids) for seq in seqs) == sum(run.decode_tokens.values())
    assert all(len(seq.output_token_ids) >= 1 + 2 + 4 for seq in seqs)  # first token, warm-up, measured
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in seqs)
    for step in run.steps:
        assert set(run.worker_times[step]) == {"decode_plan", "apply", "prepare", "forward", "device", "sampler",
                                               "execute", "wait", "encode_result"}
        assert set(run.scheduler_times[step]) == {"schedule", "encode_plan", "decode_result", "update"}


class _LogitsOfTheLastToken(step_module.SimulatedForward):
    """The stand-in's logits by row position would give a sequence another row's logits when the
    two loops batch it at another position: here they follow each row's input token and position."""

    def __call__(self, step):
        rows = (step.input_ids[step.logits_indices] * 31 + step.positions[step.logits_indices]) % self.logits.shape[0]
        return self.logits[rows]


def _logits_of_the_last_token() -> None:
    """In the worker process."""
    step_module.SimulatedForward = _LogitsOfTheLastToken


def test_one_step_ahead_gives_the_serial_tokens(model_path):
    with WorkerProcess(setup=_logits_of_the_last_token) as worker:
        _, serial_row, serial = run_row(model_path, worker, async_scheduling=False)
        _, row, run = run_row(model_path, worker, async_scheduling=True)
    assert row["async_scheduling"] is True and serial_row["async_scheduling"] is False
    assert row["decode_tokens"] == 20
    def tokens(scheduler):
        return {g.request_id: [seq.output_token_ids for seq in g.seqs] for g in scheduler.groups.values()}

    shortest = min(len(t) for s in (run.scheduler, serial.scheduler) for seqs in tokens(s).values() for t in seqs)
    assert {k: [t[:shortest] for t in v] for k, v in tokens(run.scheduler).items()} == {
        k: [t[:shortest] for t in v] for k, v in tokens(serial.scheduler).items()}


class PipelinedScheduler:
    """Contract 1's driver side only: schedule() may run while one earlier plan awaits its result;
    prefill for 2 steps, then one decode token for each of 3 sequences. Records the call order."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: list[str] = []
        self.outstanding: list[int] = []

    def schedule(self) -> StepPlan:
        assert len(self.outstanding) <= 1, "a second plan in flight"
        self.step += 1
        self.outstanding.append(self.step)
        self.calls.append(f"schedule {self.step}")
        decode_only = self.step > 2
        seqs = [CachedSequence(i, [], 0, 1 if decode_only else 8, 0) for i in range(3)]
        return StepPlan(self.step, 0, cached_seqs=seqs)

    def update(self, result: StepResult) -> list:
        assert result.step == self.outstanding.pop(0), "results out of plan order"
        self.calls.append(f"update {result.step}")
        return []


class InstantDevice:
    """The simulated device's interface (SimulatedForward) with nothing to wait for."""

    def ready_at(self, step: int) -> float:
        return 0.0

    def wait(self, step: int) -> float:
        return 0.0


class EchoExecutor:
    """Launches a plan and finishes it with an empty result, in plan order."""

    def __init__(self) -> None:
        self.runner = types.SimpleNamespace(forward=InstantDevice())
        self.launched: list[StepPlan] = []

    def launch(self, plan: StepPlan) -> None:
        self.launched.append(plan)

    def finish(self) -> StepResult:
        plan = self.launched.pop(0)
        return StepResult(plan.step, plan.epoch)


@pytest.mark.parametrize("depth", [1, 2])
def test_loop_keeps_depth_plans_in_flight_and_stops_after_the_last_measured(depth):
    """The bench's two ends over a socket pair, the worker's end a thread of this process."""
    spec = RowSpec(batch=3, context=8, sampling="greedy", simulated_forward_ms=0.0, steps=2, warmup_steps=1)
    scheduler = PipelinedScheduler()
    context = zmq.Context.instance()
    scheduler_end, worker_end = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    scheduler_end.bind(f"inproc://bench-step-loop-{depth}")
    worker_end.connect(f"inproc://bench-step-loop-{depth}")
    server = threading.Thread(target=RowServer(worker_end, EchoExecutor(), PartClock(), profile=False).serve)
    loop = SchedulerLoop(scheduler, WorkerSocket(scheduler_end), spec, depth, profile=False)
    server.start()
    try:
        assert loop.run() == range(4, 6)  # step 3 is the first decode-only one, 1 warm-up step
    finally:
        scheduler_end.send_multipart([END, b""])
        server.join()
        scheduler_end.close(0)
        worker_end.close(0)
    if depth == 1:
        assert scheduler.calls == [f"{call} {step}" for step in range(1, 6) for call in ("schedule", "update")]
    else:
        assert scheduler.calls == ["schedule 1", "schedule 2", "update 1", "schedule 3", "update 2", "schedule 4",
                                   "update 3", "schedule 5", "update 4", "update 5"]
    assert set(loop.arrivals) == {1, 2, 3, 4, 5}


def test_profile_dir_holds_each_processs_profile_of_the_measured_steps(tmp_path):
    import pstats

    assert main(["bench", "step", "--batch-sizes", "3", "--context-lens", "40", "--sampling", "greedy",
                 "--simulated-forward-ms", "0", "--steps", "2", "--warmup-steps", "1", "--no-async-scheduling",
                 "--profile-dir", str(tmp_path / "prof")]) == 0
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "b3-c40-greedy-f0-scheduler.pstats", "b3-c40-greedy-f0-worker.pstats"]

    def calls(process: str) -> dict[str, int]:
        stats = pstats.Stats(str(tmp_path / "prof" / f"b3-c40-greedy-f0-{process}.pstats")).stats
        return {f"{Path(file).name}:{name}": ncalls for (file, _, name), (_, ncalls, *_) in stats.items()}

    scheduler, worker = calls("scheduler"), calls("worker")
    assert scheduler["scheduler.py:schedule"] == 2 and scheduler["scheduler.py:update"] == 2
    assert worker["executor.py:launch"] == 2 and worker["executor.py:finish"] == 2
    assert worker["model_runner.py:prepare"] == 2
    assert "executor.py:launch" not in scheduler and "scheduler.py:schedule" not in worker


def _sampler_writing_into_the_logits() -> None:
    """In the worker process."""
    from worker.sampler import Sampler

    real = Sampler.sample  # what the executor calls (the draws stay on the device)

    def in_place(self, logits, rows):
        logits.div_(0.8)
        return real(self, logits, rows)

    Sampler.sample = in_place


def test_a_sampler_writing_into_the_shared_logits_fails_the_row(model_path):
    with WorkerProcess(setup=_sampler_writing_into_the_logits) as worker:
        with pytest.raises(RuntimeError, match="wrote into the model's logits in place"):
            run_row(model_path, worker, async_scheduling=False, sampling="greedy")
        worker.process.join(timeout=30)
        assert worker.process.exitcode == 0  # it reported its failure and ended


def test_a_send_to_a_worker_that_failed_and_exited_raises_its_error_instead_of_hanging():
    """A PAIR socket blocks a send once its peer is gone: the error the worker sent first surfaces."""
    import zmq

    from pagoda.bench.step import ERROR, PLAN, WorkerSocket

    context = zmq.Context.instance()
    parent = context.socket(zmq.PAIR)
    port = parent.bind_to_random_port("tcp://127.0.0.1")
    worker = context.socket(zmq.PAIR)
    worker.connect(f"tcp://127.0.0.1:{port}")
    worker.send_multipart([ERROR, b"Traceback: boom"])
    try:
        # the error has arrived (so the two were connected) before the worker goes: else the
        # wait below could end before the connection was ever made, and the send then succeed
        assert parent.poll(10_000, zmq.POLLIN), "the worker's error never reached the parent"
        worker.close(linger=2000)
        deadline = time.monotonic() + 10
        while parent.poll(0, zmq.POLLOUT):  # until the parent's socket has seen its peer go
            assert time.monotonic() < deadline, "the worker's disconnect never reached the parent"
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="the bench worker failed:\nTraceback: boom"):
            WorkerSocket(parent, alive=lambda: True).send(PLAN, b"plan")
    finally:
        parent.close(linger=0)
