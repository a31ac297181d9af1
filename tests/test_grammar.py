"""Structured output: the shared compile rule (common/structured_output.py), the worker's grammar
state (worker/grammar.py) and the sampler's mask, and constrained generation on the real model."""
import json

import pytest
import torch

from common.protocol import StructuredOutput
from common.structured_output import (INT64_MAX, INT64_MIN, InvalidStructuredOutput, bounded_integers, choice_spec,
                                      compile_structured_output, json_schema_spec)
from tests.grammar_errors import assert_relays

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def toy_compiler():
    vocab = ["a", "b", "c", '"', "{", "}", ":", ",", "<eos>", "ab"]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_size=12, stop_token_ids=[8]))


def test_json_schema_spec_is_compact_keeps_the_key_order_and_rejects_text_that_is_not_json():
    assert json_schema_spec({"b": 1, "a": [1, 2]}) == StructuredOutput("json_schema", '{"b":1,"a":[1,2]}')
    assert json_schema_spec('{ "b": 1,\n "a": [1, 2] }') == json_schema_spec({"b": 1, "a": [1, 2]})
    with pytest.raises(InvalidStructuredOutput, match="not valid JSON"):
        json_schema_spec("{x")
    with pytest.raises(InvalidStructuredOutput, match="JSON object"):
        json_schema_spec("[1]")
    assert choice_spec(["x", 'y"']) == StructuredOutput("choice", '["x","y\\""]')


@pytest.mark.parametrize("spec, ours, convert", [
    (StructuredOutput("json_schema", '{"type":12}'), "invalid JSON schema", "from_json_schema"),
    (StructuredOutput("regex", "(ab"), "invalid regular expression", "from_regex"),
    (StructuredOutput("grammar", "root ::= foo"), "invalid grammar", "from_ebnf"),
])
def test_a_spec_the_library_rejects_says_what_is_invalid_then_the_librarys_reason(toy_compiler, spec, ours, convert):
    with pytest.raises(InvalidStructuredOutput) as info:
        compile_structured_output(toy_compiler, spec)
    assert_relays(str(info.value), ours, convert, spec.spec)
    assert isinstance(info.value, ValueError) and info.value.kind == spec.kind


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("choice", "[]"), "choices must be a non-empty list of strings"),
    (StructuredOutput("choice", '["a", ""]'), "a choice may not be the empty string"),
])
def test_a_rejected_choice_list_raises_a_clear_message(toy_compiler, spec, message):
    with pytest.raises(InvalidStructuredOutput) as info:
        compile_structured_output(toy_compiler, spec)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError) and info.value.kind == spec.kind


@pytest.mark.parametrize("spec", [json_schema_spec({"type": "object"}), StructuredOutput("json_object"),
                                  StructuredOutput("regex", "a+b"), choice_spec(["ab", 'a"\n\u00e9']),
                                  StructuredOutput("grammar", 'root ::= "a" "b"*')])
def test_every_kind_compiles(toy_compiler, spec):
    assert isinstance(compile_structured_output(toy_compiler, spec), xgr.CompiledGrammar)


def test_choice_accepts_exactly_its_strings(toy_compiler):
    compiled = compile_structured_output(toy_compiler, choice_spec(["ab", "c"]))
    for text, complete in (("ab", True), ("c", True), ("a", False)):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text)
        assert matcher.is_completed() == complete  # a choice ends where its string does
    assert not xgr.GrammarMatcher(compiled).accept_string("b")


