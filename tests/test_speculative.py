"""N-gram speculative decoding: drafts verified in one forward, lossless.

The real path: the default model in full precision, speculation on and off over one loaded worker
(`LLM.reset`), so every comparison is between the same weights and kernels. Greedy and seeded
outputs must be the same tokens with and without drafts (the verifier draws position j exactly as
the plain step would), stop tokens and max_tokens end a run where they would, preemption and
aborts leave every block free, and the draws keep the target distribution (chi-square).
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.plan_state import HeldSequence, PlanState, ScheduledSequence
from common.protocol import (
    CachedSequence, NewSequence, ProtocolError, SampledToken, SamplingParams, StepPlan, StructuredOutput,
)
from common.speculative import SpeculativeConfig
from scheduler.speculation import MAX_BACKOFF_STEPS, Speculator, can_speculate
from worker.executor import _sampling_rows, _verified
from worker.sampler import Sampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# chi-square critical values at 1e-4 by degrees of freedom: a seeded test, far from flaky
CRITICAL = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513}


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert not torch.any(torch.bincount(samples, minlength=len(probs))[~support]), "a token of probability 0"
    observed = torch.bincount(samples, minlength=len(probs))[support].double()
    expected = probs[support].double() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


CODE = '''def parse_header(line):
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def parse_headers(lines):
    headers = {}
    for line in lines:
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''
COPY_PROMPTS = [{"messages": [{"role": "user", "content": ask + "\n\n" + CODE}]} for ask in (
    "Repeat this code exactly:", "Add a docstring to each function of this code:",
    "Rename parse_header to split_header in this code:")]
MAX_TOKENS = 40


# ----------------------------------------------------------------------------- config


def test_the_flag_takes_vllms_json_and_refuses_what_it_cannot_run():
    config = EngineConfig(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 5}))
    assert config.speculative == SpeculativeConfig("ngram", 3, prompt_lookup_max=5)
    assert EngineConfig(speculative_config=NGRAM).speculative_config == json.dumps(NGRAM, sort_keys=True)
    assert EngineConfig().speculative is None
    for bad, words in [("{", "not JSON"), ('{"method": "medusa"}', "must be one of"),
                       ('{"method": "eagle3"}', 'needs "model"'),
                       ('{"num_speculative_tokens": 0}', r"in \[1, 16\]"), ('{"k": 1}', "unknown"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <=")]:
        with pytest.raises(ConfigError, match=words):
            EngineConfig(speculative_config=bad)


def test_beam_search_does_not_speculate():
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, seed=1, logit_bias=[[5, 1.0]]))
    assert can_speculate(SamplingParams(presence_penalty=0.5, repetition_penalty=1.1))
    assert can_speculate(SamplingParams(structured_output=StructuredOutput("regex", "[ab]+")))
    assert not can_speculate(SamplingParams(beam_width=2, temperature=0))


def test_adaptive_length_backs_off_on_misses_and_recovers_on_acceptance():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert spec.propose(7, tokens, most=8, num_running=1, step=1) == [4, 5, 1, 2]
    spec.record(7, 4, 2, step=1)  # 2 of 4 accepted: try 3 next
    assert spec.propose(7, tokens, most=8, num_running=1, step=2) == [4, 5, 1]
    spec.record(7, 3, 0, step=2)
    assert spec.wants(7, 3)  # one miss: go on with one draft
    assert spec.propose(7, tokens, most=8, num_running=1, step=3) == [4]
    spec.record(7, 1, 0, step=3)  # two misses in a row: 2 steps without drafts
    assert not spec.wants(7, 4) and spec.propose(7, tokens, most=8, num_running=1, step=4) == []
    assert spec.wants(7, 5)
    assert spec.propose(7, [9, 8], most=8, num_running=1, step=5) == []  # no match: a third miss, 4 steps
    assert not spec.wants(7, 8) and spec.wants(7, 9)
    spec.record(7, 1, 1, step=9)  # all accepted: back to the full length
    assert spec.propose(7, tokens, most=8, num_running=1, step=10) == [4, 5, 1, 2]
    assert spec.propose(7, tokens, most=2, num_running=1, step=10) == [4, 5]  # max_tokens, budget
    assert spec.propose(7, tokens, most=8, num_running=32, step=10) == [4]  # a batch of 32: 4 * 8 // 32
    for step in range(11, 40):
        spec.record(7, 1, 0, step=step)
    assert not spec.wants(7, 38 + MAX_BACKOFF_STEPS) and spec.wants(7, 39 + MAX_BACKOFF_STEPS)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (33, 38, 3)
    assert spec.accepted_per_pos == [2, 1, 0, 0]


def test_step_cost_fits_fixed_plus_per_token_and_per_emitted_and_prices_a_draft_token():
    from scheduler.speculation import StepCost

    steps = [(32, 40), (64, 50), (48, 60), (64, 70), (32, 36), (96, 80)]  # (computed, emitted)
    cost = StepCost(decay=1.0, min_steps=6)
    for n, e in steps[:5]:
        cost.observe(n, 0.080 + 0.002 * n + 0.001 * e, emitted=e)
    assert cost.per_token is None  # too few steps
    n, e = steps[5]
    cost.observe(n, 0.080 + 0.002 * n + 0.001 * e, emitted=e)
    assert cost.per_token == pytest.approx(0.002)  # the emitted tokens' own millisecond apart
    seconds = sum(0.080 + 0.002 * n + 0.001 * e for n, e in steps)
    assert cost.price() == pytest.approx(0.002 * sum(e for _, e in steps) / seconds)
    same = StepCost(decay=1.0, min_steps=2)
    for _ in range(5):
        same.observe(32, 0.1, emitted=32)
    assert same.per_token is None and same.price() is None  # one size: no slope
    tracking = StepCost(decay=1.0, min_steps=2)
    for n in (32, 64, 48, 96):
        tracking.observe(n, 0.1 + 0.003 * n, emitted=n // 2)
    assert tracking.per_token is None  # emitted follows computed exactly: the two slopes are one
    kept = StepCost(decay=0.5, min_steps=4)
    for n, e in steps:
        kept.observe(n, 0.080 + 0.002 * n + 0.001 * e, emitted=e)
    known = kept.price()
    for _ in range(40):  # priced lengths make the steps alike: the fit fades, its last price stays
        kept.observe(64, 0.2, emitted=50)
    assert kept.per_token is None and kept.price() == known
    free = StepCost(decay=1.0, min_steps=2)
    for n, e in ((1, 2), (5, 3), (1, 1), (5, 5)):
        free.observe(n, 0.010, emitted=e)  # a GPU at batch 1: the drafts cost nothing
    assert free.per_token == pytest.approx(0, abs=1e-12) and free.price() == pytest.approx(0, abs=1e-9)


def test_drafts_worth_their_price():
    from scheduler.speculation import drafts_worth

    assert drafts_worth(0.8, 0.3) == 5  # 0.8^5 = 0.33 > 0.3 > 0.8^6 = 0.26
    assert drafts_worth(0.5, 0.3) == 1 and drafts_worth(0.3, 0.3) == 0 and drafts_worth(0.2, 0.5) == 0
    assert drafts_worth(0.5, 0.25) == 1  # 0.5^2 is not above 0.25
    assert drafts_worth(0.9, 0.0) >= 16 and drafts_worth(1.0, 0.5) >= 16


def test_a_priced_batch_gives_the_drafts_to_the_sequences_that_gain_from_them():
    """Past FREE_BATCH running, with the step cost known, a sequence drafts while its acceptance
    rate to the power j beats the price of a token; without it, FREE_BATCH / running (at least 1)."""
    from scheduler.speculation import StepCost

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    for seq_id, accepted in ((1, 4), (2, 1)):  # 1 accepts every draft, 2 one of four, twice
        spec.propose(seq_id, tokens, most=8, num_running=1, step=1)
        spec.record(seq_id, 4, accepted, step=1)
        spec.record(seq_id, 4, accepted, step=2)
    assert spec.propose(1, tokens, most=8, num_running=32, step=4) == [4]  # no price yet: 4 * 8 // 32
    spec.cost.observe(64, 0.2, emitted=40)
    assert spec.propose(1, tokens, most=8, num_running=32, step=4) == [4, 5]  # and one more every other verify step
    spec.cost = StepCost(decay=1.0)
    for n, e in ((32, 36), (64, 44), (32, 44), (64, 36)) * 4:  # 2 ms a token computed, 80 fixed: price 0.45
        spec.cost.observe(n, 0.080 + 0.002 * n, emitted=e)
    assert spec.cost.price() == pytest.approx(0.002 * 40 / 0.176)
    # seq 1: alpha = (1.4 x 0.64 + 4 x 0.8 + 4) / (2 x 0.64 + 4 x 0.8 + 4) = 0.95: 0.95^4 = 0.83 > 0.45
    assert spec.propose(1, tokens, most=8, num_running=32, step=3) == [4, 5, 1, 2]
    # seq 2: alpha = (1.4 x 0.64 + 0.8 + 1) / (2 x 0.64 + 2 x 0.8 + 2) = 0.55: one draft (0.55^2 = 0.30)
    assert spec.propose(2, tokens, most=8, num_running=32, step=3) == [4]
    assert spec.propose(2, tokens, most=8, num_running=8, step=3) == [4, 5]  # a free batch: its own length


# ----------------------------------------------------------------------------- the worker's side


def _held(tokens: list[int], num_prompt: int, computed: int, table: list[int]) -> HeldSequence:
    return HeldSequence(list(tokens), num_prompt, computed, list(table), SamplingParams(temperature=0))


def test_plan_state_computes_drafts_without_keeping_them_and_takes_the_accepted_back():
    state = PlanState(block_size=4)
    state.apply(StepPlan(1, 0, new_seqs=[NewSequence(3, [10, 11, 12], [], [1], 0, 3, SamplingParams())]))
    state.record_sampled([SampledToken(3, 13, 0.0)])
    plan = StepPlan(2, 0, cached_seqs=[CachedSequence(3, [2], 1, 4, 13, 1, [14, 15, 16])])
    (s,) = state.apply(plan)
    assert (s.num_computed_tokens, s.num_scheduled_tokens, s.num_draws, s.draft_token_ids) == (3, 4, 4, [14, 15, 16])
    held = state.seqs[3]
    assert held.token_ids == [10, 11, 12, 13] and held.num_computed_tokens == 4 and held.block_table == [1, 2]
    # 14 and 15 accepted, 20 drawn after them; the table cut back to what 6 slots need (the scheduler's)
    plan = StepPlan(3, 0, cached_seqs=[CachedSequence(3, [], 2, 1, 20, 1, [], [14, 15])])
    (s,) = state.apply(plan)
    assert held.token_ids == [10, 11, 12, 13, 14, 15, 20] and s.num_computed_tokens == 6
    with pytest.raises(ProtocolError, match="drafts follow its last token only"):
        state.apply(StepPlan(4, 0, cached_seqs=[CachedSequence(3, [], 2, 3, 21, 1, [22])]))


def test_a_row_with_drafts_keeps_the_accepted_run_and_the_first_draw_that_differs():
    held = _held([1, 2, 3], 2, 3, [1])
    rows = [ScheduledSequence(5, held, 2, 4, 1, [7, 8, 9]), ScheduledSequence(6, _held([4], 1, 1, [2]), 0, 1, 1),
            ScheduledSequence(8, held, 2, 3, 1, [7, 8])]
    assert [(r.seq_id, r.num_output_tokens) for r in _sampling_rows(rows)] == [(5, 1), (5, 2), (5, 3), (5, 4), (6, 0),
                                                                              (8, 1), (8, 2), (8, 3)]
    draws = [SampledToken(5, t, 0.0) for t in (7, 8, 4, 4)] + [SampledToken(6, 11, 0.0)] + \
            [SampledToken(8, t, 0.0) for t in (7, 8, 3)]
    assert [(s.seq_id, s.token_id) for s in _verified(rows, draws)] == [(5, 7), (5, 8), (5, 4), (6, 11), (8, 7), (8, 8),
                                                                       (8, 3)]


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_verified_draws_keep_the_target_distribution(top_p):
    """Chi-square over 12,000 sequences, temperature 1, on a 5-token vocabulary: drafts that disagree
    with the target often. The first emitted token has p_0's distribution (after top-p), and given
    that the first draft was accepted, the second has p_1's."""
    torch.manual_seed(0)
    vocab, n = 5, 12_000
    logits0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits1 = torch.tensor([-1.0, 0.0, 1.5, 0.5, 1.0])
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=100)
    held = HeldSequence([0, 1], 1, 2, [1], params)
    drafts = [[1, 2] if i % 2 else [3, 0] for i in range(n)]  # token 1 then 2 (likely), or 3 then 0 (unlikely)
    rows = [ScheduledSequence(i, held, 1, 3, 1, drafts[i]) for i in range(n)]
    logits = torch.stack([logits0, logits1, logits0] * n)  # position 2 (the bonus) is not counted here
    sampler = Sampler([vocab + 1], vocab)
    out = sampler(logits, _sampling_rows(rows))
    emitted = _verified(rows, [SampledToken(r.seq_id, t, lp) for r, t, lp in
                               zip(_sampling_rows(rows), out.token_ids, out.logprobs)])
    by_seq: dict[int, list[int]] = {}
    for s in emitted:
        by_seq.setdefault(s.seq_id, []).append(s.token_id)

    def target(logits: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(logits.double(), 0)
        order = p.argsort(descending=True)
        keep = (p[order].cumsum(0) - p[order]) < top_p
        q = torch.zeros_like(p)
        q[order[keep]] = p[order[keep]]
        return q / q.sum()

    for group in (0, 1):  # each draft pattern alone: the distribution holds whatever the drafts
        firsts = torch.tensor([by_seq[i][0] for i in range(group, n, 2)])
        p0 = target(logits0)
        assert chi_square(firsts, p0) < CRITICAL[int((p0 > 0).sum()) - 1]
    seconds = torch.tensor([by_seq[i][1] for i in range(n) if by_seq[i][0] == drafts[i][0]])
    p1 = target(logits1)
    assert len(seconds) > 1500
    assert chi_square(seconds, p1) < CRITICAL[int((p1 > 0).sum()) - 1]


# ----------------------------------------------------------------------------- the real path


@pytest.fixture(scope="module")
def llm():
    from pagoda.offline import LLM

    llm = LLM("default", quantization="none", dtype="float32", num_gpu_blocks=400)
    yield llm
    llm.close()


def _run(llm, prompts, params, speculative: bool, **config):
    llm.reset(speculative_config=NGRAM if speculative else None, **config)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked (cached blocks count free)
    return outputs


def _samples(outputs):
    return [[(s.token_ids, s.finish_reason) for s in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def plain(llm):
    """The copy prompts' greedy outputs without speculation."""
    return _samples(_run(llm, COPY_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative=False))


def test_greedy_copying_accepts_drafts_and_changes_no_token(llm, plain):
    spec = _run(llm, COPY_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative=True)
    assert _samples(spec) == plain
    s = llm.scheduler.speculator
    assert s.num_accepted_tokens > 40 and s.num_drafts > 10 and sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert llm.engine.num_steps < 0.5 * len(COPY_PROMPTS) * MAX_TOKENS  # far fewer steps than tokens


def test_seeded_samples_n_best_of_and_penalties_are_the_tokens_drawn_without_drafts(llm):
    """Each sample speculates alone; a seeded row draws at each position what it would draw there;
    the penalties at draft position j count the j drafts before it."""
    accepted = 0
    for params in (SamplingParams(n=3, temperature=0.3, top_p=0.95, seed=11, max_tokens=12),
                   SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.05,
                                  max_tokens=16),  # penalties count the drafts before each position
                   SamplingParams(n=2, best_of=3, temperature=0.5, top_k=20, seed=5, max_tokens=12, logprobs=2)):
        plain = _run(llm, COPY_PROMPTS[:1], params, speculative=False)
        spec = _run(llm, COPY_PROMPTS[:1], params, speculative=True)
        assert _samples(spec) == _samples(plain)
        accepted += llm.scheduler.speculator.num_accepted_tokens
    assert accepted > 10
    for x, y in zip(plain[0].outputs, spec[0].outputs):  # the logprobs of every emitted token, top 2 included
        assert [t for t, _ in y.logprobs] == pytest.approx([t for t, _ in x.logprobs], abs=1e-4)
        assert [[i for i, _ in top] for _, top in y.logprobs] == [[i for i, _ in top] for _, top in x.logprobs]


def test_a_stop_token_or_max_tokens_inside_an_accepted_run_ends_it_where_it_would_end(llm, plain):
    copy = plain[0][0][0]
    stop = copy[17]  # a token the copy reaches inside a run of drafts
    cases = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
             SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=18),
             SamplingParams(temperature=0, max_tokens=13), SamplingParams(temperature=0, max_tokens=1)]
    spec = _samples(_run(llm, COPY_PROMPTS[:1] * len(cases), cases, speculative=True))
    assert llm.scheduler.speculator.num_accepted_tokens > 0
    # min_tokens masks the stop token before it (so that run leaves the copy): as without drafts
    (held_back,) = _samples(_run(llm, COPY_PROMPTS[:1], cases[1], speculative=False))
    assert spec == [[(copy[:copy.index(stop) + 1], "stop")], held_back, [(copy[:13], "length")],
                    [(copy[:1], "length")]]
    assert len(held_back[0][0]) >= 18


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_drafts_changes_no_token_and_frees_every_block(llm, plain, mode):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    spec = _run(llm, COPY_PROMPTS, params, speculative=True, preemption_mode=mode, num_gpu_blocks=24)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.speculator.num_accepted_tokens > 0
    assert _samples(spec) == plain


