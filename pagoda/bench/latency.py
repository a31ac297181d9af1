"""`pagoda bench latency`: fixed input and output lengths through the offline engine (vLLM's
benchmarks/benchmark_latency.py).

Each iteration submits a batch of `batch_size` requests at once, each of `input_len` random prompt
token ids (fresh ones every iteration, seeded), generating exactly `output_len` tokens (greedy,
EOS ignored), and drives `LLMEngine.step()` until all have ended, timestamping each request's
first token and its end. `--num-iters-warmup` iterations run first, untimed, for each batch size.

    ttft_s         time to first token: from the batch's submission to the step that returned it
    tpot_s         time per output token after the first: (e2e - ttft) / (output_len - 1)
    e2e_s          a request's end-to-end latency, from the batch's submission
    latency_s      the whole batch's latency, one value per iteration (vLLM's "Avg latency")
    output_tokens_per_s   batch_size * output_len * iterations / the iterations' summed latency

Each of the first four as mean, median, p50, p90, p99 (numpy's linear percentiles), over every
request of every measured iteration (latency_s: over the iterations).

Steps overlap as the engine's default has them (`--no-async-scheduling` for the serial loop): step
N+1 is launched before step N's tokens are read back (scheduler/engine.py). On a GPU that hides
the host's work behind the device's; on the CPU, where the model runs as it is launched, a token
reaches the host a step later than in the serial loop.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from common.protocol import SamplingParams
from pagoda.bench.common import add_engine_arguments, command_words, header, log, model_keys, numbers, write_result
from pagoda.bench.timing import stats

# the goal for scripts/gpu-check.sh: an 8B model (dummy Llama 3.1 8B, bfloat16) on one H100
GOAL_MIN_TOKENS_PER_S_BATCH_1 = 160.0
GOAL_FOR = "an 8B model (dummy:worker/configs/llama-3.1-8b.json, bfloat16) on one H100"


@dataclass(slots=True)
class Iteration:
    """One batch, timed: seconds from its submission."""

    latency: float  # until its last request ended
    ttft: list[float]  # per request
    e2e: list[float]  # per request
    output_tokens: int
    steps: int


def batch_sizes(args) -> list[int]:
    if args.batch_sizes is not None:
        return numbers(args.batch_sizes, "--batch-sizes")
    return [8 if args.batch_size is None else args.batch_size]


def check_args(args) -> list[int]:
    """The batch sizes, once every length and count is usable (before the model loads)."""
    sizes = batch_sizes(args)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"every batch size must be >= 1 (got {', '.join(map(str, sizes)) or 'none'})")
    for flag, value, least in (("--input-len", args.input_len, 1), ("--output-len", args.output_len, 1),
                               ("--num-iters", args.num_iters, 1), ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least} (got {value})")
    if max(sizes) > args.max_num_seqs:
        raise ValueError(f"batch size {max(sizes)} is more than --max-num-seqs {args.max_num_seqs}: the batch would "
                         "not run as one; raise --max-num-seqs")
    return sizes


def distribution(values: list[float]) -> dict[str, float] | None:
    """mean, median and the 50th, 90th and 99th percentiles (timing.percentile); None without values."""
    return stats(values, ("mean", "median", "p50", "p90", "p99")) if values else None


def run_iteration(llm, prompts: list[list[int]], output_len: int, tag: str) -> Iteration:
    """Submit the batch at once and step the engine until every request ended."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    steps_before = engine.num_steps
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    tokens: dict[str, int] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"latency-{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        # step() returns host values: the sampled ids were copied off the device (a synchronizing
        # .tolist() in the executor), so this step's device work is done when the clock is read
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = now
            if out.finished:
                end[out.request_id] = now
                tokens[out.request_id] = len(out.outputs[0].token_ids)
    latency = time.perf_counter() - start
    short = {rid: n for rid, n in tokens.items() if n != output_len}
    if len(end) != len(prompts) or short:
        raise RuntimeError(f"expected {len(prompts)} requests of {output_len} output tokens each; "
                           f"{len(end)} ended, these with other lengths: {short}")
    ids = sorted(end, key=lambda rid: int(rid.rsplit("-", 1)[1]))
    return Iteration(latency, [first[rid] - start for rid in ids], [end[rid] - start for rid in ids],
                     sum(tokens.values()), engine.num_steps - steps_before)


def random_prompts(rng: random.Random, batch_size: int, input_len: int, vocab_size: int) -> list[list[int]]:
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def measure(llm, batch_size: int, args, rng: random.Random, vocab_size: int) -> dict:
    """One row: warm-up iterations, then `args.num_iters` measured ones of this batch size."""
    for k in range(args.num_iters_warmup):
        warm = run_iteration(llm, random_prompts(rng, batch_size, args.input_len, vocab_size), args.output_len,
                             f"b{batch_size}-warmup{k}")
        log(f"batch {batch_size} warm-up {k + 1}/{args.num_iters_warmup}: {warm.latency:.3f} s")
    preemptions = llm.scheduler.num_preemptions
    iterations = []
    for k in range(args.num_iters):
        it = run_iteration(llm, random_prompts(rng, batch_size, args.input_len, vocab_size), args.output_len,
                           f"b{batch_size}-{k}")
        log(f"batch {batch_size} iteration {k + 1}/{args.num_iters}: {it.latency:.3f} s")
        iterations.append(it)
    ttft = [t for it in iterations for t in it.ttft]
    e2e = [t for it in iterations for t in it.e2e]
    # TPOT is undefined for a single output token (no gap after the first)
    tpot = [(e - t) / (args.output_len - 1) for t, e in zip(ttft, e2e)] if args.output_len > 1 else []
    output_tokens = sum(it.output_tokens for it in iterations)
    latencies = [it.latency for it in iterations]
    return {
        "batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "iterations": len(iterations), "requests": len(e2e), "output_tokens": output_tokens,
        "steps": sum(it.steps for it in iterations),
        "preemptions": llm.scheduler.num_preemptions - preemptions,
        "latency_s": distribution(latencies), "ttft_s": distribution(ttft), "tpot_s": distribution(tpot),
        "e2e_s": distribution(e2e), "output_tokens_per_s": output_tokens / sum(latencies),
        "iteration_latencies_s": latencies,
    }


