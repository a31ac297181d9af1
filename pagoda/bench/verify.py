"""`pagoda bench verify`: what a speculative verify step costs against a plain decode step, in the
model runner (docs/speculative.md).

For each batch size B, B sequences of `--context-len` random tokens are prefilled, then two steps
are timed, each the runner's forward over the same positions again and again (its KV rewritten
with the same values):

    decode     each sequence computes its one next token          B rows
    verify k   each computes that token and k drafts after it     B x (1 + k) query tokens

The forward is what `LLMEngine` runs: on CUDA the decode step replays its CUDA graph, and so does
a verify step, by batch expansion (worker/cuda_graph.py), while its rows fit the largest bucket;
`verify_eager_ms` is the same step through the chunk path, for comparison. Each time is the median
of `--iters` runs after `--warmup` untimed ones, each run synchronized, the steps taken in turn (a
drift of the machine's speed falls on all of them alike). The issue's goal, on an
H100 or H200 with an 8B model: the verify step for k = 4 at batch 1 at most 1.3x the decode step.
"""
from __future__ import annotations

import argparse
import random

from pagoda.bench.common import add_engine_arguments, command_words, header, log, model_keys, numbers, write_result
from pagoda.bench.timing import time_in_turn

GOAL_MAX_RATIO = 1.3  # verify (k = 4) over decode, batch 1
GOAL_FOR = "an 8B model (dummy:worker/configs/llama-3.1-8b.json, bfloat16) on one H100/H200"


def _ints(text: str, flag: str) -> list[int]:
    values = numbers(text, flag)
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes numbers >= 1 (got {text!r})")
    return values


def _through_chunks(runner, step):
    """The runner's forward over a verify step with batch expansion off: the chunk path."""
    graphs = runner.decode_runner
    expand, graphs.expand_short = graphs.expand_short, False
    try:
        return runner.forward(step)
    finally:
        graphs.expand_short = expand


