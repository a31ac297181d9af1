"""The offline Python API: `LLM(model).generate(prompts, SamplingParams)`.

`generate(prompts)` without SamplingParams samples with `get_default_sampling_params()`: the
model's generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty) over
SamplingParams' defaults, as vLLM's LLM does (`generation_config="vllm"`: SamplingParams'
defaults alone). SamplingParams given are used as they are; to change one field and keep the
model's others, start from `llm.get_default_sampling_params()`.

With `tensor_parallel_size=N` rank 0 of the group runs in this process and ranks 1..N-1 run as
child processes (worker/tp_rank.py): each plan is handed to them over the group before rank 0
executes it. `LLM.close()` (or the LLM's collection, or the interpreter's exit) stops them.
"""
from __future__ import annotations

import contextlib

import dataclasses
import itertools
import logging
import multiprocessing
import os
import socket
import threading
import weakref
from multiprocessing.connection import Connection
from dataclasses import dataclass, field

from tqdm import tqdm

from common.config import EngineConfig
from common.generation_config import default_sampling_params
from common.models import pin_revision
from common.pooling import cosine, encode_pair, vector
from common.lora import read_adapter, target_shapes
from common.multimodal import DEFAULT_IMAGE_LIMIT
from common.protocol import LoRARequest, MultiModalItem, SamplingParams, StepPlan, StepResult, encode
from scheduler.engine import LLMEngine
from scheduler.memory_trace import INTERVAL_S as MEMORY_TRACE_INTERVAL_S
from scheduler.memory_trace import MemoryTrace
from scheduler.memory_view import MemoryEventLog
from worker.executor import Executor
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from worker.tp_rank import OFFLINE_TIMEOUT_S, RESET, STOP, serve_rank

log = logging.getLogger(__name__)

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
        out = {"text": self.text, "token_ids": self.token_ids, "cumulative_logprob": self.cumulative_logprob,
               "finish_reason": self.finish_reason}
        if self.logprobs is not None:  # per token [logprob, [[token_id, logprob], ...top k]]
            out["logprobs"] = self.logprobs
        return out


@dataclass(slots=True)
class Logprob:
    """One token's entry of prompt_logprobs (vLLM's Logprob): its logprob, its rank (1 + how many
    tokens were likelier) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


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
    # SamplingParams.prompt_logprobs asked: per prompt token None (the first) or {token_id: Logprob}:
    # the prompt token's own entry, then the top k (vLLM's RequestOutput.prompt_logprobs)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's RequestOutput.num_cached_tokens)
    pooled: bytes | None = None  # a pooling request's vector, float32 little-endian (common/pooling.py `vector`)

    def to_json(self) -> dict:
        out = {"index": self.index, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "outputs": [sample.to_json() for sample in self.outputs]}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


@dataclass(slots=True)
class PoolingOutput:
    """A pooling model's vector for one input (vLLM's PoolingRequestOutput, flattened): an
    embedding, or a classifier's scores (one per label)."""

    index: int
    prompt_token_ids: list[int]
    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data


