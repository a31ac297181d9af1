"""`pagoda bench kernels`: Triton PagedAttention decode against the roofline and against SDPA (CUDA only).

For each model's attention shape, batch size and context length, one decode step: one query per
sequence, every sequence `context` tokens long, its blocks scattered over a shuffled pool.

- Achieved bandwidth: (KV + Q + O bytes) / time, beside a large device-to-device copy measured in
  the same process, (read + write bytes) / time: what a memory-bound kernel can reach.
- Time beside torch.nn.functional.scaled_dot_product_attention (the FlashAttention backend when it
  takes the shape) over a contiguous [batch, kv_heads, context, head_dim] cache of the same values.

Timing: a CUDA graph of several calls (launch overhead out, as in a CUDA-graph decode step) that
cycle through enough copies of the inputs to overflow L2, so every call reads HBM; the median of
a few replays, per call.

`--tune` instead times every tile config of `kernels.tuning.config_space` (triton.testing.do_bench,
median) for each model's (head_dim, group), decode launches over the batch sizes x context lengths
and prefill launches over prompts of those lengths, picks per phase the config with the lowest
geometric mean of time / the case's best time, and merges it into the tuned table
(kernels/tuned/attention.json by default) under this GPU's name: commit that file to ship it.

`--moe` instead times the fused MoE kernel (`kernels.fused_moe`, Triton) against the loop over
experts it replaces (`kernels.moe.fused_moe_reference`: one GEMM pair per expert hit, a host sync
to list them) at Mixtral-8x7B's shape (hidden 4096, intermediate 14336, 8 experts, top-2) and
Qwen3-30B-A3B's (2048, 768, 128 experts, top-8), per batch size: both eager (what the loop can
do), the fused kernel also in a CUDA graph (it never syncs the host). Each row cycles a few random
routings, so calls read other experts' weights as successive layers do; it reports the experts
hit, their weight bytes over time beside the copy bandwidth (decode is bound by them), TFLOP/s,
the tile config, and the largest difference between the two outputs. Without CUDA it times the
loop alone on a tiny shape and says so. GPU results belong in
benchmarks/results/<date>-<device>-kernels-moe.json.

`--int4` instead times the int4 weight-only GEMM (kernels/triton_int4.py: the AWQ/GPTQ/
compressed-tensors checkpoints' kernel, group 128) beside the bf16 GEMM (F.linear, cuBLAS) on
Llama-3.1-8B's linear shapes at batch 1, 16 and 256 (`--batch-sizes` to change), each in a CUDA graph
over enough weight copies to overflow L2: time, the weight bytes read over time, int4's speed-up.

`--swap` instead times the KV swap between the device pool and the pinned host pool, staged
against direct (`run_swap`), for 128 and 512 scattered blocks unless `--batch-sizes` says.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pagoda.bench.common import command_words, emit, header, names, numbers

# (num_heads, num_kv_heads, head_dim), as in worker/configs/*.json
ATTENTION_SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
ATTENTION_MODELS = "llama-3.1-8b,smollm2-135m"  # --models' default
BATCH_SIZES = "1,16,64,256"  # --batch-sizes' default
GOAL = {"model": "llama-3.1-8b", "batch": 64, "context": 2048, "min_fraction_of_copy": 0.80, "max_time_vs_sdpa": 1.05}
MAX_INPUT_COPIES = 512
CALLS_PER_GRAPH = 10
REPLAYS = 7


@dataclass
class DecodeInputs:
    query: torch.Tensor  # [batch, num_heads, head_dim]
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [batch, context / block_size] int32, shuffled
    seq_lens: torch.Tensor  # [batch] int32, all `context`
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    out: torch.Tensor

    def paged(self, context: int):
        """Triton paged attention over these inputs, as a call."""
        import kernels

        return lambda: kernels.paged_attention(self.query, self.kv_cache, self.block_tables, self.seq_lens,
                                               self.cu_seqlens_q, self.query.shape[-1] ** -0.5, out=self.out,
                                               impl="triton", max_seqlen_k=context)

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SDPA's layout of the same values: q [batch, heads, 1, hd], k and v [batch, kv_heads, context, hd]."""
        blocks = self.kv_cache[self.block_tables.long()]  # [batch, nblk, 2, block_size, kvh, hd]
        batch, nblk, _, block_size, kvh, hd = blocks.shape
        kv = blocks.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, kvh, nblk * block_size, hd)
        context = int(self.seq_lens[0])
        return self.query[:, :, None], kv[0, :, :, :context].contiguous(), kv[1, :, :, :context].contiguous()