def measure(runner, batch_size: int, ks: list[int], args, rng: random.Random) -> dict:
    """One row: decode and verify steps of `batch_size` sequences at the context length."""
    from common.plan_state import PlanState, ScheduledSequence
    from common.protocol import NewSequence, SamplingParams, StepPlan

    bs, length, most = runner.block_size, args.context_len, max(ks)
    vocab = int(runner.hf_config.vocab_size)
    blocks_per_seq = -(-(length + most + 1) // bs)
    base = 1000 * batch_size  # seq ids of this row
    state, plan = PlanState(bs), StepPlan(1, 0)
    for i in range(batch_size):
        prompt = [rng.randrange(vocab) for _ in range(length + 1)]  # the last one: the token each step computes
        table = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        plan.new_seqs.append(NewSequence(base + i, prompt, [], table, 0, length, SamplingParams(temperature=0)))
    scheduled = state.apply(plan)
    runner.update_inputs(state.changes)
    for s in scheduled:  # prefill, one sequence at a time
        runner.forward_eager(runner.prepare([s]))
    held = [s.held for s in scheduled]
    decode = runner.prepare([ScheduledSequence(base + i, h, length, 1, 1) for i, h in enumerate(held)])
    runs = {"decode": lambda: runner.forward(decode)}
    graphs = runner.decode_runner
    entries = []
    for k in ks:
        drafts = [[rng.randrange(vocab) for _ in range(k)] for _ in held]
        verify = runner.prepare([ScheduledSequence(base + i, h, length, 1 + k, 1, d)
                                 for i, (h, d) in enumerate(zip(held, drafts))])
        expands = graphs is not None and graphs.can_run(verify)
        entries.append({"k": k, "query_tokens": batch_size * (1 + k),
                        "in_graphs": expands and runner.device.type == "cuda"})
        runs[f"verify {k}"] = lambda verify=verify: runner.forward(verify)
        if expands:  # the same step through the chunk path
            runs[f"chunks {k}"] = lambda verify=verify: _through_chunks(runner, verify)
    times = time_in_turn(runs, args.iters, args.warmup, sync=runner.synchronize)
    row = {"batch_size": batch_size, "context_len": length, "decode_ms": 1e3 * times["decode"], "verify": entries}
    log(f"batch {batch_size}: decode {row['decode_ms']:.2f} ms")
    for entry in entries:
        k = entry["k"]
        entry["verify_ms"] = 1e3 * times[f"verify {k}"]
        if f"chunks {k}" in times:
            entry["verify_eager_ms"] = 1e3 * times[f"chunks {k}"]
        entry["ratio"] = entry["verify_ms"] / row["decode_ms"]
        log(f"batch {batch_size}, k {k}: verify {entry['verify_ms']:.2f} ms ({entry['ratio']:.2f}x decode)"
            + (f", through the chunk path {entry['verify_eager_ms']:.2f} ms" if "verify_eager_ms" in entry else ""))
    state.apply(StepPlan(2, 0, finished_seq_ids=[base + i for i in range(batch_size)]))
    runner.update_inputs(state.changes)
    return row


def goal(rows: list[dict]) -> dict:
    row = next((r for r in rows if r["batch_size"] == 1), None)
    entry = next((e for e in row["verify"] if e["k"] == 4), None) if row else None
    ratio = entry["ratio"] if entry else None
    return {"for": GOAL_FOR, "max_ratio_k4_batch_1": GOAL_MAX_RATIO, "ratio": ratio,
            "met": ratio <= GOAL_MAX_RATIO if ratio is not None else None}


def table(rows: list[dict]) -> str:
    lines = [f"{'batch':>5} {'k':>3} {'decode ms':>10} {'verify ms':>10} {'ratio':>6} {'graphs':>6} {'chunk path ms':>14}"]
    for r in rows:
        for e in r["verify"]:
            eager = f"{e['verify_eager_ms']:.2f}" if "verify_eager_ms" in e else "-"
            lines.append(f"{r['batch_size']:>5} {e['k']:>3} {r['decode_ms']:>10.2f} {e['verify_ms']:>10.2f} "
                         f"{e['ratio']:>6.2f} {'yes' if e['in_graphs'] else 'no':>6} {eager:>14}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench verify`'s flags."""
    add_engine_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,16", help="sequences per step, comma-separated (one row each)")
    parser.add_argument("--num-speculative-tokens", default="1,2,4", help="drafts per sequence (k), comma-separated")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens each sequence holds before the step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the largest CUDA graph bucket (rows)")
    parser.add_argument("--iters", type=int, default=30, help="timed runs of each step (the median is reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench verify` command."""
    sizes = _ints(args.batch_sizes, "--batch-sizes")
    ks = _ints(args.num_speculative_tokens, "--num-speculative-tokens")
    if max(ks) > 16:
        raise ValueError("--num-speculative-tokens: at most 16 drafts")
    if args.context_len < 1:
        raise ValueError(f"--context-len must be >= 1 (got {args.context_len})")
    from pagoda.offline import LLM

    bs = 16
    blocks = 1 + max(sizes) * -(-(args.context_len + max(ks) + 1) // bs)
    llm = LLM(args.model, skip_tokenizer_init=True, device=args.device, dtype=args.dtype,
              quantization=args.quantization, max_num_seqs=max(args.max_num_seqs, max(sizes)), block_size=bs,
              max_num_batched_tokens=max(2048, args.context_len + 1), num_gpu_blocks=blocks, num_cpu_blocks=0,
              seed=args.seed, enforce_eager=args.enforce_eager)
    try:
        runner = llm.executor.runner
        if args.context_len + max(ks) + 1 > runner.max_model_len:
            raise ValueError(f"--context-len {args.context_len} and {max(ks)} drafts do not fit the model's "
                             f"context ({runner.max_model_len} tokens)")
        result = {
            **header("verify", command_words("verify", args), str(runner.device)),
            **model_keys(runner),
            "cuda_graphs": runner.device.type == "cuda" and runner.decode_runner is not None,
            "iters": args.iters, "warmup": args.warmup, "goal": None, "rows": [],
        }
        rng = random.Random(args.seed)
        for batch_size in sizes:
            result["rows"].append(measure(runner, batch_size, ks, args, rng))
            result["goal"] = goal(result["rows"])
            write_result(result, args.output)
    finally:
        llm.close()
    print(table(result["rows"]))
    g = result["goal"]
    if g["ratio"] is not None:
        print(f"goal ({g['for']}): a k=4 verify step at batch 1 at most {GOAL_MAX_RATIO}x a decode step; this run: "
              f"{g['ratio']:.2f}x on {result['device']}, {result['model']}")
    return 0
