"""`pagoda bench speculative`: output tokens/s through the served API with speculative decoding
(`--speculative-config`, docs/speculative.md) against without, in one run on the same machine.

Two `pagoda up` stacks, one after the other, the same flags but for `--speculative-config` on the
second: `baseline` (no speculation), then `speculative`. Each is warmed up with one request that is
not part of the workload, then serves the workload as streams, at most `--concurrency` requests in
flight (1: one stream at a time; 32: the batch case), every request greedy (temperature 0) and
capped at `--max-tokens` output tokens (EOS ends a request unless `--ignore-eos`):

- `edit` (default): the 20 chats of benchmarks/data/edit-prompts.jsonl, each asking the model to
  copy a code file or a passage given in the prompt with a light edit (rename a variable, fix a
  typo, add type hints), sent to `/v1/chat/completions`: the case n-gram speculation is for, where
  the output repeats the prompt.
- `sharegpt`: ShareGPT prompts as token ids (pagoda/bench/workloads.py, seed `--seed`), sent to
  `/v1/completions`: ordinary chat traffic, where few drafts are accepted.

Per run, from the client: completed and failed requests, output tokens (each stream's usage chunk,
`stream_options.include_usage`), wall time from the first request to the last answer, output
tokens/s over it, and the mean per-request TTFT, TPOT ((e2e - ttft) / (tokens - 1)) and E2E; from
the gateway's /metrics before and after the workload, what the speculative counters gained:
`pagoda:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`
(and per draft position), hence the acceptance rate (accepted / draft tokens) and the mean accepted
tokens per draft. Then `speedup`: the speculative run's output tokens/s over the baseline's; and
`outputs`: how many prompts' texts differ between the two runs (greedy verification should change
no text: reported, not enforced). Exits 1 when a request of either run failed, else 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import QUANTIZATIONS
from pagoda.bench.client import STREAMED, Stream, stream_all
from pagoda.bench.common import ROOT, command_words, header, log, write_result
from pagoda.bench.common import flags as bench_flags
from pagoda.bench.serve import failures
from pagoda.bench.stack import Stack, parse_samples

EDIT_PROMPTS = ROOT / "benchmarks" / "data" / "edit-prompts.jsonl"
DEFAULT_SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4}'
WORKLOADS = ("edit", "sharegpt")
RUNS = ("baseline", "speculative")
SPEC_COUNTERS = {"drafts": "pagoda:spec_decode_num_drafts_total",
                 "draft_tokens": "pagoda:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "pagoda:spec_decode_num_accepted_tokens_total"}
PER_POSITION = "pagoda:spec_decode_num_accepted_tokens_per_pos_total"
# a warm-up chat that shares no prefix with the workload beyond the chat template
WARM_UP_CHAT = [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."}]
DRAIN_TIMEOUT_S = 120.0
STATUS_INTERVAL_S = 1.0  # the schedulers' counters reach /metrics with their status, twice a second
FENCE = re.compile(r"```[\w+-]*\n(.*?)```", re.S)


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload: a chat (`messages`, /v1/chat/completions) or token ids (`prompt`,
    /v1/completions)."""

    messages: tuple[dict, ...] | None = None
    prompt: tuple[int, ...] | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, max_tokens: int, ignore_eos: bool) -> dict:
        body = {"max_tokens": max_tokens, "temperature": 0, **STREAMED}
        if ignore_eos:
            body["ignore_eos"] = True
        if self.messages is not None:
            body["messages"] = list(self.messages)
        else:
            body["prompt"] = list(self.prompt)
        return body


def load_edit_prompts(path: str | Path = EDIT_PROMPTS) -> list[list[dict]]:
    """The chats of an edit-prompts file: one {"messages": [...]} per line (blank lines skipped)."""
    chats = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            messages = json.loads(line).get("messages")
            if not messages or not all(isinstance(m, dict) and m.get("content") for m in messages):
                raise ValueError(f"{path}:{number}: not a chat ({{\"messages\": [{{role, content}}, ...]}})")
            chats.append(messages)
    return chats


def text_to_copy(content: str) -> str:
    """What an edit prompt asks to copy: its fenced code block, else all after the instruction (the
    first paragraph)."""
    block = FENCE.search(content)
    if block:
        return block.group(1)
    _, _, rest = content.partition("\n\n")
    return rest.strip()


