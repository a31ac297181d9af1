"""Structured output: the shared compile rule (common/structured_output.py), the worker's grammar
state (worker/grammar.py) and the sampler's mask, and constrained generation on the real model."""
import json

import pytest

from common.protocol import StructuredOutput
from common.structured_output import (InvalidStructuredOutput, choice_spec, compile_structured_output,
                                      json_schema_spec)

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


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json_schema", '{"type":12}'), "invalid JSON schema: Type should be a string"),
    (StructuredOutput("regex", "(ab"), "invalid regular expression: Regex parsing error at position 4: "
                                       "The parenthesis is not closed."),
    (StructuredOutput("grammar", "root ::= foo"), 'invalid grammar: EBNF parser error at line 1, column 10: '
                                                  'Rule "foo" is not defined'),
    (StructuredOutput("choice", "[]"), "choices must be a non-empty list of strings"),
    (StructuredOutput("choice", '["a", ""]'), "a choice may not be the empty string"),
])
def test_a_rejected_spec_raises_a_clear_message(toy_compiler, spec, message):
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
