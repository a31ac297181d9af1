"""`pagoda bench quality`: what a quantization scheme costs in accuracy, through the offline engine.

For each scheme of `--schemes` (default none,int4,int8,fp8) the model is loaded with
`--quantization SCHEME` and measured on a fixed public-domain text (benchmarks/data/, its lines
beginning with '#' skipped), tokenized once with the model's own tokenizer (no special tokens):

    perplexity     exp(mean NLL) over every scored token. The ids are cut into `--num-windows`
                   windows of `--window` tokens starting every `--stride` tokens (default: the window,
                   so they do not overlap); each window is one prompt scored by the engine's prompt
                   logprobs (SamplingParams(prompt_logprobs=0, max_tokens=0): the serving path, chunked
                   prefill included). A window scores each token from the tokens before it in that
                   window: the first window all but its first token, each later one only the tokens
                   no earlier window scored (its last `stride`; all but its first when stride >= window).
    greedy         `--num-prompts` prompts of `--prompt-len` tokens, taken at evenly spaced offsets of
                   the windows' text, each continued by `--max-tokens` greedy tokens (EOS ignored, so
                   every output has that length) under the scheme, and compared with the same prompts'
                   outputs under `none` (full precision, generated first, by a separate load):
                   identical     the share of prompts whose outputs are identical
                   agreement     the mean over prompts of (tokens before the first difference) / max_tokens
                   The `none` row compares a second generation of that same engine with the first: 1.0
                   unless the serving path is not deterministic.

    factual        `--questions` (default benchmarks/data/factual-questions.jsonl: 16 short questions,
                   each with its accepted answers), each asked as a chat message and answered with
                   `--answer-tokens` greedy tokens: correct when an accepted answer stands in the
                   text as a whole word, any case. `--questions ''` skips it.

Each row also has the scheme as the worker describes it, the activation dtype, the load time and
two throughputs, from the same runs (noisy on a shared CPU): prompt tokens/s of the scoring pass
and output tokens/s of the greedy batch.

The result JSON (`--output`): benchmark, command, commit, date, device (as every bench writes
them), model, text {path, sha256, tokens, tokenizer}, window, stride, num_windows, scored_tokens,
greedy {num_prompts, prompt_len, max_tokens}, goals (the issue's: perplexity within 5% of full
precision for int4 and int8, 2% for fp8), and rows: one per scheme, in `--schemes` order, with
scheme, quantization, dtype, kv_cache_dtype, mean_nll, perplexity, perplexity_ratio (to none's; null without a none
row), scored_tokens, greedy_identical (prompts), greedy_identical_share, agreement,
goal_max_ratio and goal_met (null for a scheme without a goal), factual_correct and
factual_share (null without questions), load_s, score_s, prompt_tokens_per_s, generate_s,
output_tokens_per_s; and factual {path, num_questions, answer_tokens} (null without questions).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import DTYPES
from common.protocol import SamplingParams
from pagoda.bench.common import ROOT, command_words, device_description, header, log, names, write_result

DEFAULT_TEXT = ROOT / "benchmarks" / "data" / "alice-in-wonderland-ch1-3.txt"
DEFAULT_QUESTIONS = ROOT / "benchmarks" / "data" / "factual-questions.jsonl"
DEFAULT_SCHEMES = "none,int4,int8,fp8"
REFERENCE = "none"
# the issue's accuracy goals: perplexity on the shipped text at most this many times full precision's
GOAL_MAX_PERPLEXITY_RATIO = {"int4": 1.05, "int8": 1.05, "fp8": 1.02}


def read_text(path: str | Path) -> str:
    """The text of `path`, less its lines beginning with '#' (the header naming its source)."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    return "\n".join(line for line in lines if not line.startswith("#")).strip() + "\n"


@dataclass(frozen=True, slots=True)
class Window:
    start: int  # offset of its first token in the text's ids
    ids: list[int]
    first_scored: int  # index in `ids` of its first scored token (>= 1: the first token has no context)