def decode_inputs(batch: int, context: int, shape: tuple[int, int, int], block_size: int, dtype: torch.dtype,
                  device: torch.device, gen: torch.Generator) -> DecodeInputs:
    num_heads, num_kv_heads, head_dim = shape
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1  # block 0 is the null block
    ids = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq] + 1
    kv_cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    query = torch.randn((batch, num_heads, head_dim), dtype=dtype, device=device)
    return DecodeInputs(
        query, kv_cache, ids.view(batch, blocks_per_seq).to(device, torch.int32),
        torch.full((batch,), context, dtype=torch.int32, device=device),
        torch.arange(batch + 1, dtype=torch.int32, device=device), torch.empty_like(query),
    )


def decode_bytes(batch: int, context: int, shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """KV read + Q read + O written."""
    num_heads, num_kv_heads, head_dim = shape
    size = torch.finfo(dtype).bits // 8
    return batch * head_dim * size * (2 * context * num_kv_heads + 2 * num_heads)


def time_per_call(calls: list) -> float:
    """Seconds per call: a CUDA graph of calls cycling through `calls` (each on its own inputs)."""
    for call in calls:
        call()  # compile, size workspaces
    torch.cuda.synchronize()
    per_graph = len(calls) * math.ceil(CALLS_PER_GRAPH / len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    graph.replay()
    return event_timed(graph.replay, per_graph)


def event_timed(run, calls: int) -> float:
    """Seconds per call of `run`, which makes `calls` calls, between two CUDA events: the median of REPLAYS."""
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def input_set(batch: int, context: int, shape: tuple[int, int, int], block_size: int, dtype: torch.dtype,
              device: torch.device, nbytes: int) -> list[DecodeInputs]:
    """Copies of a decode step's inputs (seeded by the case) that, cycled, overflow L2 (4x its size):
    every call reads HBM."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    return [decode_inputs(batch, context, shape, block_size, dtype, device, gen)
            for _ in range(min(max(math.ceil(4 * l2 / nbytes), 1), MAX_INPUT_COPIES))]


def require_gpu(no_cuda: str) -> None:
    """A ValueError saying `no_cuda` without a CUDA GPU, or that the kernels would run in Triton's interpreter."""
    if not torch.cuda.is_available():
        raise ValueError(no_cuda)
    from kernels.triton_common import interpreting

    if interpreting():
        raise ValueError("TRITON_INTERPRET=1 is set: the kernels would run in Triton's interpreter; unset it")


def versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def chosen_models(args, shapes: dict, default: str, what: str = "model") -> list[str]:
    """--models (else `default`), each one of `shapes`."""
    models = names(args.models or default)
    for model in models:
        if model not in shapes:
            raise ValueError(f"unknown {what} {model!r}: choose from {', '.join(shapes)}")
    return models


def batch_sizes(args, default: str) -> list[int]:
    """--batch-sizes, or `default` where the flag keeps the attention rows' default."""
    return numbers(args.batch_sizes if args.batch_sizes != BATCH_SIZES else default, "--batch-sizes")


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict:
    """(read + write bytes) / time of a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_per_call([lambda: dst.copy_(src)])
    return {"bytes": nbytes, "time_us": seconds * 1e6, "bandwidth_GBps": 2 * nbytes / seconds / 1e9}


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """SDPA on the FlashAttention backend if it takes the shape, else on torch's choice; and its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    try:
        flash()
        return flash, "flash"
    except RuntimeError:
        return (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)), "default"


def bench_shape(model: str, batch: int, context: int, block_size: int, dtype: torch.dtype, device: torch.device,
                copy_GBps: float) -> dict:
    from kernels.triton_attention import launch_plan

    shape = ATTENTION_SHAPES[model]
    num_heads, num_kv_heads, head_dim = shape
    nbytes = decode_bytes(batch, context, shape, dtype)
    inputs = input_set(batch, context, shape, block_size, dtype, device, nbytes)
    sdpa = [sdpa_call(*x.contiguous(), head_dim**-0.5) for x in inputs]
    paged_s = time_per_call([x.paged(context) for x in inputs])
    sdpa_s = time_per_call([call for call, _ in sdpa])
    diff = (inputs[0].paged(context)().float() - sdpa[0][0]()[:, :, 0].float()).abs().max().item()
    config, kv_splits = launch_plan(batch, batch, num_kv_heads, num_heads // num_kv_heads, head_dim, context, device,
                                    dtype=dtype, block_size=block_size)
    return {
        "model": model, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "batch": batch, "context": context, "block_size": block_size, "kv_splits": kv_splits,
        "config": {"block_m": config.block_m, "block_n": config.block_n, "num_warps": config.num_warps,
                   "num_stages": config.num_stages}, "bytes": nbytes,
        "pagoda": {"time_us": paged_s * 1e6, "bandwidth_GBps": nbytes / paged_s / 1e9,
                   "fraction_of_copy_bandwidth": nbytes / paged_s / 1e9 / copy_GBps},
        "baseline": {"name": "torch SDPA over a contiguous KV cache", "backend": sdpa[0][1], "time_us": sdpa_s * 1e6,
                     "bandwidth_GBps": nbytes / sdpa_s / 1e9},
        "time_ratio_vs_sdpa": paged_s / sdpa_s, "max_abs_diff_vs_sdpa": diff, "input_copies": len(inputs),
    }


def bench_fp8_kv(row: dict, block_size: int, dtype: torch.dtype, device: torch.device, copy_GBps: float) -> dict:
    """The goal shape's decode over an fp8 KV cache (`--kv-cache-dtype fp8`, scales 1.0): the same
    kernel's KV_FP8 variant, its bandwidth counted on its own bytes (1-byte K and V), beside the
    full-precision row's time."""
    model, batch, context = row["model"], row["batch"], row["context"]
    shape = ATTENTION_SHAPES[model]
    num_heads, num_kv_heads, head_dim = shape
    size = torch.finfo(dtype).bits // 8
    nbytes = batch * head_dim * (2 * context * num_kv_heads + 2 * num_heads * size)  # K, V at 1 byte; Q, O
    inputs = [replace(x, kv_cache=x.kv_cache.to(torch.float8_e4m3fn))
              for x in input_set(batch, context, shape, block_size, dtype, device, nbytes)]
    seconds = time_per_call([x.paged(context) for x in inputs])
    return {"model": model, "batch": batch, "context": context, "kv_cache_dtype": "float8_e4m3fn", "bytes": nbytes,
            "time_us": seconds * 1e6, "bandwidth_GBps": nbytes / seconds / 1e9,
            "fraction_of_copy_bandwidth": nbytes / seconds / 1e9 / copy_GBps,
            "time_ratio_vs_full_precision": seconds / (row["pagoda"]["time_us"] / 1e6)}


def goal_check(rows: list[dict]) -> dict | None:
    goal = (GOAL["model"], GOAL["batch"], GOAL["context"])
    row = next((r for r in rows if (r["model"], r["batch"], r["context"]) == goal), None)
    if row is None:
        return None
    fraction, ratio = row["pagoda"]["fraction_of_copy_bandwidth"], row["time_ratio_vs_sdpa"]
    return {**GOAL, "fraction_of_copy": fraction, "time_vs_sdpa": ratio,
            "met": fraction >= GOAL["min_fraction_of_copy"] and ratio <= GOAL["max_time_vs_sdpa"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench kernels`'s flags."""
    parser.add_argument("--models", help="attention shapes, comma-separated (default llama-3.1-8b,smollm2-135m); with "
                                         "--moe, MoE shapes (default mixtral-8x7b,qwen3-30b-a3b; tiny without CUDA)")
    parser.add_argument("--batch-sizes", default=BATCH_SIZES)
    parser.add_argument("--context-lens", default="512,2048,8192")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--output", help="write the result JSON here")
    parser.add_argument("--tune", action="store_true",
                        help="time every attention tile config instead, and write the best per phase to the tuned table")
    parser.add_argument("--tune-output", help="the tuned table to merge into (default: kernels/tuned/attention.json)")
    parser.add_argument("--moe", action="store_true",
                        help="time the fused MoE kernel against a loop over experts instead (without CUDA: "
                             "the loop alone, on a tiny shape)")
    parser.add_argument("--int4", action="store_true",
                        help="time the Triton int4 weight-only GEMM beside the bf16 GEMM on Llama-3.1-8B's linear "
                             "shapes instead (batch 1, 16, 256 unless --batch-sizes says; CUDA only)")
    parser.add_argument("--swap", action="store_true",
                        help="time the KV swap between the device pool and pinned host memory instead, staged against "
                             "direct, at Llama-3.1-8B's pool shape (128 and 512 blocks unless --batch-sizes says; CUDA only)")


def run(args) -> int:
    """The `pagoda bench kernels` handler: the JSON result on stdout (and in --output), a table on stderr."""
    if args.moe:
        return run_moe(args)
    if args.int4:
        return run_int4(args)
    if args.swap:
        return run_swap(args)
    require_gpu("bench kernels times the Triton kernels on a CUDA GPU, and torch sees none here; "
                "run it on a GPU host (the kernels' CPU tests are `make test`)")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    if args.tune:
        return tune(args, device, dtype)
    copy = copy_bandwidth(device)
    rows = []
    for model in chosen_models(args, ATTENTION_SHAPES, ATTENTION_MODELS):
        for batch in numbers(args.batch_sizes, "--batch-sizes"):
            for context in numbers(args.context_lens, "--context-lens"):
                rows.append(bench_shape(model, batch, context, args.block_size, dtype, device, copy["bandwidth_GBps"]))
                _print_row(rows[-1])
                torch.cuda.empty_cache()
    goal = (GOAL["model"], GOAL["batch"], GOAL["context"])
    fp8_rows = [bench_fp8_kv(r, args.block_size, dtype, device, copy["bandwidth_GBps"]) for r in rows
                if (r["model"], r["batch"], r["context"]) == goal]
    for r in fp8_rows:
        print(f"{r['model']:>13} batch {r['batch']:>3} x {r['context']:>5}: fp8 KV {r['time_us']:7.1f} us "
              f"{r['bandwidth_GBps']:7.0f} GB/s on its bytes ({r['fraction_of_copy_bandwidth']:.0%} of copy), "
              f"{r['time_ratio_vs_full_precision']:.2f}x the {args.dtype} cache's time", file=sys.stderr, flush=True)
    result = {
        **header("kernels: paged decode attention", command_words("kernels", args), str(device)),
        **versions(), "dtype": args.dtype,
        "timer": "CUDA graph of repeated calls over inputs cycled past L2; median of replays, per call",
        "copy": copy, "results": rows, "goal": goal_check(rows), "fp8_kv": fp8_rows,
    }
    return emit(result, args.output)


def _print_row(row: dict) -> None:
    print(
        f"{row['model']:>13} batch {row['batch']:>3} x {row['context']:>5}: paged {row['pagoda']['time_us']:8.1f} us "
        f"{row['pagoda']['bandwidth_GBps']:7.0f} GB/s ({row['pagoda']['fraction_of_copy_bandwidth']:.0%} of copy), "
        f"sdpa {row['baseline']['time_us']:8.1f} us -> {row['time_ratio_vs_sdpa']:.2f}x, splits {row['kv_splits']}",
        file=sys.stderr, flush=True,
    )


# ----------------------------------------------------------------------------- --tune

PREFILL_TOKENS = 2048  # a prefill launch's tokens at most (a chunked prefill's budget)


def prefill_inputs(num_seqs: int, context: int, shape: tuple[int, int, int], block_size: int, dtype: torch.dtype,
                   device: torch.device, gen: torch.Generator) -> DecodeInputs:
    """`num_seqs` sequences of `context` keys, each with its last min(context, PREFILL_TOKENS //
    num_seqs) tokens as queries (a whole prompt, or the last chunk of one)."""
    x = decode_inputs(num_seqs, context, shape, block_size, dtype, device, gen)
    q_len = min(context, PREFILL_TOKENS // num_seqs)
    query = torch.randn((num_seqs * q_len, *x.query.shape[1:]), dtype=dtype, device=device)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len
    return DecodeInputs(query, x.kv_cache, x.block_tables, x.seq_lens, cu, torch.empty_like(query))


def pick_best(times: dict, num_cases: int) -> tuple[object, dict]:
    """The config with the lowest geometric mean over cases of time / that case's best time, and
    every config's score. `times`: config -> [seconds per case], None where it failed to run (a
    config that failed any case is out)."""
    complete = {c: t for c, t in times.items() if len(t) == num_cases and all(x is not None for x in t)}
    if not complete:
        raise RuntimeError("no tile config ran on every case")
    best = [min(t[i] for t in complete.values()) for i in range(num_cases)]
    scores = {c: math.exp(sum(math.log(x / b) for x, b in zip(t, best)) / num_cases) for c, t in complete.items()}
    return min(scores, key=scores.get), scores


def tune_phase(model: str, phase: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Time every config of the phase's space on every case; the table entry of the best one."""
    import triton.testing

    from kernels import tuning
    from kernels.triton_attention import paged_attention

    num_heads, num_kv_heads, head_dim = shape = ATTENTION_SHAPES[model]
    group = num_heads // num_kv_heads
    contexts = numbers(args.context_lens, "--context-lens")
    gen = torch.Generator().manual_seed(0)
    if phase == "decode":
        cases = [(b, c, decode_inputs(b, c, shape, args.block_size, dtype, device, gen))
                 for b in numbers(args.batch_sizes, "--batch-sizes") for c in contexts]
    else:
        cases = [(n, c, prefill_inputs(n, c, shape, args.block_size, dtype, device, gen)) for n in (1, 4) for c in contexts]
    default = tuning.default_config(group, head_dim, phase)
    space = tuning.config_space(group, head_dim, phase)
    times: dict = {}
    for config in space + ([default] if default not in space else []):
        times[config] = []
        for _, context, x in cases:
            def call(x=x, context=context, config=config):
                paged_attention(x.query, x.kv_cache, x.block_tables, x.seq_lens, x.cu_seqlens_q, head_dim**-0.5,
                                out=x.out, max_seqlen_k=context, config=config)
            try:
                times[config].append(triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median") / 1e3)
            except Exception as e:  # noqa: BLE001  (out of shared memory or registers: the config is out)
                print(f"  {model} {phase} {config}: {type(e).__name__}", file=sys.stderr, flush=True)
                times[config].append(None)
                break
    best, scores = pick_best(times, len(cases))
    entry = {**tuning.config_entry(best), "score": scores[best], "default_score": scores.get(default),
             "cases": [[a, c] for a, c, _ in cases], "time_us": [t * 1e6 for t in times[best]],
             "default_time_us": [t * 1e6 if t is not None else None for t in times[default]]}
    print(f"{model} {phase}: best {best} ({scores[best]:.3f} of per-case best; default "
          f"{scores.get(default, float('nan')):.3f})", file=sys.stderr, flush=True)
    return entry


def tune(args, device: torch.device, dtype: torch.dtype) -> int:
    """`pagoda bench kernels --tune`: the tuned table entries of this GPU, merged into --tune-output."""
    from kernels import tuning
    from kernels.triton_common import device_name

    name = device_name(device)
    entries = {}
    for model in chosen_models(args, ATTENTION_SHAPES, ATTENTION_MODELS):
        num_heads, num_kv_heads, head_dim = ATTENTION_SHAPES[model]
        for phase in tuning.PHASES:
            key = tuning.table_key(name, head_dim, num_heads // num_kv_heads, phase)
            entries[key] = {**tune_phase(model, phase, args, device, dtype), "dtype": args.dtype,
                            "date": datetime.date.today().isoformat(), **versions()}
    path = Path(args.tune_output) if args.tune_output else tuning.TUNED_TABLE
    old = json.loads(path.read_text()) if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuning.merge_table(old, entries), indent=2) + "\n")
    print(f"wrote {len(entries)} entries for {name} to {path}", file=sys.stderr, flush=True)
    return emit({**header("kernels: attention tile tuning", command_words("kernels", args), str(device)),
                 **versions(), "dtype": args.dtype, "entries": entries}, args.output)


# ----------------------------------------------------------------------------- --moe

# (hidden, intermediate per expert, num_experts, top_k), as in the models' config.json
MOE_SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8), "tiny": (64, 96, 8, 2)}
MOE_GPU_MODELS = "mixtral-8x7b,qwen3-30b-a3b"
MOE_ROUTINGS = 4  # routings cycled per row: consecutive calls read other experts' weights, as layers do
MOE_CPU_REPEATS = 5


@dataclass
class MoeRouting:
    hidden_states: torch.Tensor  # [batch, hidden]
    topk_weights: torch.Tensor  # [batch, top_k] float32, renormalized
    topk_ids: torch.Tensor  # [batch, top_k] int64


def moe_weights(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2 * I, H] and w2 [E, H, I], random, scaled so every GEMM's output is O(1)."""
    hidden, intermediate, num_experts, _ = shape
    w13 = torch.randn((num_experts, 2 * intermediate, hidden), dtype=dtype, device=device, generator=gen)
    w2 = torch.randn((num_experts, hidden, intermediate), dtype=dtype, device=device, generator=gen)
    return w13.mul_(hidden**-0.5), w2.mul_(intermediate**-0.5)


def moe_routing(batch: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> MoeRouting:
    """Random tokens routed as Mixtral and Qwen3-MoE route: softmax over the experts, top-k,
    renormalized (float32 weights, int64 ids: what torch.topk returns)."""
    hidden, _, num_experts, top_k = shape
    x = torch.randn((batch, hidden), dtype=dtype, device=device, generator=gen)
    logits = torch.randn((batch, num_experts), device=device, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return MoeRouting(x, weights / weights.sum(-1, keepdim=True), ids)


def moe_work(routings: list[MoeRouting], shape: tuple[int, int, int, int], dtype: torch.dtype) -> dict:
    """Per call, averaged over the routings: experts hit, their weight bytes (read once each by
    the fused kernel), and the GEMMs' flops (2 x pairs x 3 x hidden x intermediate)."""
    hidden, intermediate, _, top_k = shape
    hit = statistics.mean(len(r.topk_ids.unique()) for r in routings)
    expert_bytes = 3 * hidden * intermediate * (torch.finfo(dtype).bits // 8)
    batch = routings[0].topk_ids.shape[0]
    flops = 2 * batch * top_k * 3 * hidden * intermediate
    return {"experts_hit": hit, "weight_bytes": hit * expert_bytes, "flops": flops}


def time_eager(calls: list) -> float:
    """Seconds per call, launched eagerly (host syncs inside a call, as the loop's, included):
    CALLS_PER_GRAPH calls cycling through `calls` between two events; median of REPLAYS."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    return event_timed(lambda: [calls[i % len(calls)]() for i in range(CALLS_PER_GRAPH)], CALLS_PER_GRAPH)


def bench_moe_row(model: str, batch: int, weights: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                  device: torch.device, copy_GBps: float, gen: torch.Generator) -> dict:
    import kernels
    from kernels.moe import fused_moe_reference
    from kernels.triton_moe import tile_configs

    shape = MOE_SHAPES[model]
    hidden, intermediate, num_experts, top_k = shape
    w13, w2 = weights
    routings = [moe_routing(batch, shape, dtype, device, gen) for _ in range(MOE_ROUTINGS)]
    fused = [lambda r=r: kernels.fused_moe(r.hidden_states, w13, w2, r.topk_weights, r.topk_ids, impl="triton")
             for r in routings]
    loop = [lambda r=r: fused_moe_reference(r.hidden_states, w13, w2, r.topk_weights, r.topk_ids) for r in routings]
    fused_s, loop_s = time_eager(fused), time_eager(loop)
    try:
        graph_s, graph_error = time_per_call(fused), None
    except RuntimeError as e:  # the docstring's claim that a call captures, checked where it is timed
        graph_s, graph_error = None, f"{type(e).__name__}: {e}"
    diff = (fused[0]().float() - loop[0]().float()).abs().max().item()
    work = moe_work(routings, shape, dtype)
    tiles = tile_configs(batch, num_experts, top_k, hidden, intermediate, dtype)

    def figures(seconds: float) -> dict:
        bandwidth = work["weight_bytes"] / seconds / 1e9
        return {"time_us": seconds * 1e6, "weight_bandwidth_GBps": bandwidth,
                "fraction_of_copy_bandwidth": bandwidth / copy_GBps, "TFLOPs": work["flops"] / seconds / 1e12}

    return {
        "model": model, "hidden": hidden, "intermediate": intermediate, "num_experts": num_experts, "top_k": top_k,
        "batch": batch, **work, "tiles": asdict(tiles),
        "pagoda": {"name": "kernels.fused_moe (Triton, eager)", **figures(fused_s),
                   "graph_time_us": None if graph_s is None else graph_s * 1e6, "graph_error": graph_error},
        "baseline": {"name": "kernels.moe.fused_moe_reference: a loop over the experts hit (torch, eager)",
                     **figures(loop_s)},
        "time_ratio_vs_loop": fused_s / loop_s, "max_abs_diff_vs_loop": diff,
    }


def bench_moe_cpu_row(batch: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """The tiny shape on CPU: the reference alone (the fused kernel needs a GPU)."""
    from kernels.moe import fused_moe_reference

    shape = MOE_SHAPES["tiny"]
    hidden, intermediate, num_experts, top_k = shape
    w13, w2 = moe_weights(shape, dtype, torch.device("cpu"), gen)
    r = moe_routing(batch, shape, dtype, torch.device("cpu"), gen)
    times = []
    for _ in range(MOE_CPU_REPEATS + 1):
        start = time.perf_counter()
        fused_moe_reference(r.hidden_states, w13, w2, r.topk_weights, r.topk_ids)
        times.append(time.perf_counter() - start)
    return {
        "model": "tiny", "hidden": hidden, "intermediate": intermediate, "num_experts": num_experts, "top_k": top_k,
        "batch": batch, **moe_work([r], shape, dtype), "pagoda": None,
        "baseline": {"name": "kernels.moe.fused_moe_reference: a loop over the experts hit (torch, eager)",
                     "time_us": statistics.median(times[1:]) * 1e6},
        "time_ratio_vs_loop": None,
    }


def run_moe(args) -> int:
    """`pagoda bench kernels --moe`: the fused MoE kernel against the loop over experts (CUDA); on
    a machine without CUDA, the loop alone on the tiny shape."""
    cuda = torch.cuda.is_available()
    models = chosen_models(args, MOE_SHAPES, MOE_GPU_MODELS if cuda else "tiny", "MoE model")
    dtype = getattr(torch, args.dtype)
    batches = numbers(args.batch_sizes, "--batch-sizes")
    benchmark, command = "kernels: fused MoE vs a loop over experts", command_words("kernels", args)
    if not cuda:
        if models != ["tiny"]:
            raise ValueError("bench kernels --moe: the fused MoE kernel needs a CUDA GPU and torch sees none; "
                             "only the tiny shape runs on CPU (the reference loop alone): drop --models, "
                             "or run it on a GPU host")
        print("bench kernels --moe: the fused Triton kernel needs a CUDA GPU and torch sees none here: timing the "
              "reference loop over experts alone, on the tiny shape", file=sys.stderr, flush=True)
        gen = torch.Generator().manual_seed(0)
        rows = [bench_moe_cpu_row(batch, dtype, gen) for batch in batches]
        result = {**header(benchmark, command, "cpu"), "torch": torch.__version__, "dtype": args.dtype,
                  "timer": f"time.perf_counter around one call; median of {MOE_CPU_REPEATS} after a warm-up",
                  "note": "no CUDA GPU: the reference alone, on the tiny shape; the fused kernel's figures "
                          "need a GPU host", "results": rows}
        return emit(result, args.output)
    require_gpu("bench kernels --moe: the fused MoE kernel needs a CUDA GPU")
    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    rows = []
    for model in models:
        gen = torch.Generator(device).manual_seed(0)
        weights = moe_weights(MOE_SHAPES[model], dtype, device, gen)
        for batch in batches:
            rows.append(bench_moe_row(model, batch, weights, dtype, device, copy["bandwidth_GBps"], gen))
            _print_moe_row(rows[-1])
        del weights
        torch.cuda.empty_cache()
    result = {
        **header(benchmark, command, str(device)), **versions(), "dtype": args.dtype,
        "timer": f"eager: {CALLS_PER_GRAPH} calls cycling {MOE_ROUTINGS} routings between CUDA events, median of "
                 f"{REPLAYS}; graph (fused only: the loop syncs the host): the same calls in a CUDA graph",
        "copy": copy, "results": rows,
    }
    return emit(result, args.output)


def _print_moe_row(row: dict) -> None:
    graph = row["pagoda"]["graph_time_us"]
    print(
        f"{row['model']:>14} batch {row['batch']:>3}: fused {row['pagoda']['time_us']:8.1f} us "
        f"(graph {'-' if graph is None else f'{graph:.1f}'} us, {row['pagoda']['weight_bandwidth_GBps']:5.0f} GB/s "
        f"of weights), loop {row['baseline']['time_us']:8.1f} us -> {row['time_ratio_vs_loop']:.2f}x, "
        f"BLOCK_M {row['tiles']['block_m']}, max diff {row['max_abs_diff_vs_loop']:.2g}",
        file=sys.stderr, flush=True,
    )


# ----------------------------------------------------------------------------- --int4

# Llama-3.1-8B's linear layers: name -> (N outputs, K inputs), q/k/v and gate/up fused
INT4_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
               "down_proj": (4096, 14336)}
INT4_GROUP = 128
INT4_BATCHES = "1,16,256"
L2_OVERFLOW_BYTES = 256 << 20  # weight copies cycled per graph: past any L2


def int4_weights(n: int, k: int, copies: int, device: torch.device, gen: torch.Generator):
    """`copies` random int4 weights in the kernel's layout, and as many bf16 weights of the same shape."""
    from kernels.triton_int4 import Int4Packed
    from worker.quantization.int4_checkpoints import Int4Weight

    packed, dense = [], []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        zeros = torch.full((k // INT4_GROUP, n), 8, dtype=torch.int32)
        scales = (torch.rand(k // INT4_GROUP, n, generator=gen) * 0.01).half()
        weight = Int4Weight(q.to(device), zeros.to(device), scales.to(device),
                            (torch.arange(k) // INT4_GROUP).to(device))
        packed.append(Int4Packed.of(weight))
        dense.append(weight.dequantize(torch.bfloat16))
    return packed, dense


def run_int4(args) -> int:
    require_gpu("bench kernels --int4 times the Triton int4 GEMM on a CUDA GPU, and torch sees none here "
                "(its CPU test is tests/test_quant_formats.py, in Triton's interpreter)")
    from kernels.triton_int4 import int4_matmul

    device, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    batches = batch_sizes(args, INT4_BATCHES)
    rows = []
    for name, (n, k) in INT4_SHAPES.items():
        copies = max(2, math.ceil(L2_OVERFLOW_BYTES / (n * k * 2)))
        packed, dense = int4_weights(n, k, copies, device, gen)
        for batch in batches:
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            bf16 = time_per_call([lambda w=w: F.linear(x, w) for w in dense])
            int4 = time_per_call([lambda w=w: int4_matmul(x, w) for w in packed])
            diff = (int4_matmul(x, packed[0]).float() - F.linear(x, dense[0]).float()).abs().max().item()
            row = {"model": "llama-3.1-8b", "layer": name, "n": n, "k": k, "batch": batch,
                   "bf16": {"time_us": bf16 * 1e6, "weight_GBps": n * k * 2 / bf16 / 1e9},
                   "int4": {"time_us": int4 * 1e6, "weight_GBps": n * k / 2 / int4 / 1e9},
                   "int4_speedup": bf16 / int4, "max_abs_diff": diff}
            rows.append(row)
            print(f"{name:>13} {n:>5}x{k:<5} batch {batch:>3}: bf16 {bf16 * 1e6:8.1f} us, int4 {int4 * 1e6:8.1f} us "
                  f"-> {bf16 / int4:.2f}x ({row['int4']['weight_GBps']:.0f} GB/s of int4 weight)",
                  file=sys.stderr, flush=True)
        del packed, dense
        torch.cuda.empty_cache()
    result = {
        **header("kernels: int4 weight-only GEMM", command_words("kernels", args), str(device)),
        **versions(), "dtype": "bfloat16", "group_size": INT4_GROUP,
        "timer": "CUDA graph of repeated calls over weights cycled past L2; median of replays, per call",
        "results": rows,
    }
    return emit(result, args.output)


# ----------------------------------------------------------------------------- --swap

SWAP_LAYERS, SWAP_BLOCK = 32, (2, 16, 8, 128)  # Llama-3.1-8B's KV pool: 16-token blocks, 2 MB across layers
SWAP_POOL_BLOCKS = 1024
SWAP_REPEATS = 5


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_swap(args) -> int:
    """`pagoda bench kernels --swap`: the KV swap between the device pool and the pinned host pool
    (the preemption swap's and the prefix cache's CPU tier's path), staged (a gather, a copy
    across, a scatter: kernels/swap.py) against direct (one kernel per layer reading or writing
    host memory itself: kernels/triton_swap.py), beside a contiguous pinned copy of as many bytes
    (the bus's ceiling), at Llama-3.1-8B's pool shape, scattered block ids."""
    import random

    require_gpu("bench kernels --swap times swaps between a CUDA device and pinned host memory, and torch "
                "sees none here (the swap paths' CPU tests are tests/test_kernels_swap.py)")
    from kernels.swap import BlockSwapper

    device, dtype, rng = torch.device("cuda"), torch.bfloat16, random.Random(0)
    device_pools = [torch.randn(SWAP_POOL_BLOCKS, *SWAP_BLOCK, device=device, dtype=dtype) for _ in range(SWAP_LAYERS)]
    host_pools = [torch.empty(SWAP_POOL_BLOCKS, *SWAP_BLOCK, dtype=dtype, pin_memory=True)
                  for _ in range(SWAP_LAYERS)]
    block_bytes = SWAP_LAYERS * math.prod(SWAP_BLOCK) * dtype.itemsize
    rows = []
    for n in batch_sizes(args, "128,512"):
        nbytes = n * block_bytes
        ceiling = _contiguous_pinned_copy(nbytes, device)
        row = {"blocks": n, "bytes": nbytes, "contiguous_pinned_copy": ceiling}
        for mode in ("staged", "direct"):
            row[mode] = _time_swap(BlockSwapper(device_pools, host_pools, mode=mode), device_pools, n, nbytes, rng)
        row["direct_over_staged_time"] = {
            "swap_out": row["direct"]["swap_out_ms"] / row["staged"]["swap_out_ms"],
            "swap_in": row["direct"]["swap_in_ms"] / row["staged"]["swap_in_ms"]}
        rows.append(row)
        print(f"{n:>4} blocks ({nbytes / 2**20:.0f} MiB): contiguous pinned H2D {ceiling['h2d_GBps']:.1f} GB/s, "
              f"D2H {ceiling['d2h_GBps']:.1f}; " + "; ".join(
                  f"{m} out {row[m]['swap_out_GBps']:.1f} GB/s, in {row[m]['swap_in_GBps']:.1f}"
                  for m in ("staged", "direct")), file=sys.stderr, flush=True)
    result = {
        **header("kernels: KV swap, staged vs direct", command_words("kernels", args), str(device)),
        "torch": torch.__version__, "dtype": "bfloat16", "layers": SWAP_LAYERS, "block_shape": list(SWAP_BLOCK),
        "block_bytes_all_layers": block_bytes,
        "timer": "host clock around each swap and a device sync (swap-out: until the host pool holds it); median",
        "results": rows,
    }
    return emit(result, args.output)


def _contiguous_pinned_copy(nbytes: int, device: torch.device) -> dict:
    """The bus's ceiling: GB/s of one contiguous copy of `nbytes` each way, pinned host <-> device."""
    pinned, on_device = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(
        nbytes, dtype=torch.uint8, device=device)
    return {"h2d_GBps": nbytes / statistics.median(
                _timed(lambda: on_device.copy_(pinned, non_blocking=True)) for _ in range(SWAP_REPEATS)) / 1e9,
            "d2h_GBps": nbytes / statistics.median(
                _timed(lambda: pinned.copy_(on_device, non_blocking=True)) for _ in range(SWAP_REPEATS)) / 1e9}


def _time_swap(swapper, device_pools: list[torch.Tensor], n: int, nbytes: int, rng) -> dict:
    """Median swap-out and swap-in of `n` scattered blocks through `swapper` (a warm-up round first),
    each round trip checked to give the blocks back unchanged."""
    outs, ins = [], []
    for _ in range(SWAP_REPEATS + 1):
        dev_ids = rng.sample(range(1, SWAP_POOL_BLOCKS), n)
        host_ids = rng.sample(range(SWAP_POOL_BLOCKS), n)
        before = device_pools[-1][dev_ids].clone()
        outs.append(_timed(lambda: (swapper.swap_out(list(zip(dev_ids, host_ids))), swapper.synchronize())))
        device_pools[-1][dev_ids] = 0
        ins.append(_timed(lambda: swapper.swap_in(list(zip(host_ids, dev_ids)))))
        assert torch.equal(device_pools[-1][dev_ids], before), f"{swapper.mode}: the round trip changed the blocks"
    out_s, in_s = statistics.median(outs[1:]), statistics.median(ins[1:])
    return {"swap_out_ms": out_s * 1e3, "swap_in_ms": in_s * 1e3,
            "swap_out_GBps": nbytes / out_s / 1e9, "swap_in_GBps": nbytes / in_s / 1e9}