def workload(args) -> tuple[list[Request], Request]:
    """The workload's requests and a warm-up request outside it."""
    if args.workload == "edit":
        chats = load_edit_prompts(args.prompts or EDIT_PROMPTS)
        # more than the set (a batch of 32): the set again, in order (a repeat's prompt is a prefix-cache hit)
        chats = [chats[i % len(chats)] for i in range(args.num_prompts)]
        return [Request(messages=tuple(c)) for c in chats], Request(messages=tuple(WARM_UP_CHAT))
    from pagoda.bench.workloads import sharegpt_requests

    pairs = sharegpt_requests(args.num_prompts + 1, args.seed, args.source)  # the last one warms up
    requests = [Request(prompt=tuple(prompt)) for prompt, _ in pairs]
    return requests[:-1], requests[-1]


# ----------------------------------------------------------------------------- the client


def send_all(base_url: str, requests: list[Request], max_tokens: int, concurrency: int,
             ignore_eos: bool = False) -> tuple[list[Stream], float]:
    """Every request (all of one endpoint), at most `concurrency` in flight, in order; the streams and the
    wall time."""
    bodies = [r.body(max_tokens, ignore_eos) for r in requests]
    return asyncio.run(stream_all(base_url.rstrip("/") + requests[0].path, bodies, concurrency=concurrency))


# ----------------------------------------------------------------------------- metrics


