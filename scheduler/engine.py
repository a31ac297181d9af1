"""The offline, in-process engine: the Scheduler driving an executor by direct calls.

`schedule -> execute -> update` is the whole step (scheduler/step_pipeline.py, as in the scheduler
process). The executor is anything with
`execute(StepPlan) -> StepResult`: the worker's Executor in process (plans and results handed
over as objects), or a transport to worker processes. With `wire=True` every plan and result
goes through the msgpack codec, exactly as it would cross ZeroMQ.

With `async_scheduling` the step keeps one plan ahead, as the scheduler process does (plan N+1
is made before N's result is applied). An executor that can launch a step and finish it later
(worker/executor.py: `launch`, `finish`) gets plan N+1 launched before N is finished: the device
runs N+1 (fed N's tokens on the device) while the host applies N's result and plans N+2. One that
only executes runs each plan whole, in the same order.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from common.protocol import LoRARequest, MultiModalItem, SamplingParams, StepPlan, StepResult, WorkerHello, decode, encode
from scheduler.memory_trace import MemoryTrace
from scheduler.memory_view import MemoryEventLog
from scheduler.scheduler import Scheduler
from scheduler.sequence import RequestOutput
from scheduler.step_pipeline import StepPipeline


class StepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


class LLMEngine(StepPipeline):
    def __init__(self, scheduler: Scheduler, executor: StepExecutor, wire: bool = False,
                 memory_trace: MemoryTrace | None = None) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.executor = executor
        self.wire = wire
        self.memory_trace = memory_trace  # written after each step and abort that changed the memory
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self._results: deque[StepResult | None] = deque()  # of the plans in flight, oldest first (None: launched)
        self._outputs: list[RequestOutput] = []  # of the results taken this step

    @classmethod
    def from_hello(cls, config, hello: WorkerHello, executor: StepExecutor, wire: bool = False,
                   memory_trace: MemoryTrace | None = None, memory_events: MemoryEventLog | None = None) -> LLMEngine:
        """`memory_events`: the event log of the engine this one replaces (its ids go on)."""
        return cls(Scheduler.from_hello(config, hello, memory_events), executor, wire, memory_trace)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None, mm_items: list[MultiModalItem] | None = None) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params, lora_request=lora_request, mm_items=mm_items)

    def abort_request(self, request_id: str) -> bool:
        aborted = self.scheduler.abort_request(request_id)
        self.settle()
        self._outputs.clear()
        self._trace()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step's outputs. With async scheduling the next plan is made (and, in process, run)
        before this step's result is applied; once no request is left, the plan still in flight
        is applied too, so the engine ends idle."""
        self.run_step()
        outputs, self._outputs = self._outputs, []
        self._trace()
        return outputs

    def _trace(self) -> None:
        if self.memory_trace is not None:
            self.memory_trace.record(self.scheduler, idle=not self.has_unfinished_requests())

    def _launch(self, plan: StepPlan) -> None:
        if self.wire:
            plan = decode(encode(plan))
        if hasattr(self.executor, "launch"):
            self.executor.launch(plan)
            result = None
        else:
            result = self.executor.execute(plan)
            if self.wire:
                result = decode(encode(result))
        self.num_steps += 1
        self.num_scheduled_tokens += plan.num_scheduled_tokens
        self._results.append(result)

    def _take_result(self, plan: StepPlan) -> bool:
        result = self._results.popleft()
        if result is None:
            result = self.executor.finish()
            if self.wire:
                result = decode(encode(result))
        self._outputs += self.scheduler.update(result)
        return True
