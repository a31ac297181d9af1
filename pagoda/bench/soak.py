"""`python -m pagoda.bench.soak`: start the real stack, drive a steady mixed load, watch every process's memory.

    python -m pagoda.bench.soak --duration 300 --concurrency 16 --output soak.json [-- PAGODA UP FLAGS]

It starts `pagoda up` with pagoda/bench/stack.py (a private redis-server, scheduler, worker and
gateway processes; any unknown flag is passed to `pagoda up`, e.g. `--device cpu --max-num-seqs
32`), then runs `--concurrency` clients until `--duration` seconds have passed or `--requests` have been sent,
whichever comes first. Each request is drawn (seeded) from a mix: greedy completions and chats,
whole and streamed (their text must equal the stack's answer to the same request before the
load), seeded `n=2` samples, streams closed after a few events, whole requests abandoned
mid-generation, streams abandoned within milliseconds (often before the headers): these three ask
for 400 tokens ignoring EOS, so that only their aborts can free them in time for the leak check;
and malformed
requests (bad JSON, unknown model, bad parameter, wrong content type, missing field, too long a
prompt, unknown route) that must get exactly their 4xx and the OpenAI error object.

Every `--sample-interval` seconds it reads VmRSS (/proc/PID/status) of `pagoda up` and each of its
descendants. Growth is measured from the end of the warm-up (`--warmup` seconds into the load)
to the end of the load; a process passes when it grew by at most
max(`--rss-threshold-mib`, `--rss-threshold-pct` % of its warm RSS).

After the load it waits for the stack to drain and checks that nothing leaked: the KV cache
usage and the running/waiting/swapped gauges at 0, no pending entry in the requests stream's
consumer group and an empty stream. It then stops the stack (SIGINT) and expects exit code 0.

The verdict passes when every request was answered as expected (no hang, no unexpected status,
no 5xx, every checked text right), every process's RSS growth is within its allowance, nothing
leaked and the stack stopped cleanly. Prints a summary, writes the JSON to `--output`, and exits
0 on pass, 1 on fail.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.bench.common import header, write_result
from pagoda.bench.stack import GAUGES, Stack, parse_metrics

# (prompt, max_tokens): short prompts and moderate lengths keep a CPU run brisk
COMPLETION_PROMPTS = [("The capital of France is", 12), ("Here is a short list of fruits:", 16),
                      ("def fibonacci(n):", 16), ("The weather today is", 10)]
CHAT_PROMPTS = [("What is the capital of France?", 16), ("Name three colors.", 12),
                ("Say hello in Spanish.", 10), ("What is 2 + 2?", 8)]

LONG = 400  # max_tokens (EOS ignored) of a request that is abandoned: only an abort frees it within seconds
# kind: weight in the mix
MIX = {
    "completion": 2, "chat": 2, "completion_stream": 2, "chat_stream": 2, "sampled_n2": 1,
    "stream_cancel": 3, "whole_cancel": 1, "early_cancel": 1, "malformed": 2,
}
# malformed request: (expected status, expected error code or None)
MALFORMED = {
    "bad_json": (400, None), "unknown_model": (404, "model_not_found"), "bad_temperature": (400, None),
    "wrong_content_type": (400, None), "missing_messages": (400, None),
    "context_too_long": (400, "context_length_exceeded"), "unknown_route": (404, None),
}


# ----------------------------------------------------------------------------- small helpers, shared with tests

def body_for(kind: str, prompt: str, max_tokens: int, **extra) -> dict:
    """A greedy request body for /v1/completions ("completion") or /v1/chat/completions ("chat")."""
    body = {"max_tokens": max_tokens, "temperature": 0, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def path_for(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def choice_text(choice: dict) -> str:
    """The text of a whole response's choice or of a stream chunk's choice, either API."""
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


@dataclass
class StreamState:
    """What a client has seen of an SSE response so far (it may be cancelled at any point)."""

    headers: bool = False
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    events: int = 0  # data lines, [DONE] excluded
    done: bool = False  # saw data: [DONE]
    texts: dict[int, str] = field(default_factory=lambda: collections.defaultdict(str))
    finish: dict[int, str] = field(default_factory=dict)
    usage: dict | None = None
    error: dict | None = None
    body: bytes = b""  # a non-200's body


async def read_stream(client, url: str, body: dict, state: StreamState, stop_after: int | None = None) -> None:
    """POST `body` as a stream and read it into `state`; close it after `stop_after` events."""
    async with client.stream("POST", url, json=body) as response:
        state.headers, state.status, state.response_headers = True, response.status_code, dict(response.headers)
        if response.status_code != 200:
            state.body = await response.aread()
            return
        if stop_after == 0:
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                state.done = True
                return
            chunk = json.loads(line[6:])
            state.events += 1
            if "error" in chunk:
                state.error = chunk["error"]
            for choice in chunk.get("choices") or []:
                state.texts[choice["index"]] += choice_text(choice)
                if choice.get("finish_reason"):
                    state.finish[choice["index"]] = choice["finish_reason"]
            if chunk.get("usage"):
                state.usage = chunk["usage"]
            if stop_after is not None and state.events >= stop_after:
                return


def queue_state(redis_url: str) -> dict:
    """The requests stream: its length and the consumer group's pending entries."""
    import redis

    from common import streams

    client = redis.Redis.from_url(redis_url)
    try:
        length = client.xlen(streams.REQUESTS)
        try:
            pending = client.xpending(streams.REQUESTS, streams.SCHEDULER_GROUP)["pending"]
        except redis.ResponseError:  # no group yet: nothing can be pending
            pending = 0
        return {"xlen": length, "xpending": pending}
    finally:
        client.close()


