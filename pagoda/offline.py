"""The offline Python API: `LLM(model).generate(prompts, SamplingParams)`."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from common.config import EngineConfig
from common.protocol import SamplingParams
from scheduler.engine import LLMEngine
from worker.executor import Executor

Prompt = str | list[int] | dict


@dataclass(slots=True)
class Sample:
    """One output of a prompt: a sample (n, best_of) or a beam."""

    text: str | None  # None for a model without a tokenizer (dummy weights)
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str
    logprobs: list | None = None

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "cumulative_logprob": self.cumulative_logprob,
                "finish_reason": self.finish_reason}


@dataclass(slots=True)
class CompletionOutput:
    """A prompt's outputs; the first one's fields repeated at the top for the common n=1 case.
    With best_of > n or beam search the outputs are best first, else in sample order."""

    index: int
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str
    cumulative_logprob: float
    logprobs: list | None = None
    outputs: list[Sample] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"index": self.index, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "outputs": [sample.to_json() for sample in self.outputs]}


class LLM:
    """The whole engine in one process: the Scheduler driving the worker's Executor directly.

    Plans and results are handed over as objects; `wire=True` sends them through the msgpack
    codec, as they would cross ZeroMQ (the tests that hold the wire format to the engine).
    """

    def __init__(self, model: str = "default", skip_tokenizer_init: bool = False, wire: bool = False, **config) -> None:
        self.wire = wire
        self.config = EngineConfig(model=model, **config)
        self.executor = Executor(self.config)
        hello = self.executor.hello()
        self.config = self.config.replace(max_model_len=hello.max_model_len)
        self.engine = LLMEngine.from_hello(self.config, hello, self.executor, wire=wire)
        self.encoder = None
        if not skip_tokenizer_init and self.executor.runner.source.kind != "dummy":
            from gateway.tokenizer import PromptEncoder, load_tokenizer

            self.encoder = PromptEncoder(load_tokenizer(self.executor.runner.source))
        self._ids = itertools.count()

    def reset(self, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None, **config_changes) -> None:
        """A fresh scheduler over the loaded worker, forgetting every request: a smaller KV or
        swap pool (at most the worker's), another preemption mode, prefix caching on or off."""
        hello = self.executor.hello()
        if num_gpu_blocks is not None:
            hello = dataclasses.replace(hello, num_gpu_blocks=min(num_gpu_blocks, hello.num_gpu_blocks))
        if num_cpu_blocks is not None:
            hello = dataclasses.replace(hello, num_cpu_blocks=min(num_cpu_blocks, hello.num_cpu_blocks))
        self.executor.reset()
        self.engine = LLMEngine.from_hello(self.config.replace(**config_changes), hello, self.executor, wire=self.wire)

    @property
    def scheduler(self):
        return self.engine.scheduler

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if self.encoder is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        if isinstance(prompt, str):
            return self.encoder.encode_text(prompt)
        if "messages" in prompt:
            return self.encoder.encode_chat(prompt["messages"])
        return self.encoder.encode_text(prompt["prompt"])

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self.encode(prompt) for prompt in prompts]
        request_ids = {}
        try:
            for index, (ids, p) in enumerate(zip(encoded, params)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p)
                request_ids[request_id] = index
        except ValueError:  # a rejected prompt: none of this batch runs
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        results: list[CompletionOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", unit="prompt", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in request_ids:
                        index = request_ids[out.request_id]
                        results[index] = self._completion(index, out)
                        bar.update(1)
        return results

    def _completion(self, index: int, out) -> CompletionOutput:
        samples = [
            Sample(self.encoder.decode(list(seq.token_ids)) if self.encoder else None, list(seq.token_ids),
                   seq.cumulative_logprob, seq.finish_reason, list(seq.logprobs) if seq.logprobs is not None else None)
            for seq in sorted(out.outputs, key=lambda seq: seq.index)
        ]
        first = samples[0]
        return CompletionOutput(
            index, list(out.prompt_token_ids), first.text, first.token_ids, first.finish_reason,
            first.cumulative_logprob, first.logprobs, samples,
        )