def goal(rows: list[dict]) -> dict:
    """The issue's goal, from the batch-1 row: output tokens/s, prefill included (output_len over the
    batch's latency), against 160 (an 8B model on an H100; scripts/gpu-check.sh)."""
    row = next((r for r in rows if r["batch_size"] == 1), None)
    measured = row["output_tokens_per_s"] if row else None
    return {"for": GOAL_FOR, "min_tokens_per_s_batch_1": GOAL_MIN_TOKENS_PER_S_BATCH_1,
            "tokens_per_s_batch_1": measured,
            "ratio": measured / GOAL_MIN_TOKENS_PER_S_BATCH_1 if row else None,
            "met": measured >= GOAL_MIN_TOKENS_PER_S_BATCH_1 if row else None,
            "decode_tokens_per_s_batch_1": 1 / row["tpot_s"]["median"] if row and row["tpot_s"] else None}


def table(rows: list[dict]) -> str:
    def ms(d: dict | None, key: str) -> str:
        return f"{d[key] * 1e3:.1f}" if d else "-"

    lines = [f"{'batch':>5} {'in':>5} {'out':>5} {'iters':>5} {'latency s':>9}  {'TTFT ms p50/p90/p99':>22}  "
             f"{'TPOT ms p50/p90/p99':>20}  {'E2E ms p50/p99':>16}  {'out tok/s':>9}"]
    for r in rows:
        ttft, tpot, e2e = r["ttft_s"], r["tpot_s"], r["e2e_s"]
        lines.append(
            f"{r['batch_size']:>5} {r['input_len']:>5} {r['output_len']:>5} {r['iterations']:>5} "
            f"{r['latency_s']['mean']:>9.3f}  "
            f"{ms(ttft, 'p50') + '/' + ms(ttft, 'p90') + '/' + ms(ttft, 'p99'):>22}  "
            f"{ms(tpot, 'p50') + '/' + ms(tpot, 'p90') + '/' + ms(tpot, 'p99'):>20}  "
            f"{ms(e2e, 'p50') + '/' + ms(e2e, 'p99'):>16}  {r['output_tokens_per_s']:>9.1f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench latency`'s flags."""
    add_engine_arguments(parser, kv_cache_dtype=True)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request (random ids)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of every request (EOS ignored)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--batch-size", type=int, default=None, help="requests submitted at once (default 8)")
    sizes.add_argument("--batch-sizes", help="several batch sizes, comma-separated (one row each), e.g. 1,64")
    parser.add_argument("--num-iters", type=int, default=5, help="measured iterations per batch size")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first, per batch size")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="worker ranks (ranks 1..N-1 as processes)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="CPU: the decode step compiled (torch.compile); default: as `pagoda up` (on for one CPU rank)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="the serial loop: each step's tokens read back before the next step is planned")
    parser.add_argument("--seed", type=int, default=0, help="the random prompts (and dummy weights)")
    parser.add_argument("--output", help="write the result JSON here")


def cpu_attention_kernels(runner) -> bool | None:
    """Whether a CPU runner's attention ran the C++ kernels (kernels/cpu_ops.py); None on CUDA."""
    from kernels import cpu_ops

    return cpu_ops.available() if runner.device.type == "cpu" else None


def run(args) -> int:
    """The `pagoda bench latency` command."""
    sizes = check_args(args)
    from pagoda.offline import LLM

    llm = LLM(args.model, skip_tokenizer_init=True, device=args.device, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks=args.num_gpu_blocks, tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
              enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling, compile=args.compile)
    try:
        runner = llm.executor.runner
        if args.input_len + args.output_len > llm.config.max_model_len:
            raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} is more than the "
                             f"model's context ({llm.config.max_model_len} tokens)")
        vocab_size = int(runner.hf_config.vocab_size)
        result = {
            # (a false switch is left out of the command: --no-compile is written here)
            **header("latency", command_words("latency", args) + (" --no-compile" if args.compile is False else ""),
                     str(runner.device)),
            **model_keys(runner),
            "kv_cache_dtype": args.kv_cache_dtype,
            "tensor_parallel_size": args.tensor_parallel_size,
            "async_scheduling": not args.no_async_scheduling,
            "enforce_eager": args.enforce_eager,
            "compile": runner.decode_runner is not None and runner.decode_runner.compiled is not None,
            "cpu_attention_kernels": cpu_attention_kernels(runner),
            "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "seed": args.seed,
            "goal": None,  # from the batch-1 row, once measured
            "rows": [],
        }
        rng = random.Random(args.seed)
        for batch_size in sizes:
            result["rows"].append(measure(llm, batch_size, args, rng, vocab_size))
            result["goal"] = goal(result["rows"])
            write_result(result, args.output)  # after each row: a run cut short keeps what it measured
    finally:
        llm.close()
    print(table(result["rows"]))
    g = result["goal"]
    if g["tokens_per_s_batch_1"] is not None:
        print(f"goal ({g['for']}): batch 1 at >= {g['min_tokens_per_s_batch_1']:g} output tokens/s; this run: "
              f"{g['tokens_per_s_batch_1']:.1f} ({g['ratio']:.2f}x) on {result['device']}, {result['model']}")
    return 0