def leak_state(base_url: str, redis_url: str) -> dict:
    """The scheduler gauges and the requests stream: all zero when nothing leaked."""
    import httpx

    metrics = parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
    # summed over the engine groups; None (not drained) while no scheduler is live to report them
    return {**{name: metrics.get(name) for name in GAUGES}, **queue_state(redis_url)}


def wait_drained(base_url: str, redis_url: str, timeout: float) -> tuple[bool, dict, float]:
    """Poll until every gauge and the stream are zero: (drained, last state, seconds waited)."""
    start = time.monotonic()
    while True:
        state = leak_state(base_url, redis_url)
        if all(v == 0 for v in state.values()):
            return True, state, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return False, state, time.monotonic() - start
        time.sleep(0.25)


# ----------------------------------------------------------------------------- memory

def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- the load

@dataclass
class Tally:
    sent: int = 0
    answered: int = 0  # a complete response, as expected
    cancelled: int = 0  # the client left on purpose
    failed: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: list = field(default_factory=list)
    cancelled_stage: collections.Counter = field(default_factory=collections.Counter)

    def fail(self, kind: str, message: str) -> None:
        self.failed += 1
        self.by_kind[kind]["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {message}")


class Load:
    def __init__(self, base_url: str, seed: int, request_timeout: float) -> None:
        self.base_url = base_url
        self.seed = seed
        self.request_timeout = request_timeout
        self.tally = Tally()
        self.references: dict[tuple[str, int], tuple[str, str]] = {}

    async def reference(self, client) -> None:
        """The stack's greedy answer to each prompt (one concurrent batch, before the load)."""
        async def one(kind: str, i: int, prompt: str, max_tokens: int) -> None:
            r = await client.post(self.base_url + path_for(kind), json=body_for(kind, prompt, max_tokens))
            r.raise_for_status()
            choice = r.json()["choices"][0]
            self.references[(kind, i)] = (choice_text(choice), choice["finish_reason"])

        await asyncio.gather(*[one("completion", i, p, m) for i, (p, m) in enumerate(COMPLETION_PROMPTS)],
                             *[one("chat", i, p, m) for i, (p, m) in enumerate(CHAT_PROMPTS)])

    def kind_of(self, number: int) -> tuple[str, random.Random]:
        """Request `number`'s kind and its own RNG: the same for a seed whatever the timing."""
        rng = random.Random(f"{self.seed}-{number}")
        return rng.choices(list(MIX), weights=list(MIX.values()))[0], rng

    async def one(self, client) -> None:
        kind, rng = self.kind_of(self.tally.sent)
        self.tally.sent += 1
        try:
            outcome = await asyncio.wait_for(self._send(client, kind, rng), self.request_timeout)
        except asyncio.TimeoutError:
            self.tally.fail(kind, f"no answer within {self.request_timeout:g} s (hang)")
            return
        except Exception as exc:  # a refused connection, a reset, a malformed body: all failures
            self.tally.fail(kind, f"{type(exc).__name__}: {exc}")
            return
        if outcome is None or outcome == "answered":
            self.tally.answered += 1
            self.tally.by_kind[kind]["answered"] += 1
        elif outcome.startswith("cancelled"):
            self.tally.cancelled += 1
            self.tally.by_kind[kind]["cancelled"] += 1
            self.tally.cancelled_stage[outcome.split(":", 1)[1]] += 1
        else:
            self.tally.fail(kind, outcome)

    async def _send(self, client, kind: str, rng: random.Random) -> str | None:
        """None/"answered" when the answer was right, "cancelled:<stage>", or what was wrong."""
        url = self.base_url
        if kind in ("completion", "chat", "completion_stream", "chat_stream"):
            api = kind.removesuffix("_stream")
        else:
            api = rng.choice(["completion", "chat"])
        prompts = CHAT_PROMPTS if api == "chat" else COMPLETION_PROMPTS
        i = rng.randrange(len(prompts))
        prompt, max_tokens = prompts[i]
        if kind in ("completion", "chat"):
            r = await client.post(url + path_for(api), json=body_for(api, prompt, max_tokens))
            self.tally.by_status[r.status_code] += 1
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:200]}"
            choice = r.json()["choices"][0]
            got = (choice_text(choice), choice["finish_reason"])
            return None if got == self.references[(api, i)] else f"{got!r} != {self.references[(api, i)]!r}"
        if kind in ("completion_stream", "chat_stream"):
            state = StreamState()
            body = body_for(api, prompt, max_tokens, stream=True, stream_options={"include_usage": True})
            await read_stream(client, url + path_for(api), body, state)
            self.tally.by_status[state.status] += 1
            return self._check_stream(state, [self.references[(api, i)]], max_tokens)
        if kind == "sampled_n2":
            body = body_for(api, prompt, max_tokens, n=2, temperature=0.8, seed=rng.randrange(1 << 30))
            r = await client.post(url + path_for(api), json=body)
            self.tally.by_status[r.status_code] += 1
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:200]}"
            data = r.json()
            if [c["index"] for c in data["choices"]] != [0, 1]:
                return f"choices {data['choices']!r}"
            if any(c["finish_reason"] not in ("stop", "length") for c in data["choices"]):
                return f"finish reasons {[c['finish_reason'] for c in data['choices']]}"
            if not 2 <= data["usage"]["completion_tokens"] <= 2 * max_tokens:
                return f"usage {data['usage']!r}"
            return None
        if kind == "stream_cancel":  # close the stream after 0..6 events
            state = StreamState()
            body = body_for(api, prompt, LONG, stream=True, n=rng.choice([1, 1, 2]), ignore_eos=True)
            stop_after = rng.randint(0, 6)
            await read_stream(client, url + path_for(api), body, state, stop_after=stop_after)
            self.tally.by_status[state.status] += 1
            if state.status != 200 or state.error is not None or state.done:
                return f"HTTP {state.status}, error {state.error!r}, [DONE] {state.done}: {state.body[:200]!r}"
            return f"cancelled:after {state.events} events"
        if kind == "whole_cancel":  # a whole (non-stream) request abandoned mid-generation
            body = body_for(api, prompt, LONG, ignore_eos=True)
            task = asyncio.ensure_future(client.post(url + path_for(api), json=body))
            done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.05, 0.5))
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return "cancelled:whole request mid-generation"
            r = task.result()
            self.tally.by_status[r.status_code] += 1
            return f"answered before it was abandoned: HTTP {r.status_code}: {r.text[:200]}"
        if kind == "early_cancel":  # a stream abandoned within 10 ms: often before its headers
            state = StreamState()
            body = body_for(api, prompt, LONG, stream=True, ignore_eos=True)
            task = asyncio.ensure_future(read_stream(client, url + path_for(api), body, state))
            await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.01))
            if task.done():
                task.result()
                self.tally.by_status[state.status] += 1
                return f"answered before it was abandoned: HTTP {state.status}"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "cancelled:" + (f"after {state.events} events" if state.headers else "before headers")
        if kind == "malformed":
            return await self._malformed(client, rng.choice(sorted(MALFORMED)))
        raise AssertionError(kind)

    def _check_stream(self, state: StreamState, expected: list[tuple[str, str]], max_tokens: int) -> str | None:
        if state.status != 200:
            return f"HTTP {state.status}: {state.body[:200]!r}"
        if state.error is not None or not state.done:
            return f"stream ended badly: error {state.error!r}, [DONE] {state.done}"
        got = [(state.texts[c], state.finish.get(c)) for c in range(len(expected))]
        if got != expected or len(state.finish) != len(expected):
            return f"stream {got!r} != {expected!r}"
        if state.usage is not None and state.usage["completion_tokens"] > max_tokens * len(expected):
            return f"usage {state.usage!r}"
        return None

    async def _malformed(self, client, what: str) -> str | None:
        url = self.base_url
        expected_status, expected_code = MALFORMED[what]
        if what == "bad_json":
            r = await client.post(url + "/v1/completions", content=b'{"prompt": "hi", ',
                                  headers={"content-type": "application/json"})
        elif what == "unknown_model":
            r = await client.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
        elif what == "bad_temperature":
            r = await client.post(url + "/v1/chat/completions",
                                  json=body_for("chat", "hi", 4, temperature=-1))
        elif what == "wrong_content_type":
            r = await client.post(url + "/v1/completions", content=b"prompt=hi",
                                  headers={"content-type": "text/plain"})
        elif what == "missing_messages":
            r = await client.post(url + "/v1/chat/completions", json={"max_tokens": 4})
        elif what == "context_too_long":
            r = await client.post(url + "/v1/completions", json={"prompt": "hi " * 9000, "max_tokens": 4})
        else:
            r = await client.post(url + "/v1/no-such-route", json={})
        self.tally.by_status[r.status_code] += 1
        if r.status_code != expected_status:
            return f"{what}: HTTP {r.status_code} (expected {expected_status}): {r.text[:200]}"
        error = r.json().get("error")
        if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
                and error["type"] == "invalid_request_error" and error["message"]):
            return f"{what}: not an OpenAI error object: {r.text[:200]}"
        if expected_code is not None and error["code"] != expected_code:
            return f"{what}: code {error['code']!r} (expected {expected_code!r})"
        return None


