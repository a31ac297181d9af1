"""The one admission rule (common/admission.py): its exact edges, and the same verdict whether the
gateway checks a request against a scheduler's published status or the scheduler checks it itself."""
from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.admission import AdmissionLimits, Rejection, check_admissible
from common.config import EngineConfig
from common.protocol import SamplingParams, SchedulerStatus
from gateway.app import Gateway
from gateway.openai_api import APIError, ParsedRequest
from scheduler.scheduler import RequestRejected, Scheduler

LIMITS = AdmissionLimits(max_model_len=256, block_size=16, max_request_tokens=1024, max_num_seqs=8,
                         max_num_batched_tokens=512, enable_chunked_prefill=True)


def check(num_prompt_tokens: int, limits: AdmissionLimits = LIMITS, where: str = "prompt", **params):
    return check_admissible(num_prompt_tokens, SamplingParams(**params), limits, where)


# ----------------------------------------------------------------------------- edges


def test_the_prompt_plus_max_tokens_may_fill_the_context_exactly():
    assert check(250, max_tokens=6) is None
    assert check(250, max_tokens=7) == Rejection(
        "this model's maximum context length is 256 tokens, but the request needs 257 (250 in the prompt, 7 for the "
        "completion); shorten the prompt or lower max_tokens", "prompt", "context_length_exceeded")


def test_without_max_tokens_the_prompt_must_leave_one_token_of_context():
    assert check(255, max_tokens=None) is None
    assert check(256, max_tokens=None, where="messages") == Rejection(
        "this model's maximum context length is 256 tokens, but the request needs 257 (256 in the messages); "
        "shorten the messages or lower max_tokens", "messages", "context_length_exceeded")


def test_one_sequence_may_fill_the_pool_exactly_counting_whole_blocks():
    limits = dataclasses.replace(LIMITS, max_request_tokens=96)  # 6 blocks of 16
    assert check(90, limits, max_tokens=6) is None  # 96 tokens
    assert check(90, limits, max_tokens=7) == Rejection(
        "the request needs up to 97 tokens of KV cache, more than the server's whole pool (96 tokens); shorten the "
        "prompt or lower max_tokens", "prompt", "kv_cache_exceeded")
    assert check(90, limits, max_tokens=None) is not None  # up to the 256-token context


def test_a_group_counts_each_sequence_in_whole_blocks():
    limits = dataclasses.replace(LIMITS, max_request_tokens=192)  # 12 blocks of 16
    assert check(20, limits, max_tokens=12, best_of=4) is None  # 32 tokens: 4 x 2 blocks
    assert check(20, limits, max_tokens=28, best_of=4) is None  # 48 tokens: 4 x 3 blocks, the whole pool
    assert check(20, limits, max_tokens=29, best_of=4) == Rejection(  # 49 tokens: 4 blocks each
        "the request's 4 sequences need up to 256 tokens of KV cache, more than the server's whole pool (192 tokens); "
        "shorten the prompt, lower max_tokens or lower best_of", "prompt", "kv_cache_exceeded")
    assert check(20, limits, max_tokens=29, n=2, beam_width=4) is not None


def test_the_kv_pool_is_checked_before_the_context():
    limits = dataclasses.replace(LIMITS, max_request_tokens=64)
    assert check(300, limits, max_tokens=1).code == "kv_cache_exceeded"


def test_an_empty_prompt_is_rejected():
    assert check(0, where="messages") == Rejection("the messages is empty", "messages")


