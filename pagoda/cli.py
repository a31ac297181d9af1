"""The `pagoda` command line."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from common.config import ConfigError
from common.protocol import InvalidParamError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM serving on PagedAttention")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate offline, in one process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.handler(args)
    except (ConfigError, InvalidParamError, ValueError, FileNotFoundError) as exc:
        print(f"pagoda: error: {exc}", file=sys.stderr)
        return 2


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face directory, or dummy:CONFIG.json")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the KV pool size (blocks)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)


def _engine_config(args) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )


def _add_generate(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help='JSON lines, each {"prompt": "..."} or {"messages": [...]}')
    p.add_argument("--chat", action="store_true", help="wrap each --prompt in the chat template as a user message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, in input order")
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


def _generate(args) -> int:
    from common.protocol import SamplingParams
    from pagoda.offline import LLM

    prompts = _read_prompts(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **_engine_config(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_json(), ensure_ascii=False), flush=True)
        else:
            print(f"--- [{out.index}] ({out.finish_reason})\n{out.text}", flush=True)
    tokens = sum(len(out.token_ids) for out in outputs)
    print(
        f"pagoda: {llm.engine.num_steps} steps, {llm.scheduler.num_preemptions} preemptions, "
        f"{tokens} output tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
