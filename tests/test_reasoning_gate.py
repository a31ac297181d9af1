"""A thinking model's reasoning before its grammar (worker/reasoning_gate.py, worker/grammar.py):
the gate finds the end-of-thinking tokens, a thinking budget forces them, the grammar applies
only after them, and a drafted step's rows are masked as the gate and the grammar stand after
each draft; then the same on the engine's real output, with a scripted model."""
from __future__ import annotations

import pytest
import torch

import scripted
from common.plan_state import HeldSequence
from common.protocol import SamplingParams, StructuredOutput, decode, encode
from pagoda.offline import LLM
from worker.grammar import GrammarState, _only
from worker.reasoning_gate import ReasoningGate

END = (7, 8)  # "</th" "ink>": an end tag of two tokens
VOCAB = 40
WORDS = (VOCAB + 31) // 32


def gate(budget=None) -> ReasoningGate:
    return ReasoningGate.of(SamplingParams(reasoning_end_token_ids=list(END), thinking_token_budget=budget))


def test_the_gate_closes_on_its_end_tokens_in_a_row_and_counts_them_as_reasoning():
    g = gate()
    for token in (5, 7, 6, 7, 7):  # "</th" not followed by "ink>" does not end it
        g.consume(token)
    assert (g.open, g.matched, g.num_tokens) == (True, 1, 5)
    g.consume(8)
    assert (g.open, g.num_tokens) == (False, 6)
    assert ReasoningGate.of(SamplingParams()) is None


def test_a_budget_forces_the_end_tokens_then_the_rest_of_them():
    g = gate(budget=2)
    assert g.forced() is None
    g.consume(5)
    assert g.forced() is None
    g.consume(7)  # the budget is spent on the end tag's first token: only its second is left
    assert g.forced() == 8
    g.consume(8)
    assert not g.open
    assert gate(budget=0).forced() == 7


def test_the_fields_travel_and_a_budget_without_end_tokens_is_refused():
    params = SamplingParams(reasoning_end_token_ids=[7, 8], thinking_token_budget=3)
    assert decode(encode(params)) == params
    with pytest.raises(ValueError, match="thinking_token_budget needs the tokens that end the thinking"):
        SamplingParams(thinking_token_budget=3)
    with pytest.raises(ValueError, match=r"thinking_token_budget must be in \[0, "):
        SamplingParams(reasoning_end_token_ids=[7], thinking_token_budget=-1)


def held(output: list[int], **params) -> HeldSequence:
    return HeldSequence([1, 2, 3, *output], 3, 0, [], SamplingParams(**params))


def rows_of(mask) -> list[list[int]]:
    """Each row's allowed tokens; [] for a free row."""
    full = _only(list(range(VOCAB)), WORDS)
    out = []
    for row in mask.bitmask:
        if torch.equal(row, torch.full_like(row, -1)) or torch.equal(row, full):
            out.append([])
        else:
            out.append([t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1])
    return out


def test_a_budget_alone_leaves_the_draws_free_until_it_is_spent_then_forces_the_end():
    state = GrammarState(lambda: None, VOCAB, stop_token_ids=[2])
    params = dict(reasoning_end_token_ids=list(END), thinking_token_budget=3)
    state.sync([(10, held([5, 6], **params)), (11, held([5, 6, 9], **params)), (12, held([5, 7, 8], **params))])
    mask = state.fill([(0, 10), (1, 11), (2, 12)])
    assert mask.rows == [0, 1, 2]
    assert rows_of(mask) == [[], [7], []]  # 12 ended its thinking: its answer is free
    state.sync([(11, held([5, 6, 9, 7], **params))])
    assert rows_of(state.fill([(1, 11)])) == [[8]]
    assert state.fill([(0, 99)]) is None  # a sequence without a gate or grammar


def test_drafted_rows_follow_a_copy_of_the_gate_and_a_refused_draft_repeats_the_mask():
    state = GrammarState(lambda: None, VOCAB, stop_token_ids=[2])
    params = dict(reasoning_end_token_ids=list(END), thinking_token_budget=2)
    state.sync([(10, held([5], **params)), (11, held([5], **params))])
    # 10 drafts [6, 7]: free, then </th forced (budget spent), then ink> forced
    # 11 drafts [9, 9]: free, then </th forced, which 9 is not: the last row repeats it
    mask = state.fill([(0, 10), (1, 10), (2, 10), (3, 11), (4, 11), (5, 11)], {10: [6, 7], 11: [9, 9]})
    assert rows_of(mask) == [[], [7], [8], [], [7], [7]]
    assert state.matchers[10].gate.num_tokens == 1  # the drafts moved a copy


# ----------------------------------------------------------------------------- on the engine's output

SCRIPTS = {
    "think": ["<think>", "Hmm,", " let", " me", " see.", "</think>", "Yes"],
    "tagged": ["<think>\n", "Greet", " them.", "</th", "ink>", "\n\nHello"],
    "deny": ["No"],
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = scripted.build(tmp_path_factory.mktemp("scripted-gate"), SCRIPTS)
    return LLM(str(directory), device="cpu", dtype="float32", num_gpu_blocks=64)


def generate(llm, cue: str, **params) -> str:
    prompt = {"messages": [{"role": "user", "content": f"Now {cue}"}]}
    [out] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, **params), use_tqdm=False)
    return out.text


def end_ids(llm, *pieces: str) -> list[int]:
    return [llm.encoder.tokenizer.convert_tokens_to_ids(p) for p in pieces]


def test_a_budget_cuts_the_thinking_and_the_answer_follows(llm):
    think = end_ids(llm, "</think>")
    assert generate(llm, "think", reasoning_end_token_ids=think) == "<think>Hmm, let me see.</think>Yes"
    assert generate(llm, "think", reasoning_end_token_ids=think, thinking_token_budget=2) == "<think>Hmm,</think>Yes"
    tagged = end_ids(llm, "</th", "ink>")
    assert generate(llm, "tagged", reasoning_end_token_ids=tagged, thinking_token_budget=1) == (
        "<think>\n</think>\n\nHello")


def test_the_grammar_applies_after_the_thinking(llm):
    choice = StructuredOutput("choice", '["Yes","No"]')
    assert generate(llm, "think", reasoning_end_token_ids=end_ids(llm, "</think>"), structured_output=choice) == (
        "<think>Hmm, let me see.</think>Yes")
    # without the gate the grammar holds from the first token: "<think>" is no answer, and of the
    # two it allows (both at logit 0 after the cue) the lower id wins
    assert generate(llm, "think", structured_output=choice) == "Yes"
