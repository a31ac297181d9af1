"""The `pagoda` command line."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from common.cli_args import add_config_args, config_from_args
from common.config import ConfigError, EngineConfig, GatewayConfig, ServingConfig
from common.protocol import InvalidParamError
from pagoda.bench import BENCHES
from pagoda.commands import EXIT_CONFIG_ERROR, SCHEDULER_EXCLUDES, UP_EXCLUDES, WORKER_EXCLUDES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM serving on PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate offline, in one process"))
    _add_embed(commands.add_parser("embed", help="embed texts (or score them against a query) offline with a "
                                                 "pooling model"))
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


def _add_embed(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    p.add_argument("--input", action="append", default=[], help="a text (repeatable)")
    p.add_argument("--input-file", help="texts, one per line")
    p.add_argument("--query", help="score each text against this query (a cross-encoder's score, or an embedder's "
                                   "cosine similarity) instead of printing its vector")
    p.set_defaults(handler=_embed)


def _embed(args) -> int:
    """One JSON object per text, in input order: {"index", "embedding"} (or "score" with --query)."""
    from common.models import pin_revision
    from pagoda.offline import LLM

    texts = list(args.input)
    if args.input_file:
        texts += [line.rstrip("\n") for line in Path(args.input_file).read_text(encoding="utf-8").splitlines()
                  if line.strip()]
    if not texts:
        raise ValueError("give at least one --input or an --input-file")
    engine = pin_revision(config_from_args(EngineConfig, args))
    llm = LLM(**dataclasses.asdict(engine))
    try:
        if args.query is not None:
            for i, score in enumerate(llm.score(args.query, texts, use_tqdm=False)):
                print(json.dumps({"index": i, "score": score}))
        else:
            for out in llm.embed(texts, use_tqdm=False):
                print(json.dumps({"index": out.index, "embedding": out.embedding}))
    finally:
        llm.close()
    return 0


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
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """Exit a server process whose shutdown is done (connections closed, drained, sockets closed)
    without the interpreter's teardown: with torch and transformers loaded it took 0.7-1.4 s, which
    every stop of `pagoda up` waited for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _add_gateway(p: argparse.ArgumentParser) -> None:
    add_config_args(p, GatewayConfig)
    p.set_defaults(handler=_gateway)


def _gateway(args) -> int:
    from gateway.without_torch import keep_torch_out

    config = config_from_args(GatewayConfig, args)
    keep_torch_out(config.model, config.enable_lora)
    from gateway.server import run

    run(config)
    exit_now(0)


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

class _BenchParser(argparse.ArgumentParser):
    """One bench's parser. Its module adds the flags, and becomes the handler, only once the bench is
    chosen: the benches import torch, pyzmq and more, which `pagoda` itself must not."""

    def __init__(self, *args, bench_module: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.bench_module = bench_module
        self.loaded = False

    def load(self) -> None:
        """Add the bench's flags (once), and its `run` as the handler."""
        if not self.loaded:
            self.loaded = True
            module = importlib.import_module(f"pagoda.bench.{self.bench_module}")
            module.add_arguments(self)
            self.set_defaults(handler=module.run)

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.load()
        return super().format_usage()

    def format_help(self) -> str:
        self.load()
        return super().format_help()


def _add_bench(p: argparse.ArgumentParser) -> None:
    benches = p.add_subparsers(dest="bench", required=True, parser_class=_BenchParser)
    for name, (module, help) in BENCHES.items():
        benches.add_parser(name, help=help, bench_module=module)


if __name__ == "__main__":
    sys.exit(main())