class LLM:
    """The whole engine in one process: the Scheduler driving the worker's Executor directly.

    Plans and results are handed over as objects; `wire=True` sends them through the msgpack
    codec, as they would cross ZeroMQ (the tests that hold the wire format to the engine).
    """

    def __init__(self, model: str = "default", skip_tokenizer_init: bool = False, wire: bool = False,
                 memory_trace: str | None = None, memory_trace_interval: float = MEMORY_TRACE_INTERVAL_S,
                 **config) -> None:
        """`memory_trace`: a file to write the KV memory's snapshots to, one JSON line after a step
        that changed it, at most every `memory_trace_interval` seconds (0: after every such step)."""
        self.wire = wire
        # a Hub id is downloaded here, once, and every rank reads the same commit from the cache
        self.config = pin_revision(EngineConfig(model=model, **config))
        self.ranks = None if self.config.tensor_parallel_size == 1 else RankProcesses(self.config)
        if self.ranks is None:
            self.executor = Executor(self.config)
            self.step_executor = self.executor
            hello = self.executor.hello()
        else:
            self.executor = self.ranks.start_first()
            self.step_executor = GroupExecutor(self.executor, self.ranks)
            hello = self.ranks.group_hello()
        self.num_blocks = hello.num_gpu_blocks, hello.num_cpu_blocks  # the group's: its smallest rank's
        self.config = self.config.replace(max_model_len=hello.max_model_len)
        self.memory_trace = MemoryTrace.open(memory_trace, memory_trace_interval) if memory_trace else None
        if self.memory_trace is not None:
            weakref.finalize(self, self.memory_trace.close)
        self.memory_events = MemoryEventLog()  # every reset()'s engine's: event ids never restart
        self.engine = LLMEngine.from_hello(self.config, hello, self.step_executor, wire=wire,
                                           memory_trace=self.memory_trace, memory_events=self.memory_events)
        # what a request that leaves a sampling field unset gets (vLLM's default_sampling_params)
        self.default_sampling_params = default_sampling_params(self.executor.generation_config,
                                                               self.config.generation_config)
        if self.default_sampling_params:
            log.info("default sampling parameters from the model's generation_config.json: %s "
                     "(generation_config='vllm' ignores them)", self.default_sampling_params)
        self.encoder = None
        if not skip_tokenizer_init and self.executor.runner.source.kind != "dummy":
            from common.tokenizer import load_tokenizer
            from gateway.tokenizer import PromptEncoder

            self.encoder = PromptEncoder(load_tokenizer(self.executor.runner.source))
            if self.executor.images is not None:  # chats with image_url parts (docs/vision.md)
                from gateway.media import MediaPolicy
                from gateway.multimodal import ImagePrompts

                self.encoder.images = ImagePrompts.of(self.executor.runner.source, MediaPolicy(), DEFAULT_IMAGE_LIMIT)
        self._ids = itertools.count()

    def reset(self, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None, **config_changes) -> None:
        """A fresh scheduler over the loaded worker, forgetting every request: a smaller KV or
        swap pool (at most the worker's), another preemption mode, prefix caching on or off."""
        config = self.config.replace(**config_changes)
        spec = config.speculative
        if spec is not None and spec.drafts_on_worker and not self.executor.drafts_on_worker:
            raise ValueError("speculative method draft_model needs a worker loaded with its draft: "
                             "LLM(..., speculative_config={'method': 'draft_model', ...})")
        hello = self.executor.hello()
        if self.ranks is not None:
            hello = dataclasses.replace(hello, num_gpu_blocks=self.num_blocks[0], num_cpu_blocks=self.num_blocks[1])
        if num_gpu_blocks is not None:
            hello = dataclasses.replace(hello, num_gpu_blocks=min(num_gpu_blocks, hello.num_gpu_blocks))
        if num_cpu_blocks is not None:
            hello = dataclasses.replace(hello, num_cpu_blocks=min(num_cpu_blocks, hello.num_cpu_blocks))
        if self.ranks is not None:
            self.ranks.check_usable()
            self.executor.group.broadcast_bytes(RESET)
        self.executor.reset()
        self.engine = LLMEngine.from_hello(config, hello, self.step_executor,
                                           wire=self.wire, memory_trace=self.memory_trace,
                                           memory_events=self.memory_events)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do for one rank) and close
        the memory trace."""
        if self.ranks is not None:
            self.ranks.stop()
        if self.memory_trace is not None:
            self.memory_trace.close()

    @property
    def scheduler(self):
        return self.engine.scheduler

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json values where it sets them (vLLM's
        `LLM.get_default_sampling_params`): what `generate` samples with when given none."""
        return SamplingParams(**self.default_sampling_params)

    def encode(self, prompt: Prompt) -> list[int]:
        return self._encode(prompt)[0]

    def _encode(self, prompt: Prompt) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's ids, and its images: a chat's `image_url` parts, as the API takes them."""
        if isinstance(prompt, dict) and "messages" in prompt and any(map(_has_image, prompt["messages"])):
            if self.encoder is None or self.encoder.images is None:
                raise ValueError("this model does not take images")
            return self.encoder.images.encode_chat([_template_message(m) for m in prompt["messages"]], None, None, {})
        return self._encode_text(prompt), []

    def _encode_text(self, prompt: Prompt) -> list[int]:
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
        use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in input order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model);
        the LLM needs enable_lora=True."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if self.executor.runner.pooler_config is not None and any(p.pooling is None for p in params):
            raise ValueError("this is a pooling model (an embedder or a classifier): use LLM.embed or LLM.score, "
                             "or load it with runner='generate'")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        self._check_loras(loras)
        encoded = [self._encode(prompt) for prompt in prompts]
        for p in params:  # a grammar xgrammar rejects is a ValueError before anything runs, as the API's 400
            if p.structured_output is not None:
                self.executor.grammar.compile(p.structured_output)
        request_ids = {}
        try:
            for index, ((ids, images), p, lora) in enumerate(zip(encoded, params, loras)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p, lora, images)
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

    def embed(self, prompts: Prompt | list[Prompt], use_tqdm: bool = True) -> list[PoolingOutput]:
        """Each prompt's vector from a pooling model (`runner="pooling"`, or one the checkpoint says
        is): an embedder's embedding, a classifier's scores. Outputs come back in input order."""
        pooler = self.executor.runner.pooler_config
        if pooler is None:
            raise ValueError("this model is served for generation: load a pooling model (an embedder or a "
                             "classifier) or pass runner='pooling'")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = SamplingParams(temperature=0.0, max_tokens=0, pooling=pooler.params())
        outputs = self.generate([self.encode(prompt) for prompt in prompts], params, use_tqdm=use_tqdm)
        return [PoolingOutput(out.index, out.prompt_token_ids, vector(out.pooled)) for out in outputs]

    classify = embed

    def score(self, query: str, documents: list[str], use_tqdm: bool = True) -> list[float]:
        """Each document's relevance to `query`: a cross-encoder's score of the pair (one label), or
        an embedder's cosine similarity of the two embeddings (vLLM's LLM.score)."""
        pooler = self.executor.runner.pooler_config
        if pooler is None or self.encoder is None:
            raise ValueError("scoring needs a pooling model with a tokenizer")
        if pooler.task == "classify":
            if pooler.num_labels != 1:
                raise ValueError(f"this classifier has {pooler.num_labels} labels: scoring needs one")
            pairs = [encode_pair(self.encoder.tokenizer, query, document) for document in documents]
            return [out.data[0] for out in self.embed(pairs, use_tqdm)]
        first, *rest = self.embed([query, *documents], use_tqdm)
        return [cosine(first.data, out.data) for out in rest]

    def _check_loras(self, loras: list[LoRARequest | None]) -> None:
        """Every adapter named, checked before anything runs (a ValueError, as the API's 400)."""
        named = {lora.key: lora for lora in loras if lora is not None}
        if named and not self.config.enable_lora:
            raise ValueError("a LoRA request needs LLM(..., enable_lora=True)")
        shapes = target_shapes(self.executor.runner.hf_config)
        for lora in named.values():
            read_adapter(lora.lora_path, self.config.max_lora_rank, shapes)

    def _completion(self, index: int, out) -> CompletionOutput:
        samples = [
            Sample(self.encoder.decode(list(seq.token_ids)) if self.encoder else None, list(seq.token_ids),
                   seq.cumulative_logprob, seq.finish_reason, list(seq.logprobs) if seq.logprobs is not None else None)
            for seq in sorted(out.outputs, key=lambda seq: seq.index)
        ]
        first = samples[0]
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs)
        return CompletionOutput(
            index, list(out.prompt_token_ids), first.text, first.token_ids, first.finish_reason,
            first.cumulative_logprob, first.logprobs, samples, prompt_logprobs, out.num_cached_tokens, out.pooled,
        )

    def _prompt_logprobs(self, prompt_token_ids: list[int], entries: list) -> list[dict[int, Logprob] | None]:
        def text(token_id: int) -> str | None:
            return self.encoder.tokenizer.decode([token_id]) if self.encoder else None

        shaped: list[dict[int, Logprob] | None] = []
        for token_id, entry in zip(prompt_token_ids, entries):
            if entry is None:
                shaped.append(None)
                continue
            logprob, rank, top = entry
            one = {token_id: Logprob(logprob, rank, text(token_id))}
            for i, (top_id, top_logprob) in enumerate(top):
                one.setdefault(top_id, Logprob(top_logprob, i + 1, text(top_id)))
            shaped.append(one)
        return shaped


