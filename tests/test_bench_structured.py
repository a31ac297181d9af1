"""`pagoda bench structured` (pagoda/bench/structured.py) on tiny inputs: its 20 schemas and their
examples, both grammar libraries replaying the examples through the default model's tokenizer, and
the validity count of --validate."""
from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
import pytest

from common.protocol import StructuredOutput
from pagoda.bench import structured


def test_the_twenty_schemas_are_varied_and_their_examples_validate():
    schemas = structured.load_schemas()
    assert len(schemas) == 20
    assert len({s["name"] for s in schemas}) == 20
    for entry in schemas:
        jsonschema.Draft202012Validator.check_schema(entry["schema"])
        jsonschema.validate(entry["example"], entry["schema"])
    text = json.dumps([s["schema"] for s in schemas])
    for keyword in ('"enum"', '"pattern"', '"anyOf"', '"minimum"', '"maximum"', '"items"', '"$ref"', '"const"',
                    '"maxLength"'):
        assert keyword in text, keyword
    # optional fields: some schema leaves a property out of "required"
    assert any(set(s["schema"]["properties"]) - set(s["schema"].get("required", ())) for s in schemas)


def test_canonical_texts_are_the_gateways():
    from common.structured_output import json_schema_spec

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert structured.schema_text(schema) == json_schema_spec(schema).spec
    assert structured.example_text({"b": 1, "a": "x"}) == '{"b": 1, "a": "x"}'


@pytest.fixture(scope="module")
def tokenizer():
    return structured.load_tokenizer("default")


@pytest.mark.parametrize("name", list(structured.LIBRARIES))
def test_each_library_admits_every_example_and_fills_masks(tokenizer, name):
    tok, vocab_size, eos = tokenizer
    schemas = structured.load_schemas()[:3]
    lib = structured.LIBRARIES[name](tok, vocab_size, eos, threads=1)
    for entry in structured.load_schemas():  # every example is a document of its own grammar, then EOS
        matcher = lib.matcher(lib.compile(structured.schema_text(entry["schema"])))
        ids = tok.encode(structured.example_text(entry["example"]), add_special_tokens=False)
        assert all(lib.accept(matcher, t) for t in ids + eos[:1]), (name, entry["name"])
    timing = structured.time_compile(lib, schemas, repeats=1)
    assert timing["compile_ms"]["n"] == 3 and timing["compile_ms"]["median"] > 0
    assert set(timing["per_schema_compile_ms"]) == {s["name"] for s in schemas}
    documents = [tok.encode(structured.example_text(e["example"]), add_special_tokens=False) + eos[:1]
                 for e in schemas]
    for batched in (False, True):
        masks = structured.time_masks(lib, schemas, documents, batch_size=4, steps=30, batched=batched)
        assert masks["step_ms"]["n"] == 30  # 30 steps run past each document's end: matchers were reset
        assert masks["per_sequence_ms"]["median"] == pytest.approx(masks["step_ms"]["median"] / 4)


@dataclass
class Out:
    text: str
    token_ids: list
    finish_reason: str


@dataclass
class Engine:
    num_steps: int = 0


class ScriptedLLM:
    """Answers each prompt with the next scripted (text, finish_reason), or a constrained request
    with as many tokens as its seed + 1 and any other with its max_tokens; records each call."""

    def __init__(self, answers=()):
        self.answers = list(answers)
        self.calls = []
        self.engine = Engine()

    @property
    def params(self):
        return self.calls[-1][1]

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        self.engine.num_steps += 10
        if self.answers:
            return [Out(text, [0] * 5, reason) for text, reason in self.answers[:len(prompts)]]
        return [Out("", [0] * (p.seed + 1 if p.structured_output else p.max_tokens), "stop") for p in params]


def test_validate_counts_only_closed_valid_documents():
    schemas = structured.load_schemas()[:2]  # person (name, age 0..150), enum_status
    llm = ScriptedLLM([
        ('{"age": 36, "name": "Ada"}', "stop"),             # valid
        ('{"code": 1, "status": "active"}', "stop"),        # valid
        ('{"age": 200, "name": "Old"}', "stop"),            # out of bounds
        ('{"code": 1, "status": "act', "length"),           # cut by max_tokens
    ])
    result = structured.validate(llm, schemas, seeds=2, max_tokens=7, temperature=0.7)
    assert (result["generations"], result["valid"]) == (4, 2)
    assert [(f["schema"], f["seed"]) for f in result["failures"]] == [("person", 1), ("enum_status", 1)]
    assert result["failures"][0]["problem"].startswith("ValidationError: 200 is greater than the maximum of 150")
    assert result["failures"][1]["problem"] == "cut by max_tokens 7"
    assert [p.seed for p in llm.params] == [0, 0, 1, 1]
    assert llm.params[0].structured_output == StructuredOutput("json_schema", structured.schema_text(schemas[0]["schema"]))
    assert all(p.max_tokens == 7 for p in llm.params)


def test_the_command_compares_the_libraries(tmp_path, capsys):
    from pagoda.cli import main

    output = tmp_path / "compare.json"
    assert main(["bench", "structured", "--compare", "--num-schemas", "2", "--batch-size", "2", "--steps", "3",
                 "--repeats", "1", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["benchmark"] == "structured" and result["schemas"] == 2
    assert result["command"].startswith("pagoda bench structured --compare --model default")
    assert "validate" not in result and "throughput" not in result
    for name in ("xgrammar", "llguidance"):
        entry = result["compare"][name]
        assert entry["compile_ms"]["n"] == 2 and entry["mask_batched"]["step_ms"]["n"] == 3
        assert list(entry["per_schema_compile_ms"]) == ["person", "enum_status"]


def test_throughput_holds_the_unconstrained_run_to_the_constrained_lengths():
    llm = ScriptedLLM()
    result = structured.throughput(llm, structured.load_schemas()[:3], batch_size=5, max_tokens=9, temperature=0.7,
                                   repeats=2)
    warmup, constrained, free = llm.calls[0], llm.calls[1], llm.calls[2]
    # a warm-up that compiles each of the 3 grammars, then constrained and unconstrained twice
    assert len(llm.calls) == 5 and sorted(p.seed for p in warmup[1]) == [0, 1, 2]
    assert all(p.max_tokens == 2 for p in warmup[1])
    assert constrained[0] == free[0] and len(free[0]) == 5  # the same prompts
    assert [p.structured_output.spec for p in constrained[1]] == [
        structured.schema_text(s["schema"]) for s in structured.load_schemas()[:3] + structured.load_schemas()[:2]]
    assert [(p.max_tokens, p.seed) for p in constrained[1]] == [(9, i) for i in range(5)]
    # held to each request's constrained length: 1..5 tokens, EOS ignored, no grammar
    assert [(p.min_tokens, p.max_tokens, p.ignore_eos, p.structured_output, p.seed) for p in free[1]] == [
        (n, n, True, None, n - 1) for n in range(1, 6)]
    assert result["constrained"]["output_tokens"] == result["unconstrained"]["output_tokens"] == 15
    assert result["constrained"]["steps"] == 10 and result["same_lengths"]
    assert result["ratio"] == pytest.approx(
        result["constrained"]["output_tokens_per_s"] / result["unconstrained"]["output_tokens_per_s"])
