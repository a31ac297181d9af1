"""The offline, in-process engine: the Scheduler driving an executor by direct calls.

`schedule -> execute -> update` is the whole step. The executor is anything with
`execute(StepPlan) -> StepResult`: the worker's Executor in process, or a transport to worker
processes. With `wire=True` every plan and result goes through the msgpack codec, exactly as
it would cross ZeroMQ.
"""
from __future__ import annotations

from typing import Protocol

from common.protocol import SamplingParams, StepPlan, StepResult, WorkerHello, decode, encode
from scheduler.scheduler import Scheduler
from scheduler.sequence import RequestOutput


class StepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor: StepExecutor, wire: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.wire = wire
        self.num_steps = 0
        self.num_scheduled_tokens = 0

    @classmethod
    def from_hello(cls, config, hello: WorkerHello, executor: StepExecutor, wire: bool = False) -> LLMEngine:
        return cls(Scheduler.from_hello(config, hello), executor, wire)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.wire:
            plan = decode(encode(plan))
        result = self.executor.execute(plan)
        if self.wire:
            result = decode(encode(result))
        self.num_steps += 1
        self.num_scheduled_tokens += plan.num_scheduled_tokens
        return self.scheduler.update(result)