def spec_counters(text: str) -> dict:
    """The speculative counters in Prometheus text, summed over engine groups: {drafts, draft_tokens,
    accepted_tokens, accepted_per_position: [...]} (0 and [] where absent: no speculation)."""
    samples = parse_samples(text)
    counters: dict = {key: sum(v for n, _, v in samples if n == name) for key, name in SPEC_COUNTERS.items()}
    per_pos: dict[int, float] = {}
    for name, labels, value in samples:
        if name == PER_POSITION and "position" in labels:
            position = int(labels["position"])
            per_pos[position] = per_pos.get(position, 0.0) + value
    counters["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return counters


def spec_metrics(before: dict, after: dict) -> dict:
    """What the counters gained over a run: counts, acceptance rate (accepted / draft tokens), mean
    accepted tokens per draft, and per draft position the share of drafts accepted up to there."""
    gained = {key: int(round(after[key] - before.get(key, 0.0))) for key in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = gained["drafts"], gained["draft_tokens"], gained["accepted_tokens"]
    first = before.get("accepted_per_position", [])
    per_pos = [int(round(v - (first[i] if i < len(first) else 0.0)))
               for i, v in enumerate(after.get("accepted_per_position", []))]
    return {
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_accepted_per_draft": round(accepted / drafts, 4) if drafts else None,
        "accepted_per_position": per_pos,
        "acceptance_rate_per_position": [round(n / drafts, 4) for n in per_pos] if drafts else [],
    }


def read_counters(stack: Stack) -> dict:
    """The counters once the stack is idle and its schedulers have published since."""
    stack.wait_drained(DRAIN_TIMEOUT_S)
    time.sleep(STATUS_INTERVAL_S)
    return spec_counters(stack.metrics_text())


def mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 6) if values else None


def run_metrics(streams: list[Stream], wall: float) -> dict:
    """A run's client-side figures: counts, output tokens and tokens/s over the wall time, mean
    per-request TTFT, TPOT and E2E (completed requests)."""
    done = [s for s in streams if s.failure is None]
    tokens = sum(s.output_len for s in done)
    metrics = {
        "completed": len(done), "failed": len(streams) - len(done), "wall_s": round(wall, 3),
        "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "mean_output_tokens": mean([s.output_len for s in done]),
        "ttft_mean_s": mean([s.ttft for s in done if s.ttft is not None]),
        "tpot_mean_s": mean([s.tpot for s in done if s.tpot is not None]),
        "e2e_mean_s": mean([s.e2e for s in done if s.e2e is not None]),
        "finish_reasons": {reason: sum(s.finish_reason == reason for s in done)
                           for reason in sorted({str(s.finish_reason) for s in done})},
        **failures(streams),
    }
    return metrics


def compare_outputs(baseline: list[Stream], speculative: list[Stream]) -> dict:
    """Prompts whose texts differ between the runs (both completed), with where each first differs."""
    compared, differ = 0, []
    for i, (a, b) in enumerate(zip(baseline, speculative)):
        if a.failure is not None or b.failure is not None:
            continue
        compared += 1
        if a.text != b.text:
            at = next((k for k, (x, y) in enumerate(zip(a.text, b.text)) if x != y), min(len(a.text), len(b.text)))
            differ.append({"prompt": i, "first_difference_at_char": at, "baseline_tokens": a.output_len,
                           "speculative_tokens": b.output_len,
                           "baseline": a.text[max(0, at - 20):at + 40], "speculative": b.text[max(0, at - 20):at + 40]})
    return {"compared": compared, "identical": compared - len(differ), "differ": len(differ),
            "differences": differ[:10]}


def speedup(runs: dict[str, dict]) -> float | None:
    """The speculative run's output tokens/s over the baseline's."""
    base, spec = (runs.get(name, {}).get("output_tokens_per_s") for name in RUNS)
    return round(spec / base, 3) if base and spec is not None else None


def summary_line(result: dict) -> str:
    runs, spec = result["runs"], result["runs"]["speculative"].get("spec_decode", {})
    outputs = result["outputs"]
    rate, per_draft = spec.get("acceptance_rate"), spec.get("mean_accepted_per_draft")
    tpot = lambda r: f"{r['tpot_mean_s'] * 1000:.1f} ms" if r.get("tpot_mean_s") is not None else "n/a"  # noqa: E731
    return (f"speculative bench, {result['workload']['name']} x{result['workload']['num_prompts']}, concurrency "
            f"{result['concurrency']}: baseline {runs['baseline']['output_tokens_per_s']} tok/s (TPOT "
            f"{tpot(runs['baseline'])}), speculative {runs['speculative']['output_tokens_per_s']} tok/s (TPOT "
            f"{tpot(runs['speculative'])}), speedup {result['speedup']}x; acceptance rate {rate}, "
            f"{per_draft} accepted per draft; outputs identical {outputs['identical']}/{outputs['compared']}")


# ----------------------------------------------------------------------------- the command


def resolved_device(device: str) -> str:
    """What `pagoda up --device auto` picks (worker/model_runner.py), for the result's header."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def stack_flags(args, speculative: bool) -> list[str]:
    names = ("model", "device", "quantization", "max_num_seqs", "num_gpu_blocks")
    return bench_flags(args, names + (("speculative_config",) if speculative else ()))


def start(args, name: str, log_dir: Path, port: int | None, warm_up: Request) -> Stack:
    """One configuration's stack, started and warmed up."""
    flags = stack_flags(args, name == "speculative")
    stack_log = log_dir / f"{name}.log"
    log(f"{name}: starting pagoda up {' '.join(flags)} (log: {stack_log})")
    stack = Stack(*flags, port=port, log=stack_log)
    try:
        stack.wait_ready()
        warm, _ = send_all(stack.url, [warm_up], min(args.max_tokens, 16), 1)
        if warm[0].failure:
            raise RuntimeError(f"{name}: the warm-up request failed: {warm[0].failure}; see {stack_log}")
    except BaseException:
        stop(name, stack)
        raise
    return stack


def stop(name: str, stack: Stack) -> None:
    code = stack.stop()
    if code not in (0, None):
        log(f"{name}: pagoda up exited with {code}; see {stack.log}")


def serve(args, name: str, stack: Stack, requests: list[Request]) -> tuple[dict, list[Stream], dict, dict]:
    """The workload once through a stack: its metrics, streams and spec-decode counters before and after."""
    before = read_counters(stack)
    streams, wall = send_all(stack.url, requests, args.max_tokens, args.concurrency, args.ignore_eos)
    after = read_counters(stack)
    metrics = {**run_metrics(streams, wall), "spec_decode": spec_metrics(before, after),
               "load_average_1m": round(os.getloadavg()[0], 2), "log": str(stack.log)}
    log(f"{name}: {metrics['completed']}/{len(requests)} done, {metrics['output_tokens']} tokens in "
        f"{metrics['wall_s']} s: {metrics['output_tokens_per_s']} tok/s; spec decode {metrics['spec_decode']}")
    return metrics, streams, before, after


def merged(rounds: list[tuple[dict, list[Stream], dict, dict]]) -> dict:
    """One configuration's metrics over every round: its requests and its summed wall time."""
    if len(rounds) == 1:
        return rounds[0][0]
    streams = [stream for _, got, _, _ in rounds for stream in got]
    metrics = run_metrics(streams, sum(m["wall_s"] for m, _, _, _ in rounds))
    return {**metrics, "spec_decode": spec_metrics(rounds[0][2], rounds[-1][3]),
            "load_average_1m": rounds[-1][0]["load_average_1m"], "log": rounds[0][0]["log"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench speculative`'s flags."""
    parser.add_argument("--workload", default="edit", choices=["edit", "sharegpt"],
                        help="edit: chats asking to copy a code file or passage with a light edit "
                             "(benchmarks/data/edit-prompts.jsonl, /v1/chat/completions); sharegpt: ShareGPT prompts as "
                             "token ids (/v1/completions)")
    parser.add_argument("--num-prompts", type=int, default=20, help="requests of each run (edit: past the 20 of the set, the set again in order)")
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on each request's output tokens (greedy)")
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight at most (1: one stream at a time)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the workload this many times through each stack, the two in turn (both stay up); the "
                             "speedup is then the median of the rounds' ratios")
    parser.add_argument("--speculative-config", default=DEFAULT_SPECULATIVE_CONFIG,
                        help="the speculative run's `pagoda up --speculative-config` (vLLM's JSON keys)")
    parser.add_argument("--model", default="default", help="the model to serve")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="`pagoda up --quantization` (default: not passed, its own default)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="each scheduler's batch limit (default: its own)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="the KV pool, in blocks (default: what fits)")
    parser.add_argument("--prompts", default=None, help="edit: another prompts file, one {\"messages\": [...]} per line")
    parser.add_argument("--seed", type=int, default=0, help="sharegpt: the sample's seed")
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"], help="sharegpt: where from")
    parser.add_argument("--port", type=int, default=None, help="the baseline's port, the speculative stack's the next one (default: free ones)")
    parser.add_argument("--log-dir", default=None, help="the stacks' logs, baseline.log and speculative.log "
                                                       "(default: a new folder under the temp dir)")
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench speculative` command: 0 when both runs completed every request."""
    from common.speculative import SpeculativeConfigError, to_json

    if args.num_prompts < 1 or args.max_tokens < 1 or args.concurrency < 1:
        raise ValueError("--num-prompts, --max-tokens and --concurrency must be >= 1")
    try:
        to_json(args.speculative_config)  # a bad flag fails here, not after the baseline run
    except SpeculativeConfigError as exc:
        raise ValueError(str(exc)) from None
    requests, warm_up = workload(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pagoda-bench-speculative-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    stacks: dict[str, Stack] = {}
    served: dict[str, list] = {name: [] for name in RUNS}
    # on the CPU both stay up, idle while the other serves; a GPU holds one stack's pool at a time
    together = resolved_device(args.device) == "cpu"
    port = {name: None if args.port is None else args.port + i for i, name in enumerate(RUNS)}
    try:
        for r in range(args.rounds):  # in turn, the order swapped each round: a drift falls on both
            for name in RUNS if r % 2 == 0 else RUNS[::-1]:
                if name not in stacks:
                    stacks[name] = start(args, name, log_dir, port[name], warm_up)
                served[name].append(serve(args, name, stacks[name], requests))
                if not together:
                    stop(name, stacks.pop(name))
    finally:
        for name, stack in stacks.items():
            stop(name, stack)
    runs = {name: merged(served[name]) for name in RUNS}
    streams = {name: served[name][0][1] for name in RUNS}
    ratios = [round(s[0]["output_tokens_per_s"] / b[0]["output_tokens_per_s"], 3)
              for b, s in zip(served["baseline"], served["speculative"]) if b[0]["output_tokens_per_s"]]
    result = {
        **header("speculative", command_words("speculative", args), resolved_device(args.device)),
        "model": args.model, "quantization": args.quantization, "speculative_config": json.loads(args.speculative_config),
        "workload": {"name": args.workload, "num_prompts": len(requests),
                     "endpoint": requests[0].path, "source": str(args.prompts or EDIT_PROMPTS.relative_to(ROOT))
                     if args.workload == "edit" else f"ShareGPT ({args.source}), seed {args.seed}"},
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "concurrency": args.concurrency,
        "rounds": args.rounds, "round_speedups": ratios,
        "runs": runs, "speedup": statistics.median(ratios) if args.rounds > 1 and ratios else speedup(runs),
        "outputs": compare_outputs(streams["baseline"], streams["speculative"]),
    }
    write_result(result, args.output)
    print(summary_line(result))
    return 0 if all(not r["failed"] for r in runs.values()) else 1
