"""Scoring: prompt logprobs (vLLM's `prompt_logprobs`) and max_tokens 0.

The worker scores each prompt token by the logits of the position before it, through chunked
prefill; the scheduler collects them per request, never serves such a request from the prefix cache,
and finishes a max_tokens 0 request after its prefill with no token.
"""
import pytest
import torch

from common.protocol import SamplingParams
from tests.prompts import PARITY_PROMPTS

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
K = 3


@pytest.fixture(scope="module")
def llm(one_torch_thread, request):
    """The default model in float32 with prefix caching (its default): on CPU tests/conftest.py's
    session engine, reset; on a CUDA host one of its own there (device auto)."""
    import torch

    from pagoda.offline import LLM

    if torch.cuda.is_available():
        return LLM("default", dtype="float32", enable_prefix_caching=True)
    llm = request.getfixturevalue("default_llm")
    llm.reset()
    return llm


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.encode(PROMPT)


@pytest.fixture(scope="module")
def hf_logprobs(llm, prompt_ids):
    """transformers' float32 log_softmax of each position's logits: [len(prompt) - 1, vocab], row i
    scoring prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    from worker.loader import hf_directory

    model = AutoModelForCausalLM.from_pretrained(hf_directory(llm.executor.runner.source), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _score(llm, prompt_ids, **params):
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, prompt_logprobs=K, **params), use_tqdm=False)[0]
    return out


def _check_against_hf(prompt_logprobs, prompt_ids, hf):
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], prompt_logprobs[1:]), start=1):
        row = hf[position - 1]
        own = entry[token_id]
        assert abs(own.logprob - row[token_id].item()) < 1e-4
        assert own.rank == 1 + int((row > row[token_id]).sum())  # ties within 1e-4 would make this flaky: none here
        top_ids = row.topk(K).indices.tolist()
        assert list(entry) == [token_id] + [t for t in top_ids if t != token_id]  # its own, then the top K
        for rank, t in enumerate(top_ids, start=1):
            assert abs(entry[t].logprob - row[t].item()) < 1e-4
            assert entry[t].rank == rank


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers(llm, prompt_ids, hf_logprobs, monkeypatch):
    monkeypatch.setattr("worker.prompt_logprobs.ROW_CHUNK", 4)  # the logits a few rows at a time
    llm.reset()
    out = _score(llm, prompt_ids, max_tokens=0)
    _check_against_hf(out.prompt_logprobs, prompt_ids, hf_logprobs)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert all(entry[t].decoded_token == llm.encoder.tokenizer.decode([t])
               for t, entry in zip(prompt_ids[1:], out.prompt_logprobs[1:]))


@pytest.mark.slow
def test_chunked_prefill_scores_every_token_once(llm, prompt_ids, hf_logprobs):
    """Chunks of 7 tokens: each chunk's last position scores the next chunk's first token."""
    llm.reset(max_num_batched_tokens=7)
    chunked = _score(llm, prompt_ids, max_tokens=2)
    assert llm.engine.num_steps >= -(-len(prompt_ids) // 7) + 1
    _check_against_hf(chunked.prompt_logprobs, prompt_ids, hf_logprobs)
    llm.reset()
    whole = _score(llm, prompt_ids, max_tokens=2)
    assert chunked.token_ids == whole.token_ids and len(whole.token_ids) == 2
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


@pytest.mark.slow
def test_prefix_cache_is_not_used_for_prompt_logprobs(llm, prompt_ids):
    """The same prompt again: a plain request hits the cache, one asking for prompt logprobs
    computes every position (no hit counted, fresh blocks), and still gets every logprob."""
    llm.reset()
    scheduler = llm.scheduler
    block_size = scheduler.block_manager.block_size
    llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    full_blocks = len(prompt_ids) // block_size
    assert full_blocks >= 1 and scheduler.block_manager.num_cached_blocks >= full_blocks
    cached = set(scheduler.block_manager.cached_blocks.values())
    queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
    assert (queries, hits) == (len(prompt_ids), 0)

    tables = []
    original = scheduler.block_manager.allocate

    def allocate(seq_id, num_tokens, token_ids=None, final_tokens=None, salt=None, **kwargs):
        computed = original(seq_id, num_tokens, token_ids, final_tokens, salt, **kwargs)
        tables.append((computed, list(scheduler.block_manager.block_table(seq_id))))
        return computed

    scheduler.block_manager.allocate = allocate
    out = _score(llm, prompt_ids, max_tokens=0)
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (queries, hits)
    [(computed, table)] = tables
    assert computed == 0 and not set(table) & cached
    assert all(entry is not None for entry in out.prompt_logprobs[1:])

    llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # a hit again
    assert scheduler.prefix_cache_hits == hits + full_blocks * block_size
    assert tables[1][0] == full_blocks * block_size and set(tables[1][1][:full_blocks]) <= cached


@pytest.mark.slow
def test_max_tokens_0_finishes_with_no_token_and_frees_every_block(llm, prompt_ids):
    llm.reset(enable_prefix_caching=False, async_scheduling=False)
    free = llm.scheduler.block_manager.num_free_blocks
    params = [SamplingParams(max_tokens=0, prompt_logprobs=0), SamplingParams(max_tokens=0, n=3, prompt_logprobs=1)]
    outs = llm.generate([prompt_ids, llm.encode(PARITY_PROMPTS[0])], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [[], []]
    assert [[(s.token_ids, s.finish_reason) for s in o.outputs] for o in outs] == [
        [([], "length")], [([], "length")] * 3]
    assert all(len(entry) == 1 for entry in outs[0].prompt_logprobs[1:])  # k 0: the token's own entry only
    assert llm.scheduler.block_manager.num_free_blocks == free
    assert not llm.scheduler.has_unfinished_requests() and llm.engine.num_steps == 1


@pytest.mark.slow
def test_max_tokens_0_under_async_scheduling_is_never_run_ahead(llm, prompt_ids):
    llm.reset(async_scheduling=True, enable_prefix_caching=False)
    free = llm.scheduler.block_manager.num_free_blocks
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason, out.prompt_logprobs) == ([], "length", None)
    assert llm.scheduler.block_manager.num_free_blocks == free


def test_a_tensor_parallel_group_scores_as_one_rank_does(one_torch_thread, monkeypatch):
    """Every rank computes the scored rows' logits alike (a gather per chunk of ROW_CHUNK rows);
    rank 0's prompt logprobs equal one rank's, through chunked prefill, for a prompt of two chunks."""
    import random

    from pagoda.offline import LLM
    from tests.conftest import TINY_LLAMA

    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(300)]  # > ROW_CHUNK (256) scored rows in one step
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    kwargs = dict(skip_tokenizer_init=True, device="cpu", num_gpu_blocks=64, num_cpu_blocks=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # per rank
    group = LLM(f"dummy:{TINY_LLAMA}", tensor_parallel_size=2, **kwargs)
    try:
        outs = [group.generate([prompt], params, use_tqdm=False)[0]]
        group.reset(max_num_batched_tokens=100)
        outs.append(group.generate([prompt], params, use_tqdm=False)[0])
    finally:
        group.close()
    expected = LLM(f"dummy:{TINY_LLAMA}", **kwargs).generate([prompt], params, use_tqdm=False)[0]
    for out in outs:
        assert out.token_ids == expected.token_ids and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            assert list(got) == list(want) and [e.rank for e in got.values()] == [e.rank for e in want.values()]
            assert [e.logprob for e in got.values()] == pytest.approx([e.logprob for e in want.values()], abs=1e-4)


def test_a_group_preempted_mid_prefill_keeps_the_positions_it_scored(one_torch_thread):
    """A later request preempted (recompute) after its first chunk scores its prompt again from
    the start: the positions it held are kept, the rest filled, as a run without preemption gives."""
    import random

    from pagoda.offline import LLM
    from tests.conftest import TINY_LLAMA

    rng = random.Random(0)
    decoding, scored = [rng.randrange(3, 500) for _ in range(8)], [rng.randrange(3, 500) for _ in range(60)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)]
    llm = LLM(f"dummy:{TINY_LLAMA}", skip_tokenizer_init=True, device="cpu", block_size=8, num_gpu_blocks=64,
              num_cpu_blocks=0, max_num_batched_tokens=16, async_scheduling=False, enable_prefix_caching=False)
    expected = llm.generate([decoding, scored], params, use_tqdm=False)
    llm.reset(num_gpu_blocks=10)  # the decoding request's growth preempts the scored one mid-prefill
    scheduler, preempted = llm.scheduler, []
    preempt = scheduler._preempt

    def record(group, plan):
        preempted.append((group.request_id, group.seqs[0].num_computed_tokens, group.num_prompt_logprobs_missing))
        preempt(group, plan)

    scheduler._preempt = record
    outs = llm.generate([decoding, scored], params, use_tqdm=False)
    assert [(missing, computed) for _, computed, missing in preempted] == [(59 - 8, 8)]
    assert outs[0].token_ids == expected[0].token_ids
    for got, want in zip(outs[1].prompt_logprobs[1:], expected[1].prompt_logprobs[1:]):
        assert list(got) == list(want) and [e.rank for e in got.values()] == [e.rank for e in want.values()]
        assert [e.logprob for e in got.values()] == pytest.approx([e.logprob for e in want.values()], abs=1e-5)
