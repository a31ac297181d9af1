"""`pagoda bench quality` through the CLI on a tiny random Llama (seed 0, float32, CPU) with the
512-word tokenizer of tests/data/tiny-tokenizer: the perplexity the engine's prompt logprobs give
equals transformers' own over the same windows, full precision agrees with itself exactly, and the
JSON has its documented fields; of two questions, the one whose accepted answer is a word of
transformers' own greedy answer counts as answered. One run (scheme none) serves every check; never
timings."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pagoda.bench.quality import (
    DEFAULT_QUESTIONS, DEFAULT_TEXT, agreement, answered, greedy_prompts, read_questions, read_text, table, windows,
)
from pagoda.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny-llama.json"
TOKENIZER = ROOT / "tests" / "data" / "tiny-tokenizer"
# 150 words w4..w511 (the tiny tokenizer's ids 4..511, one token each): 3 windows of 48 every 40 (overlapping)
TEXT_IDS = torch.randint(4, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()
WINDOW, STRIDE, NUM_WINDOWS = 48, 40, 3
ROW_FIELDS = ["scheme", "quantization", "dtype", "kv_cache_dtype", "mean_nll", "perplexity", "perplexity_ratio", "scored_tokens",
              "greedy_identical", "greedy_identical_share", "agreement", "goal_max_ratio", "goal_met", "factual_correct",
              "factual_share", "load_s",
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


QUESTIONS = ["w20 w21 w22?", "w30 w31?"]
ANSWER_TOKENS = 5


def transformers_answer(directory: Path, model, question: str) -> str:
    """transformers' greedy answer to the question as a chat message, as the engine renders it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=ANSWER_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory):
    directory, model = tiny_model
    tmp = tmp_path_factory.mktemp("quality")
    words = transformers_answer(directory, model, QUESTIONS[0]).split()
    assert words, "transformers' answer has no word"
    questions = tmp / "questions.jsonl"  # the first's answer: a word of transformers' own; the second's: none
    questions.write_text(json.dumps({"question": QUESTIONS[0], "answers": ["w9999", words[-1]]}) + "\n"
                         + json.dumps({"question": QUESTIONS[1], "answers": ["w9999"]}) + "\n")
    text = tmp / "text.txt"
    text.write_text("# a header line, skipped\n" + " ".join(f"w{i}" for i in TEXT_IDS) + "\n")
    out = tmp / "quality.json"
    assert main(["bench", "quality", "--model", str(directory), "--schemes", "none", "--text", str(text),
                 "--window", str(WINDOW), "--stride", str(STRIDE), "--num-windows", str(NUM_WINDOWS),
                 "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "6", "--device", "cpu",
                 "--questions", str(questions), "--answer-tokens", str(ANSWER_TOKENS), "--output", str(out)]) == 0
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
                                "goals", "factual", "rows"]
    assert result["model"] == tiny_model[0].name
    assert result["text"]["tokens"] == len(TEXT_IDS) and len(result["text"]["sha256"]) == 64
    assert (result["window"], result["stride"], result["num_windows"]) == (WINDOW, STRIDE, NUM_WINDOWS)
    assert result["greedy"] == {"num_prompts": 4, "prompt_len": 8, "max_tokens": 6}
    assert result["goals"] == {"int4": {"max_perplexity_ratio": 1.05}, "int8": {"max_perplexity_ratio": 1.05},
                               "fp8": {"max_perplexity_ratio": 1.02}}
    assert [list(row) for row in result["rows"]] == [ROW_FIELDS]
    assert result["rows"][0]["goal_max_ratio"] is None and result["rows"][0]["goal_met"] is None
    assert result["factual"]["num_questions"] == 2 and result["factual"]["answer_tokens"] == ANSWER_TOKENS
    assert (result["rows"][0]["factual_correct"], result["rows"][0]["factual_share"]) == (1, 0.5)


def test_an_answer_counts_as_a_whole_word_in_any_case():
    assert answered("A week has 7 days.", ["seven", "7"]) and answered("PARIS!", ["Paris"])
    assert answered("It absorbs carbon dioxide, mostly", ["carbon dioxide"])
    assert not answered("It has 17 legs", ["7"]) and not answered("Parisian", ["Paris"])
    assert not answered("at 100.5 degrees", ["100"]) and not answered("-18.0 C", ["0"])


def test_the_shipped_questions_each_have_answers():
    questions = read_questions(DEFAULT_QUESTIONS)
    assert len(questions) == 16 and all(q["question"].endswith("?") and q["answers"] for q in questions)
    assert answered("The capital of France is Paris.", questions[0]["answers"])


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
           "factual_correct": 10, "prompt_tokens_per_s": 100.0, "output_tokens_per_s": 10.0}
    assert table([row], 16).splitlines()[2] == ("| int4 | bfloat16 | 2.0000 | 1.0100 | <= 1.05 met | 0/16 | 0.250 | 10 | "
                                                "100 | 10.0 |")