def _has_image(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") == "image_url" for part in content)


def _template_message(message: dict) -> dict:
    """A chat message as multimodal templates take it: with an `image_url` part, its parts in
    order, an image as `{"type": "image", "url": ...}` (gateway/multimodal.py loads it)."""
    if not _has_image(message):
        return message
    content = message["content"]
    return {**message, "content": [{"type": "image", "url": part["image_url"]["url"]} if part["type"] == "image_url"
                                   else part for part in content]}


class GroupExecutor:
    """Rank 0's Executor in the offline engine's group: each plan goes to the other ranks first."""

    def __init__(self, executor: Executor, ranks: RankProcesses) -> None:
        self.executor = executor
        self.ranks = ranks

    def execute(self, plan: StepPlan) -> StepResult:
        self.launch(plan)
        return self.finish()

    def launch(self, plan: StepPlan) -> None:
        """The other ranks take the plan, then rank 0 launches it (each collective in plan order).
        The other ranks execute each plan whole, so the plan's broadcast waits until they finished
        the one before: rank 0 overlaps its own host work only (correct, little gained)."""
        self.ranks.check_usable()
        self.executor.group.broadcast_bytes(encode(plan))
        with self._breaking():
            self.executor.launch(plan)

    def finish(self) -> StepResult:
        with self._breaking():
            return self.executor.finish()

    @contextlib.contextmanager
    def _breaking(self):
        try:
            yield
        except BaseException:  # the others may wait in a collective rank 0 never reaches
            self.ranks.state["broken"] = True
            raise


class RankProcesses:
    """Ranks 1..N-1 of the offline engine's group, as child processes rendezvousing with rank 0
    (this process) at a free local port. They load while rank 0 does; `stop` ends them.

    They are forked by a multiprocessing forkserver that imported worker.tp_rank (torch, the
    model) once for the life of this process: a rank starts without importing them again, and
    never from a process that initialized CUDA."""

    def __init__(self, config: EngineConfig) -> None:
        from common.models import resolve_model
        from worker.loader import load_config
        from worker.models import check_shardable
        from worker.model_runner import resolve_device

        source = resolve_model(config.model, config.revision, config.download_dir)
        check_shardable(load_config(source), config.tensor_parallel_size)  # before any start
        self.config = config
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        device = resolve_device(config.device, 0)
        _check_one_gpu_per_rank(device, config.tensor_parallel_size)
        self.group = TensorParallelGroup(0, config.tensor_parallel_size, self.address, device,
                                         OFFLINE_TIMEOUT_S)  # hosts the store before the others look for it
        # the ranks share the cores unless OMP_NUM_THREADS says otherwise
        self.num_threads = int(os.environ.get("OMP_NUM_THREADS")
                               or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        self.procs: list[tuple[multiprocessing.Process, Connection]] = []  # (rank, the end it says ready on)
        self.state = {"broken": False}  # a step failed on rank 0: the others cannot be told to stop
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.group, self.state)
        # the first start waits for the forkserver's imports: meanwhile rank 0 loads (start_first)
        self._start_error: BaseException | None = None
        self._starter = threading.Thread(target=self._start_ranks, name="pagoda-tp-start", daemon=True)
        self._starter.start()

    def check_usable(self) -> None:
        """After a step failed on rank 0 the others wait in a collective rank 0 never reached:
        nothing more can be said to them."""
        if self.state["broken"]:
            raise RuntimeError("a step failed on rank 0 of the tensor-parallel group, which cannot go on: "
                               "close this LLM and build a new one")

    def _start_ranks(self) -> None:
        try:
            self._fork_ranks()
        except BaseException as exc:  # raised by start_first
            self._start_error = exc

    def _fork_ranks(self) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["worker.tp_rank"])
        for rank in range(1, self.config.tensor_parallel_size):
            ready, ready_child = context.Pipe(duplex=False)
            proc = context.Process(target=serve_rank, name=f"pagoda-tp-rank{rank}", daemon=True,
                                   args=(rank, self.address, dataclasses.asdict(self.config), ready_child,
                                         self.num_threads, logging.getLogger().getEffectiveLevel()))
            proc.start()
            ready_child.close()
            self.procs.append((proc, ready))

    def start_first(self) -> Executor:
        """Rank 0's Executor, once every rank has loaded and the group has formed."""
        try:
            executor = Executor(self.config, self.group)
            self._starter.join()
            if self._start_error is not None:
                raise self._start_error
            for rank, (proc, ready) in enumerate(self.procs, 1):
                try:
                    ready.recv()
                except EOFError:  # it exited
                    proc.join()
                    raise RuntimeError(f"tensor-parallel rank {rank} exited while loading (code {proc.exitcode}, its "
                                       "error above; a script must build LLM(tensor_parallel_size > 1) under "
                                       "`if __name__ == \"__main__\":`, as multiprocessing asks)") from None
            executor.form_group(0)
        except BaseException:
            self._starter.join()  # every process started is in self.procs before stop looks
            self.stop()
            raise
        self.executor = executor
        return executor

    def group_hello(self):
        """Rank 0's hello with the group's pool sizes: the smallest any rank holds."""
        hello = self.executor.hello()
        num_gpu_blocks, num_cpu_blocks, max_model_len = self.group.min_over_ranks(
            hello.num_gpu_blocks, hello.num_cpu_blocks, hello.max_model_len)
        return dataclasses.replace(hello, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                   max_model_len=max_model_len)

    def stop(self) -> None:
        self._finalizer()


def _check_one_gpu_per_rank(device, world_size: int) -> None:
    """Two ranks on one GPU would fail in NCCL's set-up with a message about duplicate GPUs."""
    import torch

    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} needs a GPU per rank; "
                         f"{torch.cuda.device_count()} visible")


def _stop(procs: list[tuple[multiprocessing.Process, Connection]], group: TensorParallelGroup, state: dict) -> None:
    """Tell the ranks to stop (if the group formed and works; else end them), then make sure they did."""
    told = False
    if group.generation is not None and not state["broken"] and all(proc.is_alive() for proc, _ in procs):
        try:
            group.broadcast_bytes(STOP)
            told = True
        except Exception as exc:  # a broken group: they are ended below
            log.warning("stopping the tensor-parallel ranks: %s", exc)
    for proc, ready in procs:
        if not told and proc.is_alive():
            proc.terminate()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        ready.close()
    group.destroy()
    if get_tp_group() is group:  # this process's layers reduce over no group now: a later model is one rank's
        set_tp_group(TensorParallelGroup())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
