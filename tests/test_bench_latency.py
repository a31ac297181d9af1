"""`pagoda bench latency` through the real offline engine on the CPU, a tiny dummy model: the
result's structure and exact counts, and the definitions its figures follow (never timings)."""
import json
from pathlib import Path

import pytest

from pagoda.bench.latency import distribution
from pagoda.cli import main

TINY = Path(__file__).parent / "data" / "tiny-llama.json"
FIGURES = ["latency_s", "ttft_s", "tpot_s", "e2e_s"]
STATS = ["mean", "median", "p50", "p90", "p99"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("latency") / "latency.json"
    assert main(["bench", "latency", "--model", f"dummy:{TINY}", "--device", "cpu", "--input-len", "8",
                 "--output-len", "4", "--batch-sizes", "1,3", "--num-iters", "2", "--num-iters-warmup", "1",
                 "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_result_has_the_common_header_and_one_row_per_batch_size(result):
    assert list(result)[:5] == ["benchmark", "command", "commit", "date", "device"]
    assert result["benchmark"] == "latency"
    assert result["command"].startswith(f"pagoda bench latency --model dummy:{TINY} --device cpu --dtype auto "
                                        "--quantization none --kv-cache-dtype auto --input-len 8 --output-len 4 --batch-sizes 1,3 --num-iters 2 "
                                        "--num-iters-warmup 1 ")
    assert "--batch-size " not in result["command"]  # the command repeats: the two flags exclude each other
    assert (result["dtype"], result["async_scheduling"], result["num_iters"], result["num_iters_warmup"]) == (
        "float32", True, 2, 1)
    assert [row["batch_size"] for row in result["rows"]] == [1, 3]


def test_every_request_of_every_measured_iteration_is_counted(result):
    for row in result["rows"]:
        b = row["batch_size"]
        assert (row["input_len"], row["output_len"], row["iterations"]) == (8, 4, 2)
        assert row["requests"] == b * 2
        assert row["output_tokens"] == b * 4 * 2
        # each prompt in one prefill step with the others, then 3 decode steps; with async scheduling
        # one more plan, made while the last decode is in flight, which schedules nothing
        assert row["steps"] == 5 * 2 and row["preemptions"] == 0
        assert len(row["iteration_latencies_s"]) == 2
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / sum(row["iteration_latencies_s"]))


def test_figures_follow_their_definitions(result):
    for row in result["rows"]:
        for name in FIGURES:
            assert list(row[name]) == STATS
            stats = row[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
            assert stats["median"] == pytest.approx(stats["p50"])
        ttft, tpot, e2e = row["ttft_s"], row["tpot_s"], row["e2e_s"]
        # TPOT = (e2e - TTFT) / (output_len - 1) per request: the means follow
        assert tpot["mean"] == pytest.approx((e2e["mean"] - ttft["mean"]) / 3)
        assert ttft["p99"] <= e2e["p99"] and ttft["mean"] < e2e["mean"]
        # the last request of a batch ends with the batch
        assert max(row["iteration_latencies_s"]) >= e2e["p99"]
        assert row["latency_s"]["mean"] == pytest.approx(sum(row["iteration_latencies_s"]) / 2)


def test_goal_is_measured_from_the_batch_1_row(result):
    goal, row = result["goal"], result["rows"][0]
    assert goal["min_tokens_per_s_batch_1"] == 160
    assert goal["tokens_per_s_batch_1"] == row["output_tokens_per_s"]
    assert goal["ratio"] == pytest.approx(row["output_tokens_per_s"] / 160)
    assert goal["met"] is (row["output_tokens_per_s"] >= 160)
    assert goal["decode_tokens_per_s_batch_1"] == pytest.approx(1 / row["tpot_s"]["median"])


def test_distribution_is_numpys_linear_percentiles():
    assert distribution([4.0, 1.0, 3.0, 2.0]) == {"mean": 2.5, "median": 2.5, "p50": 2.5, "p90": 3.7,
                                                  "p99": pytest.approx(3.97)}
    assert distribution([]) is None


def test_every_request_ends_no_earlier_than_its_first_token(monkeypatch):
    """Per request, not only in the summaries: TTFT <= e2e, and exactly output_len tokens each."""
    from pagoda.bench import latency
    from pagoda.offline import LLM

    llm = LLM(f"dummy:{TINY}", skip_tokenizer_init=True, device="cpu", async_scheduling=False)
    it = latency.run_iteration(llm, [[5] * 8, [6] * 9, [7] * 10], output_len=3, tag="t")
    assert len(it.ttft) == len(it.e2e) == 3 and it.output_tokens == 9 and it.steps == 3
    assert all(0 < t <= e <= it.latency for t, e in zip(it.ttft, it.e2e))


@pytest.mark.parametrize("flags, message", [
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--input-len", "0"], "--input-len must be >= 1"),
    (["--batch-size", "0"], "every batch size must be >= 1"),
    (["--batch-sizes", "1,0"], "every batch size must be >= 1"),
    (["--batch-sizes", "1,x"], "--batch-sizes takes whole numbers, comma-separated (got '1,x')"),
    (["--num-iters", "0"], "--num-iters must be >= 1"),
    (["--num-iters-warmup", "-1"], "--num-iters-warmup must be >= 0"),
    (["--batch-size", "300"], "raise --max-num-seqs"),
    (["--input-len", "1000", "--output-len", "100"], "more than the model's context (1024 tokens)"),
])
def test_bad_input_is_a_usage_error(flags, message, capsys, tmp_path):
    out = tmp_path / "never.json"
    assert main(["bench", "latency", "--model", f"dummy:{TINY}", "--device", "cpu", *flags,
                 "--output", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_batch_size_and_batch_sizes_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--batch-size", "1", "--batch-sizes", "1,2"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