def test_an_abort_while_drafts_are_verified_frees_its_blocks(llm):
    llm.reset(speculative_config=NGRAM)
    engine = llm.engine
    for i, prompt in enumerate(COPY_PROMPTS):
        engine.add_request(f"r{i}", llm.encode(prompt), SamplingParams(temperature=0, max_tokens=24))
    aborted = None
    while engine.has_unfinished_requests():
        engine.step()
        in_flight = llm.scheduler._in_flight
        if aborted is None and in_flight and in_flight[-1].drafts:
            aborted = llm.scheduler._group_of_seq[next(iter(in_flight[-1].drafts))].request_id
            assert engine.abort_request(aborted)
    assert aborted is not None
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_structured_output_checks_drafts_against_the_grammar_and_still_parses(llm):
    """Each draft position is masked as the grammar stands after the drafts before it (the matcher
    accepts them, then rolls back): the output is the one without drafts, and it parses."""
    pattern = r'```python\n[a-z_():,.="\n ]+'
    params = SamplingParams(temperature=0, max_tokens=24, structured_output=StructuredOutput("regex", pattern))
    plain = _run(llm, COPY_PROMPTS[:1], params, speculative=False)
    spec = _run(llm, COPY_PROMPTS[:1], params, speculative=True)
    assert _samples(spec) == _samples(plain)
    assert llm.scheduler.speculator.num_accepted_tokens > 5
    for out in spec:
        assert re.fullmatch(pattern, out.text)