# ----------------------------------------------------------------------------- the soak

@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: dict[str, float]


async def drive(base_url: str, pids: dict[str, int], args) -> tuple[Load, list[Sample], Sample, Sample, float]:
    """The load, with RSS samples: (load, samples, sample at warm-up end, sample at load end, seconds)."""
    import httpx

    load = Load(base_url, args.seed, args.request_timeout)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        await load.reference(client)
        start = time.monotonic()
        deadline = start + args.duration

        def sample() -> Sample:
            s = Sample(round(time.monotonic() - start, 2),
                       {name: rss_mib(pid) for name, pid in pids.items()})
            samples.append(s)
            return s

        def more() -> bool:
            return time.monotonic() < deadline and (not args.requests or load.tally.sent < args.requests)

        async def client_loop() -> None:
            while more():
                await load.one(client)

        async def sampler() -> None:
            while True:
                sample()
                await asyncio.sleep(args.sample_interval)

        sampling = asyncio.ensure_future(sampler())
        clients = [asyncio.ensure_future(client_loop()) for _ in range(args.concurrency)]
        await asyncio.sleep(max(0.0, start + args.warmup - time.monotonic()))
        warm = sample()
        end: Sample | None = None
        last_report = time.monotonic()
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=1.0)
            if end is None and not more():
                end = sample()  # the load's last moment (in-flight requests finish after it)
            if time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                t = load.tally
                print(f"soak: {time.monotonic() - start:5.0f} s, {t.sent} sent, {t.answered} answered, "
                      f"{t.cancelled} cancelled, {t.failed} failed", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - start
        if end is None:
            end = sample()
        sampling.cancel()
        await asyncio.gather(*clients, sampling, return_exceptions=True)
    if warm.t > end.t:
        raise SystemExit("soak: the load ended before the warm-up did: raise --duration/--requests or lower --warmup")
    return load, samples, warm, end, elapsed


def memory_report(pids: dict[str, int], samples: list[Sample], warm: Sample, end: Sample, args) -> dict:
    report = {}
    for name, pid in pids.items():
        w, e = warm.rss_mib.get(name), end.rss_mib.get(name)
        series = [s.rss_mib[name] for s in samples if s.rss_mib.get(name) is not None]
        if w is None or e is None:
            report[name] = {"pid": pid, "ok": False, "error": "the process was gone"}
            continue
        allowed = max(args.rss_threshold_mib, w * args.rss_threshold_pct / 100)
        growth = e - w
        report[name] = {
            "pid": pid, "start_mib": round(series[0], 1), "warm_mib": round(w, 1), "end_mib": round(e, 1),
            "peak_mib": round(max(series), 1), "growth_mib": round(growth, 1),
            "growth_pct": round(100 * growth / w, 2), "allowed_mib": round(allowed, 1), "ok": growth <= allowed,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.bench.soak", description="Soak the real stack: mixed load, RSS of every process, leaks.",
        epilog="Other flags go to `pagoda up` (e.g. --device cpu --max-num-seqs 32).")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--requests", type=int, default=0, help="stop after sending this many (0: no limit)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients, each one request at a time")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of load before the reference RSS (default 20%% of --duration, 5 to 60)")
    parser.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--rss-threshold-mib", type=float, default=20.0, help="allowed growth after warm-up, MiB")
    parser.add_argument("--rss-threshold-pct", type=float, default=5.0,
                        help="allowed growth after warm-up, %% of the warm RSS (the larger allowance applies)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is a hang")
    parser.add_argument("--drain-timeout", type=float, default=15.0, help="seconds for the stack to drain at the end")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for `pagoda up` to be healthy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=None, help="a Redis for `pagoda up` (default: its private one)")
    parser.add_argument("--port", type=int, default=None, help="the gateway's port (default: a free one)")
    parser.add_argument("--output", help="write the result JSON here")
    parser.add_argument("--log", help="`pagoda up`'s output (default: a temporary file)")
    args, up_flags = parser.parse_known_args(argv)
    up_flags = [f for f in up_flags if f != "--"]
    if args.warmup is None:
        args.warmup = min(60.0, max(5.0, 0.2 * args.duration))
    logging.getLogger("httpx").setLevel(logging.WARNING)

    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="pagoda-soak-", suffix=".log")[1])
    started = time.monotonic()
    stack = Stack(*up_flags, *(["--redis-url", args.redis_url] if args.redis_url else []), port=args.port, log=log_path)
    try:
        stack.wait_ready(args.start_timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"soak: {exc}") from None
    startup_s = time.monotonic() - started
    pids = {"up": stack.process.pid, **stack.children()}
    print(f"soak: stack up in {startup_s:.1f} s at {stack.url} (Redis {stack.redis_url}); processes "
          + ", ".join(f"{n} {p}" for n, p in pids.items()), file=sys.stderr, flush=True)
    try:
        load, samples, warm, end, elapsed = asyncio.run(drive(stack.url, pids, args))
        drained, final_state, drain_s = wait_drained(stack.url, stack.redis_url, args.drain_timeout)
        after = Sample(round(elapsed + drain_s, 2), {name: rss_mib(pid) for name, pid in pids.items()})
    finally:
        exit_code = stack.stop()
    memory = memory_report(pids, samples + [after], warm, end, args)
    for name in memory:
        if after.rss_mib.get(name) is not None:
            memory[name]["idle_after_mib"] = round(after.rss_mib[name], 1)
    t = load.tally
    reasons = []
    if t.failed:
        reasons.append(f"{t.failed} request(s) failed")
    if t.answered + t.cancelled + t.failed != t.sent:
        reasons.append("requests unaccounted for")
    bad_status = {s: n for s, n in t.by_status.items() if s is None or s >= 500}
    if bad_status:
        reasons.append(f"server errors {bad_status}")
    reasons += [f"{name} RSS grew {m.get('growth_mib')} MiB (allowed {m.get('allowed_mib')})"
                for name, m in memory.items() if not m["ok"]]
    if not drained:
        reasons.append(f"not drained after {args.drain_timeout:g} s: {final_state}")
    if exit_code != 0:
        reasons.append(f"pagoda up exited with {exit_code}")
    command = shlex.join(["python", "-m", "pagoda.bench.soak", *(argv if argv is not None else sys.argv[1:])])
    result = {
        **header("soak", command),
        "up_flags": up_flags, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "startup_s": round(startup_s, 1), "load_s": round(elapsed, 1),
        "warmup_s": args.warmup, "concurrency": args.concurrency, "seed": args.seed,
        "requests": {"sent": t.sent, "answered": t.answered, "cancelled": t.cancelled, "failed": t.failed,
                     "per_s": round(t.sent / elapsed, 2),
                     "by_status": {str(k): v for k, v in sorted(t.by_status.items(), key=lambda kv: str(kv[0]))},
                     "by_kind": {k: dict(v) for k, v in sorted(t.by_kind.items())},
                     "cancelled_by_stage": dict(t.cancelled_stage.most_common())},
        "failures": t.failures,
        "rss": memory,
        "rss_thresholds": {"mib": args.rss_threshold_mib, "pct": args.rss_threshold_pct},
        "final_state": {**final_state, "drained": drained, "drain_s": round(drain_s, 2)},
        "stack_exit_code": exit_code,
        "verdict": "pass" if not reasons else "fail", "reasons": reasons,
        "samples": [{"t": s.t, "rss_mib": {k: round(v, 1) for k, v in s.rss_mib.items() if v is not None}}
                    for s in samples],
    }
    write_result(result, args.output)
    print(summary(result))
    return 0 if not reasons else 1


def summary(result: dict) -> str:
    r = result["requests"]
    lines = [
        f"soak: {r['sent']} requests in {result['load_s']} s ({r['per_s']}/s): {r['answered']} answered, "
        f"{r['cancelled']} cancelled, {r['failed']} failed; statuses {r['by_status']}",
        f"  cancelled by stage: {r['cancelled_by_stage']}",
        "  RSS (MiB)       start    warm     end    peak  growth     %  allowed",
    ]
    for name, m in result["rss"].items():
        if "error" in m:
            lines.append(f"  {name:<13} {m['error']}")
            continue
        lines.append(f"  {name:<13} {m['start_mib']:7.1f} {m['warm_mib']:7.1f} {m['end_mib']:7.1f} {m['peak_mib']:7.1f} "
                     f"{m['growth_mib']:+7.1f} {m['growth_pct']:+5.1f} {m['allowed_mib']:8.1f}  {'ok' if m['ok'] else 'FAIL'}")
    lines.append(f"  final state: {result['final_state']}; pagoda up exit code {result['stack_exit_code']}")
    lines += [f"  failure: {f}" for f in result["failures"][:10]]
    lines.append(f"soak: {result['verdict'].upper()}" + (f": {'; '.join(result['reasons'])}" if result["reasons"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
