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
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagoda.bench.common import command_words, header, write_result

# (num_heads, num_kv_heads, head_dim), as in worker/configs/*.json
ATTENTION_SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
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
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    return statistics.median(times)


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
    import kernels
    from kernels.triton_attention import launch_plan

    shape = ATTENTION_SHAPES[model]
    num_heads, num_kv_heads, head_dim = shape
    scale = head_dim**-0.5
    nbytes = decode_bytes(batch, context, shape, dtype)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    copies = min(max(math.ceil(4 * l2 / nbytes), 1), MAX_INPUT_COPIES)
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    inputs = [decode_inputs(batch, context, shape, block_size, dtype, device, gen) for _ in range(copies)]

    def paged(x: DecodeInputs):
        return lambda: kernels.paged_attention(x.query, x.kv_cache, x.block_tables, x.seq_lens, x.cu_seqlens_q,
                                               scale, out=x.out, impl="triton", max_seqlen_k=context)

    sdpa = [sdpa_call(*x.contiguous(), scale) for x in inputs]
    paged_s = time_per_call([paged(x) for x in inputs])
    sdpa_s = time_per_call([call for call, _ in sdpa])
    diff = (paged(inputs[0])().float() - sdpa[0][0]()[:, :, 0].float()).abs().max().item()
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
        "time_ratio_vs_sdpa": paged_s / sdpa_s, "max_abs_diff_vs_sdpa": diff, "input_copies": copies,
    }


def goal_check(rows: list[dict]) -> dict | None:
    goal = (GOAL["model"], GOAL["batch"], GOAL["context"])
    row = next((r for r in rows if (r["model"], r["batch"], r["context"]) == goal), None)
    if row is None:
        return None
    fraction, ratio = row["pagoda"]["fraction_of_copy_bandwidth"], row["time_ratio_vs_sdpa"]
    return {**GOAL, "fraction_of_copy": fraction, "time_vs_sdpa": ratio,
            "met": fraction >= GOAL["min_fraction_of_copy"] and ratio <= GOAL["max_time_vs_sdpa"]}


def run(args) -> int:
    """The `pagoda bench kernels` handler: the JSON result on stdout (and in --output), a table on stderr."""
    if not torch.cuda.is_available():
        raise ValueError("bench kernels times the Triton kernels on a CUDA GPU, and torch sees none here; "
                         "run it on a GPU host (the kernels' CPU tests are `make test`)")
    from kernels.triton_common import interpreting

    if interpreting():
        raise ValueError("TRITON_INTERPRET=1 is set: the kernels would run in Triton's interpreter; unset it")
    import triton

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    if args.tune:
        return tune(args, device, dtype)
    copy = copy_bandwidth(device)
    rows = []
    for model in args.models.split(","):
        if model not in ATTENTION_SHAPES:
            raise ValueError(f"unknown model {model!r}: choose from {', '.join(ATTENTION_SHAPES)}")
        for batch in map(int, args.batch_sizes.split(",")):
            for context in map(int, args.context_lens.split(",")):
                rows.append(bench_shape(model, batch, context, args.block_size, dtype, device, copy["bandwidth_GBps"]))
                _print_row(rows[-1])
                torch.cuda.empty_cache()
    result = {
        **header("kernels: paged decode attention", command_words("kernels", args), str(device)),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
        "timer": "CUDA graph of repeated calls over inputs cycled past L2; median of replays, per call",
        "copy": copy, "results": rows, "goal": goal_check(rows),
    }
    write_result(result, args.output)
    print(json.dumps(result, indent=2))
    return 0


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
    contexts = [int(c) for c in args.context_lens.split(",")]
    gen = torch.Generator().manual_seed(0)
    if phase == "decode":
        cases = [(b, c, decode_inputs(b, c, shape, args.block_size, dtype, device, gen))
                 for b in map(int, args.batch_sizes.split(",")) for c in contexts]
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
    import triton

    from kernels import tuning
    from kernels.triton_common import device_name

    name = device_name(device)
    entries = {}
    for model in args.models.split(","):
        if model not in ATTENTION_SHAPES:
            raise ValueError(f"unknown model {model!r}: choose from {', '.join(ATTENTION_SHAPES)}")
        num_heads, num_kv_heads, head_dim = ATTENTION_SHAPES[model]
        for phase in tuning.PHASES:
            key = tuning.table_key(name, head_dim, num_heads // num_kv_heads, phase)
            entries[key] = {**tune_phase(model, phase, args, device, dtype), "dtype": args.dtype,
                            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__}
    path = Path(args.tune_output) if args.tune_output else tuning.TUNED_TABLE
    old = json.loads(path.read_text()) if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuning.merge_table(old, entries), indent=2) + "\n")
    print(f"wrote {len(entries)} entries for {name} to {path}", file=sys.stderr, flush=True)
    result = {**header("kernels: attention tile tuning", command_words("kernels", args), str(device)),
              "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype, "entries": entries}
    write_result(result, args.output)
    print(json.dumps(result, indent=2))
    return 0