def test_tensor_parallel_2_with_drafts_matches_one_rank(tiny):
    from pagoda.offline import LLM

    directory, _ = tiny
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = LLM(str(directory), dtype="float32", skip_tokenizer_init=True)
    expected = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(str(directory), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              speculative_config=NGRAM)
    try:
        assert [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
        assert two.scheduler.speculator.num_accepted_tokens > 0
    finally:
        two.close()


def _counters(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("pagoda:spec_decode"):
                key = sample.name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                values[key] = values.get(key, 0.0) + sample.value
    return values


@pytest.mark.slow
def test_the_served_api_streams_the_same_text_with_drafts_and_counts_them(plain):
    """`pagoda up --speculative-config ...` through the openai client: a greedy chat stream is the
    text the engine writes without drafts, cut exactly at a stop string that falls inside an accepted
    run; /metrics has vLLM's spec_decode counters."""
    import openai

    from common.tokenizer import load_tokenizer
    from tests.stack import Stack, wait_for

    expected = load_tokenizer("default").decode(plain[0][0][0])
    stop = expected[len(expected) // 2:len(expected) // 2 + 6]
    stack = Stack("--quantization", "none", "--speculative-config", json.dumps(NGRAM)).wait_ready()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        text, usage = "", None
        for chunk in client.chat.completions.create(model=model, messages=COPY_PROMPTS[0]["messages"], temperature=0,
                                                    max_tokens=MAX_TOKENS, stop=[stop], stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == expected[:expected.index(stop)]
        full = client.completions.create(model=model, prompt=load_tokenizer("default").encode(
            "Repeat: 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"), temperature=0, max_tokens=MAX_TOKENS)
        assert full.usage.completion_tokens <= MAX_TOKENS
        assert 0 < usage.completion_tokens <= MAX_TOKENS
        wait_for(lambda: _counters(stack.url).get("pagoda:spec_decode_num_accepted_tokens_total", 0) > 0, 10,
                 "the accepted drafts in /metrics")
        counters = _counters(stack.url)
        drafts, accepted = (counters["pagoda:spec_decode_num_draft_tokens_total"],
                            counters["pagoda:spec_decode_num_accepted_tokens_total"])
        assert counters["pagoda:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
        assert sum(v for k, v in counters.items() if k.endswith("]")) == accepted  # per position
    finally:
        assert stack.stop() == 0
