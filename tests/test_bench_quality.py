"""`pagoda bench quality` through the CLI on a tiny random Llama (seed 0, float32, CPU) with the
512-word tokenizer of tests/data/tiny-tokenizer: the perplexity the engine's prompt logprobs give
equals transformers' own over the same windows, full precision agrees with itself exactly, and the
JSON has its documented fields. One run (scheme none) serves every check; never timings."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pagoda.bench.quality import DEFAULT_TEXT, agreement, greedy_prompts, read_text, table, windows
from pagoda.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny-llama.json"
TOKENIZER = ROOT / "tests" / "data" / "tiny-tokenizer"
# 150 words w4..w511 (the tiny tokenizer's ids 4..511, one token each): 3 windows of 48 every 40 (overlapping)
TEXT_IDS = torch.randint(4, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()
WINDOW, STRIDE, NUM_WINDOWS = 48, 40, 3
ROW_FIELDS = ["scheme", "quantization", "dtype", "kv_cache_dtype", "mean_nll", "perplexity", "perplexity_ratio", "scored_tokens",
              "greedy_identical", "greedy_identical_share", "agreement", "goal_max_ratio", "goal_met", "load_s",
              "score_s", "prompt_tokens_per_s", "generate_s", "output_tokens_per_s"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, one_torch_thread):
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(TINY)).eval()
    directory = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    model.save_pretrained(directory)
    for file in TOKENIZER.iterdir():
        if file.name != "README.md":
            shutil.copy(file, directory)
    return directory, model


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory):
    directory, _ = tiny_model
    tmp = tmp_path_factory.mktemp("quality")
    text = tmp / "text.txt"
    text.write_text("# a header line, skipped\n" + " ".join(f"w{i}" for i in TEXT_IDS) + "\n")
    out = tmp / "quality.json"
    assert main(["bench", "quality", "--model", str(directory), "--schemes", "none", "--text", str(text),
                 "--window", str(WINDOW), "--stride", str(STRIDE), "--num-windows", str(NUM_WINDOWS),
                 "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "6", "--device", "cpu",
                 "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_perplexity_is_transformers_over_the_same_windows(tiny_model, result):
    _, model = tiny_model
    nlls = []
    with torch.inference_mode():
        for k in range(NUM_WINDOWS):
            ids = TEXT_IDS[k * STRIDE:k * STRIDE + WINDOW]
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            first = 1 if k == 0 else WINDOW - STRIDE  # a later window scores only the tokens no earlier one did
            nlls += [-logprobs[i - 1, ids[i]].item() for i in range(first, WINDOW)]
    assert len(nlls) == len(TEXT_IDS[:(NUM_WINDOWS - 1) * STRIDE + WINDOW]) - 1  # every token but the first, once
    row = result["rows"][0]
    assert row["scored_tokens"] == len(nlls) == result["scored_tokens"]
    assert row["perplexity"] == pytest.approx(math.exp(math.fsum(nlls) / len(nlls)), rel=1e-4)
    assert row["perplexity_ratio"] == 1.0


def test_full_precision_agrees_with_itself_exactly(result):
    row = result["rows"][0]
    assert (row["scheme"], row["dtype"], row["quantization"]) == ("none", "float32", "none")
    assert (row["greedy_identical"], row["greedy_identical_share"], row["agreement"]) == (4, 1.0, 1.0)


def test_result_has_the_documented_fields(result, tiny_model):
    assert list(result)[:5] == ["benchmark", "command", "commit", "date", "device"]
    assert result["benchmark"] == "quality" and result["command"].startswith("pagoda bench quality --model ")
    assert list(result)[5:] == ["model", "text", "window", "stride", "num_windows", "scored_tokens", "greedy",
                                "goals", "rows"]
    assert result["model"] == tiny_model[0].name
    assert result["text"]["tokens"] == len(TEXT_IDS) and len(result["text"]["sha256"]) == 64
    assert (result["window"], result["stride"], result["num_windows"]) == (WINDOW, STRIDE, NUM_WINDOWS)
    assert result["greedy"] == {"num_prompts": 4, "prompt_len": 8, "max_tokens": 6}
    assert result["goals"] == {"int4": {"max_perplexity_ratio": 1.05}, "int8": {"max_perplexity_ratio": 1.05},
                               "fp8": {"max_perplexity_ratio": 1.02}}
    assert [list(row) for row in result["rows"]] == [ROW_FIELDS]
    assert result["rows"][0]["goal_max_ratio"] is None and result["rows"][0]["goal_met"] is None


def test_windows_prompts_and_agreement():
    ids = list(range(100))
    assert [(w.start, len(w.ids), w.first_scored) for w in windows(ids, 30, 30, 0)] == [(0, 30, 1), (30, 30, 1),
                                                                                         (60, 30, 1)]
    assert [(w.start, w.first_scored) for w in windows(ids, 30, 20, 2)] == [(0, 1), (20, 10)]
    with pytest.raises(ValueError, match="4 asked"):
        windows(ids, 30, 30, 4)
    assert greedy_prompts(ids, 3, 10) == [ids[0:10], ids[30:40], ids[60:70]]
    got = agreement([[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 4]], [[1, 2, 3, 4], [1, 2, 0, 4], [1, 2, 3, 4]])
    assert got == {"greedy_identical": 1, "greedy_identical_share": 1 / 3, "agreement": pytest.approx((1 + 0.5) / 3)}


def test_the_shipped_text_is_public_domain_and_long_enough():
    header = DEFAULT_TEXT.read_text(encoding="utf-8").split("\n", 1)[0]
    assert header.startswith("#") and "public domain" in header
    text = read_text(DEFAULT_TEXT)
    assert "#" not in text and len(text.encode()) < 60_000
    assert len(text.split()) > 4096  # words: the default model's tokenizer makes more tokens (8,410)


def test_table_counts_prompts_even_when_none_is_identical():
    row = {"scheme": "int4", "dtype": "bfloat16", "perplexity": 2.0, "perplexity_ratio": 1.01, "goal_max_ratio": 1.05,
           "goal_met": True, "greedy_identical": 0, "greedy_identical_share": 0.0, "agreement": 0.25,
           "prompt_tokens_per_s": 100.0, "output_tokens_per_s": 10.0}
    assert table([row], 16).splitlines()[2] == ("| int4 | bfloat16 | 2.0000 | 1.0100 | <= 1.05 met | 0/16 | 0.250 | "
                                                "100 | 10.0 |")
