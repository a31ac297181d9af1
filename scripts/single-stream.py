"""One stream through the served API, as a user's client sees it: for each --quantization given,
start `pagoda up` with it, send --requests chat completions one after another with the openai
client (streaming, --max-tokens tokens each, EOS ignored) and report output tokens/s (from the
first token to the last) and time to first token. The CPU quantization goal's measure.

    .venv/bin/python scripts/single-stream.py none auto --output benchmarks/results/....json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.redis_server import free_port  # noqa: E402
from pagoda.bench.common import header  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def serve(quantization: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "up", "--port", str(port), "--quantization",
                             quantization, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            client.models.list()
            return proc, url
        except openai.APIConnectionError:
            time.sleep(1)
    raise RuntimeError("pagoda up did not start")


def one_stream(url: str, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="none")
    start = time.perf_counter()
    times = []
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft_s": times[0] - start, "output_tokens": tokens,
            "decode_tokens_per_s": (tokens - 1) / (times[-1] - times[0]),
            "e2e_tokens_per_s": tokens / (times[-1] - start)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quantization", nargs="+")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output")
    args, extra = parser.parse_known_args()
    rows = []
    for quantization in args.quantization:
        proc, url = serve(quantization, extra)
        try:
            one_stream(url, 8)  # warm-up
            runs = [one_stream(url, args.max_tokens) for _ in range(args.requests)]
        finally:
            os.killpg(proc.pid, 2)
            proc.wait(60)
        row = {"quantization": quantization, "runs": runs,
               "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
               "e2e_tokens_per_s": statistics.median(r["e2e_tokens_per_s"] for r in runs),
               "ttft_s": statistics.median(r["ttft_s"] for r in runs)}
        print(f"{quantization}: {row['decode_tokens_per_s']:.1f} tok/s decode, {row['e2e_tokens_per_s']:.1f} tok/s "
              f"end to end, TTFT {row['ttft_s'] * 1000:.0f} ms", flush=True)
        rows.append(row)
    base = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["ratio_to_first"] = row["decode_tokens_per_s"] / base
    if args.output:
        command = "python scripts/single-stream.py " + " ".join(sys.argv[1:])
        Path(args.output).write_text(json.dumps({**header("single-stream", command, "cpu"), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
