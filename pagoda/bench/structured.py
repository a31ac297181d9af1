"""`pagoda bench structured`: constrained decoding (JSON schemas) on this machine.

`--compare`: xgrammar against llguidance with the served model's tokenizer, on the 20 schemas of
benchmarks/data/structured-schemas.json: the time to compile each schema (xgrammar compiles eagerly;
llguidance lazily, so its first mask is timed too), and the time to fill the token mask of a batch
of sequences per step, each sequence replaying its schema's example document token by token.
`--validate`: seeded generations through the offline LLM with each schema as a json_schema
StructuredOutput, every output parsed and checked with `jsonschema` (cut by max_tokens = invalid).
`--throughput`: the same batch of requests constrained and then unconstrained, in one run; the
unconstrained run is held to each request's constrained output length (min_tokens = max_tokens =
that length, EOS ignored), so both runs decode the same number of tokens per request over the same
prompts and batch shape, and the ratio is the grammar's cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pagoda.bench.common import ROOT, command_words, header, log, write_result
from pagoda.bench.timing import stats

SCHEMAS = ROOT / "benchmarks" / "data" / "structured-schemas.json"


def load_schemas(path: Path = SCHEMAS, limit: int | None = None) -> list[dict]:
    """[{"name", "schema", "example"}, ...]: each example validates against its schema."""
    schemas = json.loads(Path(path).read_text())
    return schemas[:limit] if limit else schemas


def schema_text(schema: dict) -> str:
    """The text the gateway sends the worker (common/structured_output.json_schema_spec's)."""
    from common.structured_output import json_schema_spec

    return json_schema_spec(schema).spec


def example_text(example) -> str:
    """A document in the form the grammar admits: keys in the schema's order (the examples are
    written so), no free whitespace, xgrammar's default separators."""
    return json.dumps(example, separators=(", ", ": "))


def quantiles(values: list[float]) -> dict:
    return {**stats(values, ("median", "p90", "max")), "n": len(values)}


# ----------------------------------------------------------------------------- the two libraries

class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, text: str):
        # common/structured_output.compile_structured_output's call
        return self.compiler.compile_json_schema(text, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos[0])
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, text: str):
        # the same JSON as xgrammar's: no free whitespace, ", " and ": " between items
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, batch: int):
        return self.llt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher, bitmask, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


LIBRARIES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def load_tokenizer(model: str):
    """The served model's Hugging Face tokenizer, its vocabulary size (the logits' width) and EOS ids."""
    from transformers import AutoConfig, AutoTokenizer

    from common.models import resolve_model
    from worker.loader import hf_directory

    directory = hf_directory(resolve_model(model))
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    vocab_size = int(AutoConfig.from_pretrained(directory).vocab_size)
    return tokenizer, vocab_size, [int(tokenizer.eos_token_id)]


# ----------------------------------------------------------------------------- --compare

def time_compile(lib, schemas: list[dict], repeats: int) -> dict:
    """Per schema the best of `repeats` compilations (ms), and the first mask after one (ms)."""
    compile_ms, first_mask_ms = [], []
    bitmask = lib.bitmask(1)
    for entry in schemas:
        text = schema_text(entry["schema"])
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = lib.compile(text)
            best = min(best, time.perf_counter() - start)
        compile_ms.append(best * 1e3)
        matcher = lib.matcher(compiled)
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        first_mask_ms.append((time.perf_counter() - start) * 1e3)
    return {"compile_ms": quantiles(compile_ms), "first_mask_ms": quantiles(first_mask_ms),
            "compile_plus_first_mask_ms": quantiles([a + b for a, b in zip(compile_ms, first_mask_ms)]),
            "per_schema_compile_ms": {e["name"]: round(ms, 3) for e, ms in zip(schemas, compile_ms)}}


