"""`pagoda bench embed`: embedding throughput of the offline engine against sentence-transformers'
`encode`, on the same model, the same texts and the same torch threads, in one run.

The model is a sentence-transformers directory (a pooling model); `--model default` makes one from
the default model (SmolLM2-135M, converted from its GGUF file once: last-token pooling, normalized)
under the cache. The workload: `--num-texts` texts, each of a length drawn from
[`--min-len`, `--max-len`] tokens (random vocabulary ids, decoded to text: both sides tokenize the
same strings). Each round embeds all of them with each engine in turn (sentence-transformers at its
default batch size, which sorts by length to pad little; Pagoda continuously batched, without
padding, and without its prefix cache, which would hold the texts from the round before); the figures are the medians over `--rounds` after one warm-up of each. Both run at
float32 (the parity dtype) unless `--dtype` says otherwise. The result says how alike the vectors
are (the least cosine similarity over the texts) beside the speeds.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from pagoda.bench.common import command_words, header, log, model_keys, emit
from pagoda.bench.timing import time_in_turn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a sentence-transformers directory; default: one made from the default model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the result JSON here")


def default_embedder() -> Path:
    """A sentence-transformers layout of the default model: its converted directory, with last-token
    pooling and Normalize (made once, beside the conversion)."""
    from common.models import resolve_model
    from common.tokenizer import load_tokenizer
    from worker.loader import hf_directory

    source = resolve_model("default")
    weights = hf_directory(source)
    target = weights.parent / f"{weights.name}-embedder"
    if (target / "modules.json").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(weights, tmp, ignore=shutil.ignore_patterns("tokenizer", "*.json.lock"))
    tokenizer = load_tokenizer(source)
    tokenizer.chat_template = None  # the text as the tokenizer encodes it (sentence-transformers would render it)
    tokenizer.save_pretrained(tmp)
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    (tmp / "1_Pooling").mkdir()
    hidden = json.loads((tmp / "config.json").read_text())["hidden_size"]
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": hidden,
                                                               "pooling_mode": "lasttoken"}))
    (tmp / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp / "2_Normalize").mkdir()
    tmp.rename(target)
    return target


def texts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode([rng.choice(vocab) for _ in range(rng.randint(lo, hi))]) for _ in range(n)]


def run(args) -> int:
    import torch
    from sentence_transformers import SentenceTransformer

    from common.pooling import cosine
    from pagoda.offline import LLM

    directory = default_embedder() if args.model == "default" else Path(args.model)
    dtype = getattr(torch, args.dtype)
    st = SentenceTransformer(str(directory), device=args.device, model_kwargs={"dtype": dtype})
    # no prefix cache: each round would find the texts of the round before (a benchmark of computing them)
    llm = LLM(str(directory), device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization="none", enable_prefix_caching=False)
    try:
        inputs = texts(llm.encoder.tokenizer, args.num_texts, args.min_len, args.max_len, args.seed)
        num_tokens = sum(len(llm.encode(t)) for t in inputs)
        log(f"{len(inputs)} texts, {num_tokens} tokens, torch threads {torch.get_num_threads()}")
        outputs = {}

        def pagoda():
            outputs["pagoda"] = [o.embedding for o in llm.embed(inputs, use_tqdm=False)]

        def sentence_transformers():
            outputs["st"] = st.encode(inputs, batch_size=args.batch_size, convert_to_tensor=True).float().tolist()

        seconds = time_in_turn({"sentence_transformers": sentence_transformers, "pagoda": pagoda}, args.rounds,
                               warmup=1)
        rows = {name: {"seconds": round(s, 3), "texts_per_s": round(len(inputs) / s, 1),
                       "tokens_per_s": round(num_tokens / s, 1)} for name, s in seconds.items()}
        result = {
            **header("embed", command_words("embed", args), args.device), **model_keys(llm.executor.runner),
            "embedder": str(directory), "pooling": llm.executor.runner.pooler_config.pooling_type,
            "torch_threads": torch.get_num_threads(), "num_texts": len(inputs), "num_tokens": num_tokens,
            "text_len": [args.min_len, args.max_len], "st_batch_size": args.batch_size, "rounds": args.rounds,
            "rows": rows, "speedup": round(seconds["sentence_transformers"] / seconds["pagoda"], 2),
            "min_cosine": round(min(cosine(a, b) for a, b in zip(outputs["pagoda"], outputs["st"])), 6),
        }
    finally:
        llm.close()
    log(f"pagoda {rows['pagoda']['texts_per_s']} texts/s, sentence-transformers "
        f"{rows['sentence_transformers']['texts_per_s']} texts/s: {result['speedup']}x")
    return emit(result, args.output)