def test_without_chunked_prefill_the_prompt_must_fit_one_step():
    limits = dataclasses.replace(LIMITS, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert check(128, limits, max_tokens=1) is None
    assert check(129, limits, max_tokens=1) == Rejection(
        "the prompt (129 tokens) exceeds max_num_batched_tokens (128) and chunked prefill is off; shorten the prompt",
        "prompt")


def test_a_request_may_run_at_most_max_num_seqs_sequences():
    assert check(1, best_of=8, max_tokens=1) is None
    assert check(1, best_of=9, max_tokens=1) == Rejection(
        "the request runs 9 sequences at once, more than one step holds (8: the server's max_num_seqs is 8, its "
        "max_num_batched_tokens 512); lower best_of", "best_of")
    assert check(1, n=9, max_tokens=1).param == "n"
    assert check(1, n=9, beam_width=9, max_tokens=1).param == "n"  # the beam width came from n
    assert check(1, n=2, beam_width=9, max_tokens=1).param == "best_of"
    few_tokens = dataclasses.replace(LIMITS, max_num_batched_tokens=4)
    assert check(1, best_of=5, max_tokens=1, limits=few_tokens).param == "best_of"


def test_several_schedulers_admit_what_every_one_of_them_can_serve():
    small = status(max_model_len=128, block_size=8, max_request_tokens=4096, max_num_seqs=64,
                   max_num_batched_tokens=4096, enable_chunked_prefill=False)
    large = status(max_model_len=512, block_size=32, max_request_tokens=1024, max_num_seqs=4,
                   max_num_batched_tokens=256, enable_chunked_prefill=True)
    assert AdmissionLimits.strictest([small, large]) == AdmissionLimits(128, 32, 1024, 4, 256, False)
    assert AdmissionLimits.of_status(large) == AdmissionLimits(512, 32, 1024, 4, 256, True)


# ----------------------------------------------------------------------------- gateway == scheduler


def status(**limits) -> SchedulerStatus:
    """A ready scheduler's status carrying these limits, as scheduler/server.py publishes it."""
    return SchedulerStatus(
        scheduler_id="s", model="m", num_gpu_blocks=0, workers_ready=True, num_running=0, num_waiting=0,
        num_swapped=0, kv_cache_usage=0.0, num_preemptions_total=0, prefix_cache_queries_total=0,
        prefix_cache_hits_total=0, updated_at=time.time(), **limits)


def gateway_verdict(scheduler: Scheduler, prompt_len: int, params: SamplingParams) -> str | None:
    parsed = ParsedRequest("completion", None, [[7] * prompt_len], params, params.n)
    try:
        Gateway._check_admissible(parsed, [status(**dataclasses.asdict(scheduler.admission_limits))])
    except APIError as exc:
        assert exc.status == 400 and exc.type == "invalid_request_error"
        return exc.message
    return None


def scheduler_verdict(scheduler: Scheduler, prompt_len: int, params: SamplingParams) -> str | None:
    try:
        scheduler.add_request("r", [7] * prompt_len, params)
    except RequestRejected as exc:
        return str(exc)
    return None


@st.composite
def requests(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(1, 300))
    max_num_batched_tokens = draw(st.integers(1, 400)) if chunked else draw(st.integers(max_model_len, 400))
    config = EngineConfig(block_size=block_size, max_num_seqs=draw(st.integers(1, 16)),
                          max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked,
                          max_model_len=max_model_len)
    num_gpu_blocks = draw(st.integers(2, 200))
    kind = draw(st.sampled_from(["n", "best_of", "beam"]))
    n = draw(st.integers(1, 6))
    width = draw(st.integers(n, 12))
    max_tokens = draw(st.one_of(st.none(), st.integers(1, max_model_len + 8)))
    params = SamplingParams(
        n=n if kind != "n" else width, best_of=width if kind == "best_of" else None,
        beam_width=width if kind == "beam" else 0, max_tokens=max_tokens, temperature=0.0 if kind == "beam" else 1.0)
    return config, num_gpu_blocks, max_model_len, draw(st.integers(1, max_model_len + 8)), params


@settings(max_examples=400, deadline=None)
@given(requests())
def test_the_gateway_and_the_scheduler_give_the_same_verdict(request):
    config, num_gpu_blocks, max_model_len, prompt_len, params = request
    scheduler = Scheduler(config, num_gpu_blocks, max_model_len, [0])
    verdict = gateway_verdict(scheduler, prompt_len, params)
    assert verdict == scheduler_verdict(scheduler, prompt_len, params)
    assert ("r" in scheduler.groups) == (verdict is None)


@pytest.mark.parametrize("prompt_len, max_tokens, admitted", [(60, 4, True), (60, 5, False), (63, None, True),
                                                              (64, None, False)])
def test_both_paths_meet_at_the_context_edge(prompt_len, max_tokens, admitted):
    scheduler = Scheduler(EngineConfig(max_model_len=64), 64, 64, [0])
    params = SamplingParams(max_tokens=max_tokens)
    assert gateway_verdict(scheduler, prompt_len, params) == scheduler_verdict(scheduler, prompt_len, params)
    assert ("r" in scheduler.groups) == admitted