def time_masks(lib, schemas: list[dict], documents: list[list[int]], batch_size: int, steps: int,
               batched: bool) -> dict:
    """Fill the mask of `batch_size` sequences (sequence i follows schema i mod len(schemas) and
    starts i tokens into its document, so they sit at different states) for `steps` steps; each
    step every sequence then accepts its document's next token (untimed). Returns ms per step."""
    compiled = [lib.compile(schema_text(e["schema"])) for e in schemas]
    rows = []
    for i in range(batch_size):
        k = i % len(schemas)
        matcher = lib.matcher(compiled[k])
        position = i % len(documents[k])
        for token in documents[k][:position]:
            assert lib.accept(matcher, token), f"{lib.name} refused the example of {schemas[k]['name']}"
        rows.append([matcher, k, position])
    bitmask = lib.bitmask(batch_size)
    matchers = [row[0] for row in rows]
    step_ms = []
    for _ in range(steps):
        start = time.perf_counter()
        if batched:
            lib.fill_batch(matchers, bitmask)
        else:
            for i, matcher in enumerate(matchers):
                lib.fill(matcher, bitmask, i)
        step_ms.append((time.perf_counter() - start) * 1e3)
        for row in rows:
            matcher, k, position = row
            assert lib.accept(matcher, documents[k][position]), f"{lib.name} refused {schemas[k]['name']}"
            row[2] = position + 1
            if row[2] == len(documents[k]):  # the document and its EOS accepted: start it again
                lib.reset(matcher)
                row[2] = 0
    per_step = quantiles(step_ms)
    return {"step_ms": per_step,
            "per_sequence_ms": {key: per_step[key] / batch_size for key in ("median", "p90", "max")}}


def compare(tokenizer, vocab_size: int, eos: list[int], schemas: list[dict], batch_size: int, steps: int,
            repeats: int, threads: int) -> dict:
    documents = [tokenizer.encode(example_text(e["example"]), add_special_tokens=False) + eos[:1] for e in schemas]
    result = {}
    for name, cls in LIBRARIES.items():
        lib = cls(tokenizer, vocab_size, eos, threads)
        entry = time_compile(lib, schemas, repeats)
        entry["mask_loop"] = time_masks(lib, schemas, documents, batch_size, steps, batched=False)
        entry["mask_batched"] = time_masks(lib, schemas, documents, batch_size, steps, batched=True)
        log(f"{name}: compile median {entry['compile_ms']['median']:.2f} ms p90 {entry['compile_ms']['p90']:.2f} ms; "
            f"mask at batch {batch_size}: loop {entry['mask_loop']['step_ms']['median']:.3f} ms/step, "
            f"batched {entry['mask_batched']['step_ms']['median']:.3f} ms/step")
        result[name] = entry
    return result


# ----------------------------------------------------------------------------- --validate, --throughput

def prompt_of(entry: dict) -> str:
    return (f"Write one JSON object ({entry['name'].replace('_', ' ')}) that follows this JSON schema:\n"
            f"{json.dumps(entry['schema'])}\nJSON:")


def structured(entry: dict):
    from common.structured_output import json_schema_spec

    return json_schema_spec(entry["schema"])


def validate(llm, schemas: list[dict], seeds: int, max_tokens: int, temperature: float) -> dict:
    """`seeds` seeded generations per schema in one batch; each output parsed and validated."""
    import jsonschema

    from common.protocol import SamplingParams

    cases = [(entry, seed) for seed in range(seeds) for entry in schemas]
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_output=structured(e))
              for e, seed in cases]
    start = time.perf_counter()
    outputs = llm.generate([prompt_of(e) for e, _ in cases], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    failures = []
    for (entry, seed), out in zip(cases, outputs):
        problem = None
        if out.finish_reason == "length":
            problem = f"cut by max_tokens {max_tokens}"
        else:
            try:
                jsonschema.validate(json.loads(out.text), entry["schema"])
            except (ValueError, jsonschema.ValidationError) as e:
                problem = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if problem:
            failures.append({"schema": entry["name"], "seed": seed, "problem": problem, "text": out.text})
    lengths = [len(o.token_ids) for o in outputs]
    return {"generations": len(cases), "valid": len(cases) - len(failures), "failures": failures,
            "max_tokens": max_tokens, "temperature": temperature, "seconds": elapsed,
            "output_tokens": {"mean": sum(lengths) / len(lengths), "max": max(lengths)},
            "examples": [{"schema": e["name"], "seed": s, "text": o.text} for (e, s), o in list(zip(cases, outputs))[:3]]}


def _timed(llm, prompts: list[str], params: list) -> dict:
    start = time.perf_counter()
    steps = llm.engine.num_steps
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = llm.engine.num_steps - steps
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed, "steps": steps,
            "ms_per_step": elapsed / steps * 1e3, "lengths": [len(o.token_ids) for o in outputs]}


