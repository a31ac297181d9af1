"""Whether a request can ever be served: one rule, called by the gateway (400 before queueing)
and by the scheduler (a request from elsewhere), so the two never disagree.

A request that passes may still wait for room; one that fails would wait forever: its prompt
plus `max_tokens` exceeds the context, its sequences need more KV blocks than the whole pool,
or it runs more sequences at once than a step may hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.protocol import SamplingParams, SchedulerStatus


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What one scheduler can ever hold, as its status publishes it."""

    max_model_len: int
    block_size: int
    max_request_tokens: int  # the KV pool less the watermark the scheduler's `allocate` keeps, in tokens
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    pooling_task: str = ""  # a pooling model's task ("embed", "classify"; common/pooling.py), "" for generation

    @classmethod
    def of_status(cls, status: SchedulerStatus) -> AdmissionLimits:
        return cls(status.max_model_len, status.block_size, status.max_request_tokens, status.max_num_seqs,
                   status.max_num_batched_tokens, status.enable_chunked_prefill, status.pooling_task)

    @classmethod
    def strictest(cls, statuses: list[SchedulerStatus]) -> AdmissionLimits:
        """Limits every one of these schedulers meets: any of them may read the request."""
        limits = [cls.of_status(s) for s in statuses]
        return cls(
            max_model_len=min(x.max_model_len for x in limits), block_size=max(x.block_size for x in limits),
            max_request_tokens=min(x.max_request_tokens for x in limits),
            max_num_seqs=min(x.max_num_seqs for x in limits),
            max_num_batched_tokens=min(x.max_num_batched_tokens for x in limits),
            enable_chunked_prefill=all(x.enable_chunked_prefill for x in limits),
            # groups serving different kinds of model serve no request that any of them may read
            pooling_task=limits[0].pooling_task if len({x.pooling_task for x in limits}) == 1 else "mixed",
        )


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request can never be served. `param` is the request field to change: `where` (the
    prompt or the messages), or the field that asks for the sequences (n, best_of)."""

    message: str
    param: str
    code: str | None = None


def num_seqs(params: SamplingParams) -> int:
    """The sequences a request runs at once: its beams, its best_of samples, or its n samples."""
    return params.beam_width or params.best_of or params.n


def sequences_param(params: SamplingParams) -> str:
    """The request field that asks for its sequences: the one to lower when there are too many."""
    return "best_of" if params.best_of or params.beam_width > params.n else "n"  # beam width: best_of at the API


def check_admissible(
    num_prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits, where: str = "prompt",
) -> Rejection | None:
    """None when the request fits; else the first limit it breaks, in this order: an empty prompt,
    the KV pool, the context length, the step's token budget (without chunked prefill), the step's sequences."""
    if num_prompt_tokens < 1:
        return Rejection(f"the {where} is empty", where)
    return (_check_runner(params, limits)
            or _check_kv_pool(num_prompt_tokens, params, limits, where)
            or _check_context(num_prompt_tokens, params, limits, where)
            or _check_step(num_prompt_tokens, params, limits, where))


def _check_runner(params: SamplingParams, limits: AdmissionLimits) -> Rejection | None:
    """A pooling request to an engine of its task, a generation to a generative one."""
    task = params.pooling.task if params.pooling is not None else ""
    if task == limits.pooling_task:
        return None
    served = f"a pooling model ({limits.pooling_task})" if limits.pooling_task else "a generative model"
    asked = f"pooling ({task})" if task else "generation"
    return Rejection(f"the engine serves {served}, and this request asks for {asked}", "model", "wrong_model_kind")


def final_len(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """The most tokens a sequence of this request may reach (max_tokens None: the rest of the context;
    0: the prompt alone)."""
    max_tokens = params.max_tokens
    return min(num_prompt_tokens + (max_model_len if max_tokens is None else max_tokens), max_model_len)


def _check_kv_pool(num_prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits, where: str):
    length, seqs = final_len(num_prompt_tokens, params, limits.max_model_len), num_seqs(params)
    # each sequence whole: a group preempted by recompute comes back with nothing shared
    needed = seqs * -(-length // limits.block_size) * limits.block_size
    if needed <= limits.max_request_tokens:
        return None
    pool = f"more than the server's whole pool ({limits.max_request_tokens} tokens)"
    if seqs == 1:
        return Rejection(f"the request needs up to {length} tokens of KV cache, {pool}; shorten the {where} or "
                         "lower max_tokens", where, "kv_cache_exceeded")
    return Rejection(f"the request's {seqs} sequences need up to {needed} tokens of KV cache, {pool}; shorten the "
                     f"{where}, lower max_tokens or lower {sequences_param(params)}", where, "kv_cache_exceeded")


def _check_context(num_prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits, where: str):
    max_tokens, max_model_len = params.max_tokens, limits.max_model_len
    needed = num_prompt_tokens + (1 if max_tokens is None else max_tokens)  # 0: the prompt alone (scoring)
    if needed <= max_model_len:
        return None
    asked = f"{num_prompt_tokens} in the {where}" + (f", {max_tokens} for the completion" if max_tokens else "")
    return Rejection(f"this model's maximum context length is {max_model_len} tokens, but the request needs {needed} "
                     f"({asked}); shorten the {where} or lower max_tokens", where, "context_length_exceeded")


def _check_step(num_prompt_tokens: int, params: SamplingParams, limits: AdmissionLimits, where: str):
    if not limits.enable_chunked_prefill and num_prompt_tokens > limits.max_num_batched_tokens:
        return Rejection(f"the {where} ({num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
                         f"({limits.max_num_batched_tokens}) and chunked prefill is off; shorten the {where}", where)
    seqs, param = num_seqs(params), sequences_param(params)
    step = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    if seqs > step:
        return Rejection(f"the request runs {seqs} sequences at once, more than one step holds ({step}: the "
                         f"server's max_num_seqs is {limits.max_num_seqs}, its max_num_batched_tokens "
                         f"{limits.max_num_batched_tokens}); lower {param}", param)
    return None