def test_an_unbounded_integer_is_held_to_int64_and_its_digits_end():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"],
                                                                               "minimum": 0},
                                               "x": {"items": {"type": "integer", "exclusiveMaximum": 5}}}}
    assert json.loads(bounded_integers(json.dumps(schema))) == {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX},
        "m": {"type": ["integer", "null"], "minimum": 0, "maximum": INT64_MAX},
        "x": {"items": {"type": "integer", "exclusiveMaximum": 5, "minimum": INT64_MIN}}}}
    assert bounded_integers("{x") == "{x"  # not JSON: left for the library to reject
    digits = ["0", "1", "9", '"', "{", "}", ":", " ", "n", ",", "<eos>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(digits, vocab_size=11, stop_token_ids=[10]))
    compiled = compile_structured_output(compiler, json_schema_spec(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert xgr.GrammarMatcher(compiled).accept_string('{"n": ' + "9" * 18 + "}")
    assert not xgr.GrammarMatcher(compiled).accept_string('{"n": ' + "1" * 20)


# ----------------------------------------------------------------------------- the worker's grammar state

EOS = 2  # the default model's
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from common.tokenizer import load_tokenizer

    return load_tokenizer("default")


def grammar_state(tokenizer, **kwargs):
    from worker.grammar import GrammarState

    return GrammarState(lambda: tokenizer, 49152, [EOS], **kwargs)


def held(output: list[int], spec: StructuredOutput | None, prompt=(1, 2, 3)):
    from common.plan_state import HeldSequence
    from common.protocol import SamplingParams

    return HeldSequence([*prompt, *output], len(prompt), 0, [], SamplingParams(structured_output=spec))


def allowed(mask, i: int) -> set[int]:
    words = mask.bitmask[i].tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


def test_a_replayed_matcher_equals_the_kept_one(tokenizer):
    """A sequence met again (swap-in, recompute, fork) replays its output: its mask is the one the
    matcher kept step by step gives, and so is that of the same sequence after it was freed."""
    state = grammar_state(tokenizer)
    spec = json_schema_spec(PERSON)
    output = tokenizer.encode('{"name": "Bob", "age": 4', add_special_tokens=False)
    kept = held([], spec)
    for token in output:  # a decode step at a time, as PlanState appends them
        kept.token_ids.append(token)
        state.sync([(1, kept)])
    state.sync([(2, held(output, spec)), (3, held(output, None))])
    assert set(state.matchers) == {1, 2}  # an unconstrained sequence has none
    mask = state.fill([(0, 1), (1, 2), (2, 3)])
    assert mask.rows == [0, 1]
    assert torch.equal(mask.bitmask[0], mask.bitmask[1])
    after_age = allowed(mask, 0)
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert digits <= after_age and tokenizer.convert_tokens_to_ids("}") in after_age
    assert EOS not in after_age and tokenizer.convert_tokens_to_ids('"') not in after_age
    state.free([1])  # preempted: it comes back in full
    state.sync([(1, held(output, spec))])
    assert allowed(state.fill([(0, 1)]), 0) == after_age


def test_a_finished_grammar_allows_only_the_stop_tokens(tokenizer):
    state = grammar_state(tokenizer)
    spec = choice_spec(["yes", "no"])
    no = tokenizer.encode("no", add_special_tokens=False)
    broken = tokenizer.encode("x", add_special_tokens=False)
    state.sync([(1, held(no, spec)), (2, held(no + [EOS], spec)), (3, held(broken, spec)), (4, held([], spec))])
    mask = state.fill([(0, 1), (1, 2), (2, 3), (3, 4)])
    assert [allowed(mask, i) for i in range(3)] == [{EOS}] * 3  # completed; past its stop token; broken
    first = allowed(mask, 3)
    assert {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")} <= first and EOS not in first


def test_compiled_grammars_are_cached_least_recently_used_first_out(tokenizer):
    state = grammar_state(tokenizer, cache_size=2)
    a, b, c = StructuredOutput("regex", "a+"), StructuredOutput("regex", "b+"), StructuredOutput("regex", "c+")
    compiled_a = state.compile(a)
    state.compile(b)
    assert state.compile(a) is compiled_a  # a is now the most recent: c evicts b
    state.compile(c)
    assert list(state.compiled) == [("regex", "a+"), ("regex", "c+")]


def test_a_choice_with_min_tokens_ends_after_the_choice_with_eos(tokenizer):
    """The grammar wins over min_tokens: once "yes" is out, the grammar allows only EOS, which
    min_tokens 5 would mask; the sequence ends there instead of taking a token the grammar forbids."""
    from common.protocol import SamplingParams
    from worker.sampler import Sampler, SamplingRow

    state, sampler = grammar_state(tokenizer), Sampler([EOS], 49152)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    logits = torch.zeros(1, 49152)
    logits[0, yes[0]], logits[0, 0] = 5.0, 9.0  # the model prefers token 0, which the grammar never allows
    seq = held([], None)
    seq.sampling_params = SamplingParams(temperature=0, min_tokens=5, structured_output=choice_spec(["yes", "no"]))
    output = []
    for _ in range(len(yes) + 1):
        state.sync([(1, seq)])
        [token] = sampler(logits, [SamplingRow(1, seq.sampling_params, len(output))], state.fill([(0, 1)])).token_ids
        output.append(token)
        seq.token_ids.append(token)
    assert output == [*yes, EOS]


def test_a_compile_runs_on_its_thread_from_sync_and_fill_waits_for_it(tokenizer):
    """sync starts the compile and returns while it runs (here: held in the tokenizer's load);
    fill waits for it, then replays the sequence's output into its new matcher."""
    import threading

    from worker.grammar import GrammarState

    go = threading.Event()
    state = GrammarState(lambda: go.wait(30) and tokenizer, 49152, [EOS])
    no = tokenizer.encode("no", add_special_tokens=False)
    spec = choice_spec(["yes", "no"])
    state.sync([(1, held(no, spec)), (2, held([], spec))])
    [compiling] = state.compiling.values()
    assert not compiling.done() and state.matchers[1].matcher is None  # one compile for the two
    go.set()
    mask = state.fill([(0, 1), (1, 2)])
    assert allowed(mask, 0) == {EOS} and EOS not in allowed(mask, 1)
    assert list(state.compiled) == [("choice", '["yes","no"]')] and not state.compiling


def test_a_compiler_that_cannot_be_built_fails_no_step_and_is_not_retried(caplog):
    """The tokenizer's load raises: every constrained sequence may only end (its mask: EOS), the
    load is tried once, the failure logged once; offline, compile raises it."""
    from worker.grammar import GrammarState

    calls = []

    def load_tokenizer():
        calls.append(1)
        raise OSError("no tokenizer")

    state = GrammarState(load_tokenizer, 100, [EOS])
    with caplog.at_level("ERROR", logger="worker.grammar"):
        state.sync([(1, held([5], StructuredOutput("regex", "a+"))), (2, held([], choice_spec(["x"])))])
        mask = state.fill([(0, 1), (1, 2)])
        state.sync([(3, held([], StructuredOutput("regex", "b+")))])
        assert allowed(state.fill([(0, 3)]), 0) == {EOS}
        with pytest.raises(RuntimeError, match="no grammar compiler for this model"):
            state.compile(StructuredOutput("regex", "c+"))
    assert [allowed(mask, i) for i in range(2)] == [{EOS}, {EOS}]
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "no grammar compiler for this model (OSError: no tokenizer); constrained sequences may only end"]


def test_a_spec_that_fails_to_compile_is_remembered(tokenizer, caplog):
    state = grammar_state(tokenizer)
    bad = StructuredOutput("regex", "(ab")
    with caplog.at_level("ERROR", logger="worker.grammar"):
        state.sync([(1, held([], bad))])
        assert allowed(state.fill([(0, 1)]), 0) == {EOS}
        state.sync([(2, held([], bad))])
        assert not state.compiling  # from the cache: not compiled again
        assert allowed(state.fill([(0, 2)]), 0) == {EOS}
    assert len(caplog.records) == 1 and "invalid regular expression" in caplog.records[0].getMessage()
    with pytest.raises(InvalidStructuredOutput, match="invalid regular expression"):
        state.compile(bad)


# ----------------------------------------------------------------------------- the real default model, offline

ITEM = {"type": "object", "properties": {"item": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "color": {"enum": ["red", "green", "blue"]}},
        "required": ["item", "count", "color"], "additionalProperties": False}


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def llm(default_llm):
    """tests/conftest.py's session engine (the default model, CPU, float32), reset for this module."""
    default_llm.reset()
    return default_llm


def params(spec: StructuredOutput, max_tokens: int = 24, **kwargs):
    from common.protocol import SamplingParams

    return SamplingParams(temperature=kwargs.pop("temperature", 0), max_tokens=max_tokens, structured_output=spec,
                          **kwargs)


def assert_valid(output, spec: StructuredOutput) -> None:
    import re

    import jsonschema

    assert output.finish_reason == "stop", output.text
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(output.text), json.loads(spec.spec))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(output.text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, output.text), output.text
    elif spec.kind == "choice":
        assert output.text in json.loads(spec.spec)


@pytest.mark.slow
def test_constrained_outputs_parse_validate_and_match(llm):
    specs = [json_schema_spec(PERSON), json_schema_spec(ITEM), StructuredOutput("regex", r"\d{3}-\d{4}"),
             choice_spec(["yes", "no", "maybe"]), StructuredOutput("json_object")]
    prompts = [chat("Give a person as JSON."), chat("An item to buy, as JSON."), chat("A phone number?"),
               chat("Is the sky blue?"), chat('What is 2+2? Answer as a JSON object with key "answer".')]
    outputs = llm.generate(prompts, [params(spec, 32, seed=i, temperature=0.7 if i % 2 else 0)
                                     for i, spec in enumerate(specs)], use_tqdm=False)
    for output, spec in zip(outputs, specs):
        assert_valid(output, spec)
    assert list(json.loads(outputs[0].text)) == ["name", "age"]  # in the schema's order
    with pytest.raises(ValueError, match="invalid regular expression"):
        llm.generate(chat("hi"), params(StructuredOutput("regex", "(ab")), use_tqdm=False)


NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
COLORS = r"(red|green|blue|yellow)(, (red|green|blue|yellow)){3}"
PREEMPTED = [("A number from 1 to 99, as JSON.", json_schema_spec(NUMBER), 0.0),
             ("Four colors.", StructuredOutput("regex", COLORS), 0.8),
             ("Give a person as JSON.", json_schema_spec(PERSON), 0.0)]


def crossing_prompt(llm, text: str, num_tokens_into_block: int = 10) -> dict:
    """`text` as a chat prompt padded to end `num_tokens_into_block` tokens into a 16-token block:
    its sequence needs a new block after 16 - that many output tokens."""
    for _ in range(32):
        if len(llm.encode(chat(text))) % 16 == num_tokens_into_block:
            return chat(text)
        text += " a"  # one token
    raise AssertionError(f"no padding of {text!r} ends {num_tokens_into_block} tokens into a block")


@pytest.fixture(scope="module")
def unpreempted(llm):
    """(prompts, token ids, prompt blocks) of the PREEMPTED requests run with room."""
    prompts = [crossing_prompt(llm, text) for text, _, _ in PREEMPTED]
    llm.reset(enable_prefix_caching=False)
    outputs = llm.generate(prompts, preempted_params(), use_tqdm=False)
    assert llm.scheduler.num_preemptions == 0
    assert all(len(o.token_ids) > 6 for o in outputs)  # each needs a block more than its prompt's
    return prompts, [o.token_ids for o in outputs], sum(-(-len(o.prompt_token_ids) // 16) for o in outputs)


def preempted_params():
    return [params(spec, 24, seed=i, temperature=t) for i, (_, spec, t) in enumerate(PREEMPTED)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_constrained_requests_survive_preemption(llm, unpreempted, mode):
    """Each preempted sequence comes back as a NewSequence: its matcher replays its output, and
    the tokens are those of the run without preemption."""
    prompts, expected, prompt_blocks = unpreempted
    llm.reset(num_gpu_blocks=prompt_blocks + 1, num_cpu_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    outputs = llm.generate(prompts, preempted_params(), use_tqdm=False)
    scheduler = llm.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swap_preemptions if mode == "swap" else scheduler.num_recompute_preemptions) \
        == scheduler.num_preemptions
    assert [o.token_ids for o in outputs] == expected
    for output, (_, spec, _) in zip(outputs, PREEMPTED):
        assert_valid(output, spec)


@pytest.mark.slow
def test_constrained_requests_share_prefix_blocks(llm):
    llm.reset()
    prompt = chat("Answer in JSON. " + "We are counting the things in the kitchen, one at a time. " * 2)
    [first] = llm.generate(prompt, params(json_schema_spec(NUMBER), 16), use_tqdm=False)
    assert llm.scheduler.prefix_cache_hits == 0
    [second] = llm.generate(prompt, params(StructuredOutput("regex", COLORS), 16, seed=1, temperature=0.8), use_tqdm=False)
    num_prompt_tokens = len(second.prompt_token_ids)
    assert llm.scheduler.prefix_cache_hits == (num_prompt_tokens - 1) // 16 * 16  # every full block but the last token's
    assert_valid(first, json_schema_spec(NUMBER))
    assert_valid(second, StructuredOutput("regex", COLORS))


def test_pagoda_generate_guided_flags(tmp_path):
    import argparse

    from pagoda import cli

    parser = argparse.ArgumentParser()
    cli._add_generate(parser)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON, indent=2))
    of = lambda *argv: cli._structured_output(parser.parse_args(list(argv)))  # noqa: E731
    assert of("--guided-json", str(schema)) == json_schema_spec(PERSON)
    assert of("--guided-regex", r"\d+") == StructuredOutput("regex", r"\d+")
    assert of("--guided-choice", "yes", "--guided-choice", "no") == choice_spec(["yes", "no"])
    assert of() is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--guided-regex", "a", "--guided-choice", "b"])  # one constraint at a time