def throughput(llm, schemas: list[dict], batch_size: int, max_tokens: int, temperature: float, repeats: int) -> dict:
    """Output tokens/s of `batch_size` constrained requests against the same requests unconstrained
    held to the constrained lengths; the best of `repeats` alternating runs of each."""
    from common.protocol import SamplingParams

    cases = [schemas[i % len(schemas)] for i in range(batch_size)]
    prompts = [prompt_of(e) for e in cases]
    constrained_params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                                         structured_output=structured(e)) for i, e in enumerate(cases)]
    # warm up, compiling every grammar: the worker caches them, and --compare times compilation
    first = {e["name"]: i for i, e in reversed(list(enumerate(cases)))}
    llm.generate([prompts[i] for i in first.values()],
                 [dataclasses.replace(constrained_params[i], max_tokens=2) for i in first.values()], use_tqdm=False)
    runs = {"constrained": [], "unconstrained": []}
    lengths = None
    for _ in range(repeats):
        run = _timed(llm, prompts, constrained_params)
        lengths = lengths or run["lengths"]
        runs["constrained"].append(run)
        free_params = [SamplingParams(temperature=temperature, seed=i, max_tokens=n, min_tokens=n, ignore_eos=True)
                       for i, n in enumerate(lengths)]
        runs["unconstrained"].append(_timed(llm, prompts, free_params))
    # seeded: every run of either kind decodes the same lengths
    same_lengths = all(r["lengths"] == lengths for rs in runs.values() for r in rs)
    best = {kind: max(rs, key=lambda r: r["output_tokens_per_s"]) for kind, rs in runs.items()}
    for rs in runs.values():
        for run in rs:
            run.pop("lengths", None)
    ratio = best["constrained"]["output_tokens_per_s"] / best["unconstrained"]["output_tokens_per_s"]
    return {"batch_size": batch_size, "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats,
            "constrained": best["constrained"], "unconstrained": best["unconstrained"],
            "all_runs_tokens_per_s": {k: [round(r["output_tokens_per_s"], 2) for r in rs] for k, rs in runs.items()},
            "same_lengths": same_lengths, "ratio": ratio, "cost": 1 - ratio}


# ----------------------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagoda bench structured`'s flags."""
    parser.add_argument("--compare", action="store_true", help="xgrammar vs llguidance: compile and mask-fill times")
    parser.add_argument("--validate", action="store_true", help="seeded constrained generations checked with jsonschema")
    parser.add_argument("--throughput", action="store_true", help="output tokens/s constrained vs unconstrained")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--schemas", default=None, help="a JSON list of {name, schema, example} (default: the 20 in "
                                                       "benchmarks/data/structured-schemas.json)")
    parser.add_argument("--num-schemas", type=int, default=None, help="only the first N schemas")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step (--compare, --throughput)")
    parser.add_argument("--steps", type=int, default=50, help="--compare: mask-fill steps measured")
    parser.add_argument("--repeats", type=int, default=3, help="compilations per schema; throughput runs of each kind")
    parser.add_argument("--threads", type=int, default=1, help="--compare: the libraries' threads")
    parser.add_argument("--seeds", type=int, default=10, help="--validate: seeded generations per schema")
    parser.add_argument("--max-tokens", type=int, default=256, help="--validate, --throughput: each request's cap")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--output", help="write the result JSON here")


def run(args) -> int:
    """The `pagoda bench structured` command."""
    if not (args.compare or args.validate or args.throughput):
        args.compare = args.validate = args.throughput = True
    schemas = load_schemas(args.schemas or SCHEMAS, args.num_schemas)
    result = {**header("structured", command_words("structured", args), args.device if args.device != "auto" else "cpu"),
              "model": args.model, "schemas": len(schemas)}
    if args.compare:
        tokenizer, vocab_size, eos = load_tokenizer(args.model)
        result["compare"] = {"batch_size": args.batch_size, "steps": args.steps, "threads": args.threads,
                             **compare(tokenizer, vocab_size, eos, schemas, args.batch_size, args.steps,
                                       args.repeats, args.threads)}
    if args.validate or args.throughput:
        from pagoda.offline import LLM

        llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch_size, 256))
        if args.validate:
            result["validate"] = validate(llm, schemas, args.seeds, args.max_tokens, args.temperature)
            v = result["validate"]
            log(f"validate: {v['valid']}/{v['generations']} valid ({v['seconds']:.1f} s)")
        if args.throughput:
            result["throughput"] = throughput(llm, schemas, args.batch_size, args.max_tokens, args.temperature,
                                              args.repeats)
            t = result["throughput"]
            log(f"throughput at batch {args.batch_size}: constrained {t['constrained']['output_tokens_per_s']:.1f}, "
                f"unconstrained {t['unconstrained']['output_tokens_per_s']:.1f} tokens/s, ratio {t['ratio']:.3f}")
        llm.close()
    write_result(result, args.output)
    summary = {k: result[k] for k in ("compare", "validate", "throughput") if k in result}
    print(json.dumps(summary, indent=2, default=str)[:4000])
    return 0