def windows(ids: list[int], window: int, stride: int, num_windows: int) -> list[Window]:
    """`num_windows` (0: as many as fit) windows of `window` tokens every `stride` tokens, each
    scoring the tokens no earlier window scored."""
    if window < 2 or stride < 1:
        raise ValueError(f"--window must be >= 2 and --stride >= 1 (got {window}, {stride})")
    fit = 0 if len(ids) < window else (len(ids) - window) // stride + 1
    count = fit if num_windows == 0 else num_windows
    if count < 1 or count > fit:
        raise ValueError(f"the text has {len(ids)} tokens: {fit} windows of {window} every {stride} fit, "
                         f"{count} asked (--num-windows)")
    out = []
    for k in range(count):
        start = k * stride
        out.append(Window(start, ids[start:start + window], 1 if k == 0 or stride >= window else window - stride))
    return out


def greedy_prompts(ids: list[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_len` tokens at evenly spaced offsets of `ids`."""
    if num_prompts < 1 or prompt_len < 1 or len(ids) < prompt_len:
        raise ValueError(f"cannot take {num_prompts} prompts of {prompt_len} tokens from {len(ids)} tokens")
    step = (len(ids) - prompt_len) // num_prompts if num_prompts > 1 else 0
    return [ids[i * step:i * step + prompt_len] for i in range(num_prompts)]


def token_nlls(llm, wins: list[Window]) -> list[float]:
    """The negative logprob of each scored token of every window, in text order, from the engine's
    prompt logprobs; each entry checked to be the actual prompt token's."""
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w.ids} for w in wins], params, use_tqdm=False)
    nlls = []
    for w, out in zip(wins, outs):
        entries = out.prompt_logprobs
        if (list(out.prompt_token_ids) != w.ids or entries is None or len(entries) != len(w.ids)
                or entries[0] is not None):
            raise RuntimeError(f"window at token {w.start}: prompt logprobs do not match its {len(w.ids)} tokens")
        for token_id, entry in zip(w.ids[w.first_scored:], entries[w.first_scored:]):
            own = next(iter(entry))  # the prompt token's own entry comes first
            if own != token_id:
                raise RuntimeError(f"window at token {w.start}: a prompt logprob is token {own}'s, not {token_id}'s")
            nlls.append(-entry[token_id].logprob)
    return nlls


def perplexity(nlls: list[float]) -> float:
    return math.exp(math.fsum(nlls) / len(nlls))


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.token_ids) for out in outs]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """identical: prompts whose outputs equal the reference's; share: of all prompts; agreement: the
    mean over prompts of the reference's tokens matched before the first difference, as a fraction."""
    if len(outputs) != len(reference) or not reference:
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    identical, fractions = 0, []
    for out, ref in zip(outputs, reference):
        identical += out == ref
        matched = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        fractions.append(matched / len(ref) if ref else 1.0)
    return {"greedy_identical": identical, "greedy_identical_share": identical / len(reference),
            "agreement": math.fsum(fractions) / len(fractions)}


def read_questions(path: str | Path) -> list[dict]:
    """[{question, answers}] of a JSON-lines file."""
    questions = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for q in questions:
        if not isinstance(q.get("question"), str) or not q.get("answers"):
            raise ValueError(f"{path}: each line needs a question and its answers (got {q!r})")
    return questions


def answered(text: str, answers: list[str]) -> bool:
    """Whether an accepted answer stands in `text` as a whole word (or words), any case: "7" in "7
    days" but not in "17", "100" not in "100.5"."""
    return any(re.search(rf"(?<![\w.]){re.escape(a)}(?![\w]|\.\d)", text, re.IGNORECASE) for a in answers)


def factual(llm, questions: list[dict], max_tokens: int) -> list[bool]:
    """Each question asked as a chat message, answered greedily: whether the answer holds one it accepts."""
    prompts = [{"messages": [{"role": "user", "content": q["question"]}]} for q in questions]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [answered(o.outputs[0].text, q["answers"]) for o, q in zip(outputs, questions)]


def load(args, scheme: str):
    from pagoda.offline import LLM

    return LLM(args.model, device=args.device, dtype=args.dtype, quantization=scheme,
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               enable_prefix_caching=False)


def measure(args, scheme: str, wins: list[Window], prompts: list[list[int]],
            reference: list[list[int]] | None, questions: list[dict] = ()) -> tuple[dict, list[list[int]], str]:
    """One scheme's row (without the ratio to none's), its greedy outputs and the engine's device."""
    t0 = time.perf_counter()
    llm = load(args, scheme)
    try:
        load_s = time.perf_counter() - t0
        runner = llm.executor.runner
        t0 = time.perf_counter()
        nlls = token_nlls(llm, wins)
        score_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = greedy(llm, prompts, args.max_tokens)
        generate_s = time.perf_counter() - t0
        if reference is None and scheme == REFERENCE:  # the none row: a second run against the first
            reference, outputs = outputs, greedy(llm, prompts, args.max_tokens)
        correct = sum(factual(llm, questions, args.answer_tokens)) if questions else None
        row = {
            "scheme": scheme,
            "quantization": runner.scheme.describe() if runner.scheme is not None else "none",
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
            "mean_nll": math.fsum(nlls) / len(nlls), "perplexity": perplexity(nlls), "perplexity_ratio": None,
            "scored_tokens": len(nlls),
            **(agreement(outputs, reference) if reference is not None else
               {"greedy_identical": None, "greedy_identical_share": None, "agreement": None}),
            "goal_max_ratio": GOAL_MAX_PERPLEXITY_RATIO.get(scheme), "goal_met": None,
            "factual_correct": correct, "factual_share": None if correct is None else correct / len(questions),
            "load_s": load_s, "score_s": score_s, "prompt_tokens_per_s": sum(len(w.ids) for w in wins) / score_s,
            "generate_s": generate_s, "output_tokens_per_s": len(prompts) * args.max_tokens / generate_s,
        }
        log(f"{scheme}: perplexity {row['perplexity']:.4f}, agreement {row['agreement']}, factual {correct}, "
            f"load {load_s:.1f} s, scoring {score_s:.1f} s, greedy {generate_s:.1f} s")
        return row, reference if scheme == REFERENCE else outputs, str(runner.device)
    finally:
        llm.close()
        del llm
        gc.collect()


def with_ratios(rows: list[dict]) -> list[dict]:
    ref = next((r for r in rows if r["scheme"] == REFERENCE), None)
    for r in rows:
        if ref is not None:
            r["perplexity_ratio"] = r["perplexity"] / ref["perplexity"]
            if r["goal_max_ratio"] is not None:
                r["goal_met"] = r["perplexity_ratio"] <= r["goal_max_ratio"]
    return rows


def table(rows: list[dict], num_prompts: int) -> str:
    def f(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| scheme | dtype | perplexity | ratio to none | goal | greedy identical | agreement | factual | "
             "prompt tok/s | output tok/s |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        met = "" if r["goal_met"] is None else (" met" if r["goal_met"] else " MISSED")
        goal = "-" if r["goal_max_ratio"] is None else f"<= {r['goal_max_ratio']:.2f}{met}"
        identical = "-" if r["greedy_identical"] is None else f"{r['greedy_identical']}/{num_prompts}"
        lines.append(f"| {r['scheme']} | {r['dtype']} | {r['perplexity']:.4f} | {f(r['perplexity_ratio'], '.4f')} | "
                     f"{goal} | {identical} | {f(r['agreement'], '.3f')} | {f(r.get('factual_correct'), 'd')} | "
                     f"{r['prompt_tokens_per_s']:.0f} | "
                     f"{r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench quality`'s flags."""
    parser.add_argument("--model", default="default", help="as for generate (a model with a tokenizer)")
    parser.add_argument("--schemes", default="none,int4,int8,fp8",
                        help="--quantization schemes, comma-separated, one row each (none's greedy outputs are the reference)")
    parser.add_argument("--text", help="the text scored, lines beginning with '#' skipped (default: "
                                       "benchmarks/data/alice-in-wonderland-ch1-3.txt, public domain)")
    parser.add_argument("--window", type=int, default=512, help="tokens of each scored window")
    parser.add_argument("--stride", type=int, default=None, help="tokens between windows' starts (default: the window)")
    parser.add_argument("--num-windows", type=int, default=8, help="windows scored, from the text's start (0: all that fit)")
    parser.add_argument("--num-prompts", type=int, default=16, help="greedy prompts, evenly spaced over the scored text")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of each greedy prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated per prompt (EOS ignored)")
    parser.add_argument("--questions", help="short questions asked as chat messages, JSON lines of {question, answers} "
                                            "(default: benchmarks/data/factual-questions.jsonl; '': none)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="greedy tokens of each answer")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="activations (auto: each scheme's own)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="every scheme's KV cache: auto or fp8 (compare two runs)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench quality` command."""
    from common.config import QUANTIZATIONS
    from common.models import resolve_model
    from common.tokenizer import load_tokenizer

    schemes = names(args.schemes)
    unknown = [s for s in schemes if s not in QUANTIZATIONS]
    if not schemes or unknown or len(set(schemes)) != len(schemes):
        raise ValueError(f"--schemes takes distinct schemes of {', '.join(QUANTIZATIONS)} (got {args.schemes!r})")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    stride = args.window if args.stride is None else args.stride
    text_path = Path(args.text) if args.text else DEFAULT_TEXT
    text = read_text(text_path)
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    wins = windows(ids, args.window, stride, args.num_windows)
    covered = ids[:wins[-1].start + args.window]
    prompts = greedy_prompts(covered, args.num_prompts, args.prompt_len)
    questions_path = DEFAULT_QUESTIONS if args.questions is None else args.questions
    questions = read_questions(questions_path) if questions_path else []
    result = {
        **header("quality", command_words("quality", args)),  # the device: once an engine has one
        "model": source.name,
        "text": {"path": str(text_path.resolve().relative_to(ROOT)) if text_path.resolve().is_relative_to(ROOT)
                 else str(text_path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "tokens": len(ids),
                 "tokenizer": type(tokenizer).__name__},
        "window": args.window, "stride": stride, "num_windows": len(wins), "scored_tokens": None,
        "greedy": {"num_prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "goals": {s: {"max_perplexity_ratio": g} for s, g in GOAL_MAX_PERPLEXITY_RATIO.items()},
        "factual": {"path": str(Path(questions_path).resolve().relative_to(ROOT))
                    if Path(questions_path).resolve().is_relative_to(ROOT) else str(questions_path), "num_questions": len(questions), "answer_tokens": args.answer_tokens}
        if questions else None,
        "rows": [],
    }
    # the reference first: every other scheme's greedy outputs are compared with none's
    order = ([REFERENCE] if REFERENCE in schemes else []) + [s for s in schemes if s != REFERENCE]
    reference = None
    rows = {}
    if REFERENCE not in schemes:
        reference = _reference_outputs(args, prompts)
    for scheme in order:
        row, outputs, device = measure(args, scheme, wins, prompts, reference, questions)
        if scheme == REFERENCE:
            reference = outputs
        rows[scheme] = row
        result["device"] = device_description(device)
        result["rows"] = with_ratios([rows[s] for s in schemes if s in rows])
        result["scored_tokens"] = row["scored_tokens"]
        write_result(result, args.output)  # after each scheme: a run cut short keeps what it measured
    print(table(result["rows"], len(prompts)))
    return 0


def _reference_outputs(args, prompts: list[list[int]]) -> list[list[int]]:
    """`none`'s greedy outputs, for a run whose --schemes leave none out."""
    llm = load(args, REFERENCE)
    try:
        return greedy(llm, prompts, args.max_tokens)
    finally:
        llm.close()
        del llm
        gc.collect()
