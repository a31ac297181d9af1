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

Chaos (`--chaos-interval S`): during the load it SIGKILLs a child of `pagoda up` (which restarts
it): a worker rank, a scheduler or the private redis-server, the kind drawn in seeded rounds (each
round every kind once, in a shuffled order; `--chaos-victims` narrows the kinds), the process
drawn among those of that kind in every engine group. The first kill comes S seconds into the
load, each next one S seconds after the stack is whole again (every child back, each scheduler's
status in Redis with its workers ready, /health 200, all for 2 s); `--chaos-kills N` stops after N. Under
chaos a request may also end with an error, but only a well-formed one: a 5xx with the OpenAI
error object, or a stream ended by an error event and [DONE], its text so far a prefix of the
right text (never repeated). It must still never hang (`--request-timeout`) nor answer a wrong or
repeated text. After the load the soak waits for the stack to be whole (`--settle-timeout`),
then for it to drain (also `pagoda:started` empty), summing each gauge over every engine group.
RSS is judged only for the processes that lived through the load (the killed ones and those
restarted with them are listed). The result records every kill (time, victim, pid, seconds until
the stack was whole again) and the count of each outcome.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.bench.client import STREAMED, Stream, choice_text, http_client, read_stream
from pagoda.bench.common import header, names, write_result
from pagoda.bench.stack import GAUGES, RssSampler, Sample, Stack, parse_metrics, proc, process_tree, role, rss_of
from pagoda.up import MAX_RESTARTS, RESTART_WINDOW_S

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
# malformed request: (path, what is posted, expected status, expected error code or None)
MALFORMED = {
    "bad_json": ("/v1/completions", {"content": b'{"prompt": "hi", ', "headers": {"content-type": "application/json"}},
                 400, None),
    "unknown_model": ("/v1/completions", {"json": {"model": "no-such-model", "prompt": "hi"}}, 404, "model_not_found"),
    "bad_temperature": ("/v1/chat/completions", {"json": {"max_tokens": 4, "temperature": -1, "messages": [
        {"role": "user", "content": "hi"}]}}, 400, None),
    "wrong_content_type": ("/v1/completions", {"content": b"prompt=hi", "headers": {"content-type": "text/plain"}},
                           400, None),
    "missing_messages": ("/v1/chat/completions", {"json": {"max_tokens": 4}}, 400, None),
    "context_too_long": ("/v1/completions", {"json": {"prompt": "hi " * 9000, "max_tokens": 4}}, 400,
                         "context_length_exceeded"),
    "unknown_route": ("/v1/no-such-route", {"json": {}}, 404, None),
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


def prompt_of(api: str, i: int) -> tuple[str, int]:
    """Prompt `i` of `api`'s set, and its max_tokens."""
    return (CHAT_PROMPTS if api == "chat" else COMPLETION_PROMPTS)[i]


def path_for(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def queue_state(redis_url: str, started: bool = False) -> dict:
    """The requests streams (the shared one and each engine group's): their lengths and the
    consumer group's pending entries, summed; with `started`, the entries of the `pagoda:started`
    hash (requests that streamed a token and have not ended)."""
    import redis

    from common import streams

    client = redis.Redis.from_url(redis_url)
    try:
        length = pending = 0
        groups = client.scan_iter(match=streams.GROUP_REQUESTS_PREFIX + "*", count=1000, _type="stream")
        for stream in [streams.REQUESTS, *groups]:
            length += client.xlen(stream)
            try:
                pending += client.xpending(stream, streams.SCHEDULER_GROUP)["pending"]
            except redis.ResponseError:  # no group yet: nothing can be pending
                pass
        return {"xlen": length, "xpending": pending, **({"started": client.hlen(streams.STARTED)} if started else {})}
    finally:
        client.close()


def leak_state(base_url: str, redis_url: str, started: bool = False) -> dict:
    """The scheduler gauges (summed over engine groups) and the requests stream, and with `started`
    the `pagoda:started` hash: all zero when nothing leaked."""
    import httpx

    metrics = parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
    # summed over the engine groups; None (not drained) while no scheduler is live to report them
    return {**{name: metrics.get(name) for name in GAUGES}, **queue_state(redis_url, started)}


def wait_drained(base_url: str, redis_url: str, timeout: float, started: bool = False) -> tuple[bool, dict, float]:
    """Poll until every gauge and the stream are zero: (drained, last state, seconds waited)."""
    start = time.monotonic()
    while True:
        state = leak_state(base_url, redis_url, started)
        if all(v == 0 for v in state.values()):
            return True, state, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return False, state, time.monotonic() - start
        time.sleep(0.25)


# ----------------------------------------------------------------------------- the load

@dataclass(slots=True)
class ServerError:
    """A well-formed error answer: what a request may end with under chaos (a failure otherwise)."""

    cause: str  # where, status and code, and the message with its numbers masked: a counting key
    detail: str  # what a failure message says


def server_error(status: int | None, body: bytes | str | dict | None, where: str) -> ServerError | str:
    """A 5xx (or an SSE error event, `status` None) whose body is the OpenAI error object of a server
    error: a ServerError; anything else: what is wrong with it."""
    text = body if isinstance(body, str) else body.decode(errors="replace") if isinstance(body, bytes) else ""
    detail = f"HTTP {status}: {text[:200]}" if status is not None else f"error event {body!r}"
    if status is not None and status < 500:
        return detail
    error = body if isinstance(body, dict) else None
    if error is None:
        try:
            error = json.loads(text).get("error")
        except (ValueError, AttributeError):
            return f"{detail} (not an OpenAI error object)"
    if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and error["type"] == "server_error" and error["message"]):
        return f"{detail} (not an OpenAI server error object)"
    if error["code"] == "timeout":  # the gateway's request_timeout_s passed: a hang in the stack
        return f"{detail} (a hang)"
    message = re.sub(r"\d+", "N", str(error["message"]))[:120]
    return ServerError(f"{where} {status or ''} {error['code']}: {message}".replace("  ", " "), detail)


def prefix_consistent(text: str, expected: str) -> bool:
    """One is a prefix of the other: the text of a stream cut short (or run past `expected`'s end)."""
    return expected.startswith(text) or text.startswith(expected)


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0  # a complete response, as expected
    cancelled: int = 0  # the client left on purpose
    errored: int = 0  # a well-formed server error (only allowed under chaos)
    failed: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_kind: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: list = field(default_factory=list)
    cancelled_stage: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)  # ServerError.cause -> count

    def fail(self, kind: str, message: str) -> None:
        self.failed += 1
        self.by_kind[kind]["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {message}")


class Load:
    def __init__(self, base_url: str, seed: int, request_timeout: float, chaos: bool = False) -> None:
        self.base_url = base_url
        self.seed = seed
        self.request_timeout = request_timeout
        self.chaos = chaos  # a well-formed server error is an allowed outcome
        self.tally = Tally()
        self.start = time.monotonic()  # when the load began (drive sets it): failures say when they were sent
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
        number, sent_at = self.tally.sent, time.monotonic() - self.start
        kind, rng = self.kind_of(number)
        self.tally.sent += 1
        try:
            outcome = await asyncio.wait_for(self._send(client, kind, rng), self.request_timeout)
        except asyncio.TimeoutError:
            self.tally.fail(kind, f"#{number} sent at {sent_at:.1f} s: no answer within {self.request_timeout:g} s "
                                  "(hang)")
            return
        except Exception as exc:  # a refused connection, a reset, a malformed body: all failures
            self.tally.fail(kind, f"#{number} sent at {sent_at:.1f} s: {type(exc).__name__}: {exc}")
            return
        if outcome is None or outcome == "answered":
            self.tally.answered += 1
            self.tally.by_kind[kind]["answered"] += 1
        elif isinstance(outcome, ServerError):
            if not self.chaos:
                self.tally.fail(kind, f"#{number} sent at {sent_at:.1f} s: {outcome.detail}")
                return
            self.tally.errored += 1
            self.tally.by_kind[kind]["errored"] += 1
            self.tally.errors[outcome.cause] += 1
        elif outcome.startswith("cancelled"):
            self.tally.cancelled += 1
            self.tally.by_kind[kind]["cancelled"] += 1
            self.tally.cancelled_stage[outcome.split(":", 1)[1]] += 1
        else:
            self.tally.fail(kind, f"#{number} sent at {sent_at:.1f} s: {outcome}")

    async def _send(self, client, kind: str, rng: random.Random) -> str | ServerError | None:
        """None/"answered" when the answer was right, "cancelled:<stage>", a ServerError, or what was wrong."""
        if kind in ("completion", "chat", "completion_stream", "chat_stream"):
            api = kind.removesuffix("_stream")
        else:
            api = rng.choice(["completion", "chat"])
        i = rng.randrange(len(CHAT_PROMPTS if api == "chat" else COMPLETION_PROMPTS))
        if kind == "malformed":
            return await self._malformed(client, rng.choice(sorted(MALFORMED)))
        send = {"completion": self._send_whole, "chat": self._send_whole, "completion_stream": self._send_stream,
                "chat_stream": self._send_stream, "sampled_n2": self._send_sampled_n2,
                "stream_cancel": self._send_stream_cancel, "whole_cancel": self._send_whole_cancel,
                "early_cancel": self._send_early_cancel}[kind]
        return await send(client, api, i, rng)

    async def _send_whole(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """A greedy whole request: its answer must be the reference's."""
        prompt, max_tokens = prompt_of(api, i)
        r = await client.post(self.base_url + path_for(api), json=body_for(api, prompt, max_tokens))
        self.tally.by_status[r.status_code] += 1
        if r.status_code != 200:
            return server_error(r.status_code, r.content, "whole")
        choice = r.json()["choices"][0]
        got = (choice_text(choice), choice["finish_reason"])
        return None if got == self.references[(api, i)] else f"{got!r} != {self.references[(api, i)]!r}"

    async def _send_stream(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """A greedy stream: its text must be the reference's."""
        prompt, max_tokens = prompt_of(api, i)
        state = Stream()
        body = body_for(api, prompt, max_tokens, **STREAMED)
        await read_stream(client, self.base_url + path_for(api), body, state)
        self.tally.by_status[state.status] += 1
        return self._check_stream(state, [self.references[(api, i)]], max_tokens)

    async def _send_sampled_n2(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """Two seeded samples: two choices, each finished, within the token budget."""
        prompt, max_tokens = prompt_of(api, i)
        body = body_for(api, prompt, max_tokens, n=2, temperature=0.8, seed=rng.randrange(1 << 30))
        r = await client.post(self.base_url + path_for(api), json=body)
        self.tally.by_status[r.status_code] += 1
        if r.status_code != 200:
            return server_error(r.status_code, r.content, "whole")
        data = r.json()
        if [c["index"] for c in data["choices"]] != [0, 1]:
            return f"choices {data['choices']!r}"
        if any(c["finish_reason"] not in ("stop", "length") for c in data["choices"]):
            return f"finish reasons {[c['finish_reason'] for c in data['choices']]}"
        if not 2 <= data["usage"]["completion_tokens"] <= 2 * max_tokens:
            return f"usage {data['usage']!r}"
        return None

    async def _send_stream_cancel(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """A stream closed after 0..6 events: what it read must continue the reference."""
        prompt, _ = prompt_of(api, i)
        state = Stream()
        n = rng.choice([1, 1, 2])
        body = body_for(api, prompt, LONG, stream=True, n=n, ignore_eos=True)
        stop_after = rng.randint(0, 6)
        await read_stream(client, self.base_url + path_for(api), body, state, stop_after=stop_after)
        self.tally.by_status[state.status] += 1
        expected = self.references[(api, i)][0]  # greedy: each of the n texts starts so (EOS ignored)
        wrong = [c for c, text in state.texts.items() if not prefix_consistent(text, expected)]
        if wrong:
            return f"stream {dict(state.texts)!r} does not continue {expected!r} (choices {wrong})"
        if state.status != 200 or state.error is not None:
            return self._stream_error(state)
        if state.done:
            return f"HTTP {state.status}, error {state.error!r}, [DONE] {state.done}: {state.body[:200]!r}"
        return f"cancelled:after {state.events} events"

    async def _send_whole_cancel(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """A whole (non-stream) request abandoned mid-generation."""
        prompt, _ = prompt_of(api, i)
        body = body_for(api, prompt, LONG, ignore_eos=True)
        task = asyncio.ensure_future(client.post(self.base_url + path_for(api), json=body))
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.05, 0.5))
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "cancelled:whole request mid-generation"
        r = task.result()
        self.tally.by_status[r.status_code] += 1
        if r.status_code >= 500:
            return server_error(r.status_code, r.content, "whole")
        return f"answered before it was abandoned: HTTP {r.status_code}: {r.text[:200]}"

    async def _send_early_cancel(self, client, api: str, i: int, rng: random.Random) -> str | ServerError | None:
        """A stream abandoned within 10 ms: often before its headers."""
        prompt, _ = prompt_of(api, i)
        state = Stream()
        body = body_for(api, prompt, LONG, stream=True, ignore_eos=True)
        task = asyncio.ensure_future(read_stream(client, self.base_url + path_for(api), body, state))
        await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.01))
        if task.done():
            task.result()
            self.tally.by_status[state.status] += 1
            if state.status != 200 or state.error is not None:
                return self._stream_error(state)
            return f"answered before it was abandoned: HTTP {state.status}"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "cancelled:" + (f"after {state.events} events" if state.headers else "before headers")

    @staticmethod
    def _stream_error(state: Stream) -> ServerError | str:
        """A stream refused (a 5xx before it began) or ended by an error event, then [DONE] and nothing
        after the error: a ServerError; anything else: what is wrong."""
        if state.status != 200:
            return server_error(state.status, state.body, "stream")
        outcome = server_error(None, state.error, "stream")
        if isinstance(outcome, ServerError) and (not state.done or state.after_error):
            return (f"stream ended badly: error {state.error!r}, {state.after_error} event(s) after it, "
                    f"[DONE] {state.done}")
        return outcome

    def _check_stream(self, state: Stream, expected: list[tuple[str, str]],
                      max_tokens: int) -> str | ServerError | None:
        if state.status != 200:
            return server_error(state.status, state.body, "stream")
        if state.error is not None:  # its text so far must be the start of the right one, never repeated
            cut = [(c, state.texts[c]) for c in range(len(expected)) if not expected[c][0].startswith(state.texts[c])]
            if cut or len(state.texts) > len(expected):
                return f"stream cut by {state.error!r}: {dict(state.texts)!r} is not a prefix of {expected!r}"
            return self._stream_error(state)
        if not state.done:
            return f"stream ended badly: error {state.error!r}, [DONE] {state.done}"
        got = [(state.texts[c], state.finish.get(c)) for c in range(len(expected))]
        if got != expected or len(state.finish) != len(expected):
            return f"stream {got!r} != {expected!r}"
        if state.usage is not None and state.usage["completion_tokens"] > max_tokens * len(expected):
            return f"usage {state.usage!r}"
        return None

    async def _malformed(self, client, what: str) -> str | ServerError | None:
        path, request, expected_status, expected_code = MALFORMED[what]
        r = await client.post(self.base_url + path, **request)
        self.tally.by_status[r.status_code] += 1
        if r.status_code >= 500:  # e.g. no scheduler ready to check the prompt's length against: 503
            outcome = server_error(r.status_code, r.content, f"malformed {what}")
            return outcome if isinstance(outcome, str) else ServerError(
                outcome.cause, f"{what}: HTTP {r.status_code} (expected {expected_status}): {r.text[:200]}")
        if r.status_code != expected_status:
            return f"{what}: HTTP {r.status_code} (expected {expected_status}): {r.text[:200]}"
        error = r.json().get("error")
        if not (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
                and error["type"] == "invalid_request_error" and error["message"]):
            return f"{what}: not an OpenAI error object: {r.text[:200]}"
        if expected_code is not None and error["code"] != expected_code:
            return f"{what}: code {error['code']!r} (expected {expected_code!r})"
        return None


# ----------------------------------------------------------------------------- chaos

CHAOS_KINDS = ("worker", "scheduler", "redis-server")
WHOLE_FOR_S = 2.0  # whole this long: a scheduler's status may say "ready" for a moment after its worker died


@dataclass(slots=True)
class Member:
    """A child of `pagoda up`. Its label names its place in the stack, the same after a restart."""

    kind: str  # worker, scheduler, gateway, redis-server
    label: str  # e.g. "engine 1 worker rank 0"
    pid: int


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in argv."""
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word[len(name) + 1:]
    return None


def members(root: int) -> list[Member]:
    """`pagoda up`'s living children (zombies, killed and not yet reaped, left out). A worker belongs
    to the engine group whose scheduler has its ZeroMQ address; `--rank` is its rank (default 0)."""
    found = []
    for pid in process_tree(root).values():
        info = proc(pid)
        if info is not None and info[0] == root and info[1] != "Z" and (kind := role(info[2])):
            found.append((pid, kind, info[2]))
    engines = {_flag(argv, "--zmq-address"): _flag(argv, "--engine-id") or "0"
               for _, kind, argv in found if kind == "scheduler"}
    result = []
    for pid, kind, argv in found:
        if kind == "worker":
            engine = engines.get(_flag(argv, "--zmq-address"), "?")
            label = f"engine {engine} worker rank {_flag(argv, '--rank') or '0'}"
        elif kind == "scheduler":
            label = f"engine {_flag(argv, '--engine-id') or '0'} scheduler"
        else:
            label = kind
        result.append(Member(kind, label, pid))
    return sorted(result, key=lambda m: m.label)


def ready_schedulers(stack: Stack) -> set[str]:
    """The ids (hostname-pid) of the schedulers whose status in Redis says their workers are ready
    (none while Redis is down)."""
    import redis

    try:
        return {s.scheduler_id for s in stack.statuses() if s.workers_ready}
    except redis.RedisError:
        return set()


@dataclass(slots=True)
class Kill:
    t: float  # seconds since the load started
    victim: str  # the kind: worker, scheduler, redis-server
    label: str
    pid: int
    whole_after_s: float | None = None  # until the stack was whole again (None: it never was)


class Chaos:
    """SIGKILLs `pagoda up`'s children during the load, one at a time, each once the stack is whole."""

    def __init__(self, stack: Stack, interval: float, seed: int, kinds: list[str], max_kills: int) -> None:
        self.stack = stack
        self.interval = interval
        self.rng_seed = seed
        self.rng = random.Random(f"chaos-{seed}")
        self.expected = [(m.kind, m.label) for m in members(stack.process.pid)]
        self.kinds = [k for k in kinds if any(kind == k for kind, _ in self.expected)]
        self.max_kills = max_kills
        self.round: list[str] = []
        self.kills: list[Kill] = []
        self.killed_pids: set[int] = set()
        self.start = 0.0  # monotonic time the load started: Kill.t counts from it

    def whole(self) -> bool:
        """Every child back (the same labels as at the start), each scheduler's status fresh in Redis
        with its workers ready and no dead scheduler's status left, and /health 200."""
        now = members(self.stack.process.pid)
        if [(m.kind, m.label) for m in now] != self.expected:
            return False
        schedulers = {m.pid for m in now if m.kind == "scheduler"}
        ready = ready_schedulers(self.stack)
        if {int(s.rsplit("-", 1)[1]) for s in ready if s.rsplit("-", 1)[-1].isdigit()} != schedulers \
                or len(ready) != len(schedulers):
            return False
        return self.stack.health() == 200

    def victim(self) -> Member | None:
        """The next kind of the seeded round (every kind once per round), then one process of it.
        A child killed MAX_RESTARTS - 1 times in the last RESTART_WINDOW_S is spared (one more
        restart would look like a crash loop to `pagoda up`, which would give up): then the next
        kind, or no victim this time."""
        now = time.monotonic() - self.start
        recent = collections.Counter(k.label for k in self.kills if now - k.t < RESTART_WINDOW_S)
        alive = members(self.stack.process.pid)
        for _ in range(len(self.kinds)):
            if not self.round:
                self.round = self.rng.sample(self.kinds, len(self.kinds))
            kind = self.round.pop()
            candidates = [m for m in alive if m.kind == kind and recent[m.label] < MAX_RESTARTS - 1]
            if candidates:
                return self.rng.choice(candidates)
        return None

    async def run(self, start: float, more) -> None:
        """Kill, wait for the stack to be whole, wait `interval`, kill again, while `more()`."""
        self.start = start
        next_kill = start + self.interval
        while more() and self.stack.process.poll() is None and len(self.kills) < (self.max_kills or float("inf")):
            await asyncio.sleep(max(0.0, min(next_kill - time.monotonic(), 0.5)))
            if time.monotonic() < next_kill or not more():
                continue
            member = self.victim()
            if member is None:
                next_kill = time.monotonic() + 1.0
                continue
            try:
                os.kill(member.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            kill = Kill(round(time.monotonic() - start, 2), member.kind, member.label, member.pid)
            self.kills.append(kill)
            self.killed_pids.add(member.pid)
            print(f"soak: {kill.t:5.0f} s, killed {member.label} (pid {member.pid})", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)  # `pagoda up` polls every 0.5 s: let it see the death first
            self.record_whole(await asyncio.to_thread(self.wait_whole, float("inf"), lambda: not more()))
            next_kill = time.monotonic() + self.interval

    def wait_whole(self, timeout: float, give_up=lambda: False) -> float | None:
        """The moment (monotonic) from which the stack stayed whole WHOLE_FOR_S seconds; None at the
        `timeout`, on `give_up()` or once `pagoda up` has exited."""
        deadline, since = time.monotonic() + timeout, None
        while time.monotonic() < deadline and not give_up() and self.stack.process.poll() is None:
            if not self.whole():
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= WHOLE_FOR_S:
                return since
            time.sleep(0.5)
        return None

    def record_whole(self, since: float | None) -> None:
        """The kills not yet followed by a whole stack were followed by one from `since`."""
        for kill in self.kills:
            if kill.whole_after_s is None and since is not None and since - self.start > kill.t:
                kill.whole_after_s = round(since - self.start - kill.t, 2)


# ----------------------------------------------------------------------------- the soak

async def drive(base_url: str, pids: dict[str, int], args,
                chaos: Chaos | None = None) -> tuple[Load, list[Sample], Sample, Sample, float]:
    """The load, with RSS samples and `chaos`'s kills: (load, samples, sample at warm-up end, sample at
    load end, seconds)."""
    load = Load(base_url, args.seed, args.request_timeout, chaos=chaos is not None)
    async with http_client(args.concurrency + 7, args.request_timeout) as client:
        await load.reference(client)
        start = load.start = time.monotonic()
        deadline = start + args.duration
        sampler = RssSampler(lambda: pids, args.sample_interval).begin()  # its clock: from the load's start
        sampler.sample()

        def more() -> bool:
            return time.monotonic() < deadline and (not args.requests or load.tally.sent < args.requests)

        async def client_loop() -> None:
            while more():
                await load.one(client)

        clients = [asyncio.ensure_future(client_loop()) for _ in range(args.concurrency)]
        killing = asyncio.ensure_future(chaos.run(start, more) if chaos else asyncio.sleep(0))
        await asyncio.sleep(max(0.0, start + args.warmup - time.monotonic()))
        warm = sampler.sample()
        end: Sample | None = None
        last_report = time.monotonic()
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=1.0)
            if end is None and not more():
                end = sampler.sample()  # the load's last moment (in-flight requests finish after it)
            if time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                t = load.tally
                print(f"soak: {time.monotonic() - start:5.0f} s, {t.sent} sent, {t.answered} answered, "
                      f"{t.cancelled} cancelled, {t.errored} errors, {t.failed} failed", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - start
        if end is None:
            end = sampler.sample()
        sampler.end()
        await asyncio.gather(*clients, return_exceptions=True)
        await killing  # it stops with the load (`more()`); its errors are the soak's
    if warm.t > end.t:
        raise SystemExit("soak: the load ended before the warm-up did: raise --duration/--requests or lower --warmup")
    return load, sampler.samples, warm, end, elapsed


def memory_report(pids: dict[str, int], samples: list[Sample], warm: Sample, end: Sample, args,
                  killed: set[int] | None = None, killable: set[str] = frozenset()) -> dict:
    """Each process's RSS growth from the warm-up's end to the load's. Under chaos (`killed`: the
    pids it killed) a process named in `killable` (a worker, scheduler or redis-server) that died
    is not judged: "killed", or "restarted" when it died of another's death; the gateway and
    `pagoda up` must live."""
    report = {}
    for name, pid in pids.items():
        w, e = warm.rss_mib.get(name), end.rss_mib.get(name)
        series = [s.rss_mib[name] for s in samples if s.rss_mib.get(name) is not None]
        if killed is not None and (w is None or e is None) and name in killable:
            report[name] = {"pid": pid, "ok": True, "error": "killed" if pid in killed else "restarted"}
            continue
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


@dataclass
class SoakRun:
    """What one soak of the stack measured, before the verdict."""
    pids: dict[str, int]  # the processes sampled: "up" and its children (under chaos, by label)
    chaos: Chaos | None
    load: Load
    samples: list[Sample]
    warm: Sample
    end: Sample
    after: Sample  # once drained (and, under chaos, whole again)
    startup_s: float
    elapsed: float
    settled: bool
    settle_s: float
    drained: bool
    final_state: dict
    drain_s: float
    children_at_end: dict[str, int]  # under chaos: {label: pid}
    exit_code: int | None = None  # `pagoda up`'s, once stopped


def build_parser() -> argparse.ArgumentParser:
    """The soak's flags; the others go to `pagoda up`."""
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.bench.soak", description="Soak the real stack: mixed load, RSS of every process, leaks.",
        epilog="Other flags go to `pagoda up` (e.g. --device cpu --max-num-seqs 32 --data-parallel-size 2).")
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
    parser.add_argument("--drain-timeout", type=float, default=None,
                        help="seconds for the stack to drain at the end (default 15; 120 under chaos, where an "
                             "abort lost with Redis leaves its request to run to max_tokens)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for `pagoda up` to be healthy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos-interval", type=float, default=0.0,
                        help="chaos: SIGKILL a child this many seconds into the load, then this long after the "
                             "stack is whole again after each kill (0: no chaos)")
    parser.add_argument("--chaos-seed", type=int, default=None, help="the victims' seed (default: --seed)")
    parser.add_argument("--chaos-victims", default=",".join(CHAOS_KINDS),
                        help="the kinds to kill, comma-separated (default: worker,scheduler,redis-server)")
    parser.add_argument("--chaos-kills", type=int, default=0, help="stop killing after this many (0: no limit)")
    parser.add_argument("--settle-timeout", type=float, default=180.0,
                        help="chaos: seconds for the stack to be whole again after the load")
    parser.add_argument("--redis-url", default=None, help="a Redis for `pagoda up` (default: its private one)")
    parser.add_argument("--port", type=int, default=None, help="the gateway's port (default: a free one)")
    parser.add_argument("--output", help="write the result JSON here")
    parser.add_argument("--log", help="`pagoda up`'s output (default: a temporary file)")
    return parser


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(args with their defaults resolved, the flags for `pagoda up`, the chaos victims' kinds)."""
    parser = build_parser()
    args, up_flags = parser.parse_known_args(argv)
    up_flags = [f for f in up_flags if f != "--"]
    if args.warmup is None:
        args.warmup = min(60.0, max(5.0, 0.2 * args.duration))
    if args.drain_timeout is None:
        args.drain_timeout = 120.0 if args.chaos_interval > 0 else 15.0
    victims = names(args.chaos_victims)
    if not set(victims) <= set(CHAOS_KINDS):
        parser.error(f"--chaos-victims: each of {', '.join(CHAOS_KINDS)}")
    return args, up_flags, victims


def main(argv: list[str] | None = None) -> int:
    args, up_flags, victims = parse_args(argv)
    run = soak(args, up_flags, victims)
    chaos = run.chaos
    memory = memory_report(run.pids, run.samples + [run.after], run.warm, run.end, args,
                           chaos.killed_pids if chaos else None,
                           {label for kind, label in chaos.expected if kind in CHAOS_KINDS} if chaos else set())
    for name in memory:
        if run.after.rss_mib.get(name) is not None:
            memory[name]["idle_after_mib"] = round(run.after.rss_mib[name], 1)
    reasons = verdict_reasons(run, memory, args)
    command = shlex.join(["python", "-m", "pagoda.bench.soak", *(argv if argv is not None else sys.argv[1:])])
    result = soak_result(command, up_flags, args, run, memory, reasons)
    write_result(result, args.output)
    print(summary(result))
    return 0 if not reasons else 1


def soak(args, up_flags: list[str], victims: list[str]) -> SoakRun:
    """Start `pagoda up`, load it (killing children under chaos), let it drain, stop it."""
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="pagoda-soak-", suffix=".log")[1])
    started = time.monotonic()
    stack = Stack(*up_flags, *(["--redis-url", args.redis_url] if args.redis_url else []), port=args.port, log=log_path)
    try:
        stack.wait_ready(args.start_timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"soak: {exc}") from None
    try:
        run = load_stack(stack, args, victims, started, log_path)
    finally:
        exit_code = stack.stop()
    run.exit_code = exit_code
    return run


def load_stack(stack: Stack, args, victims: list[str], started: float, log_path: Path) -> SoakRun:
    """The load on a ready stack, then (under chaos) the wait for it to be whole again and the drain."""
    chaos = None
    if args.chaos_interval > 0:  # /health answers once one group is ready: wait for all of them before the load
        chaos = Chaos(stack, args.chaos_interval, args.seed if args.chaos_seed is None else args.chaos_seed,
                      victims, args.chaos_kills)
        if chaos.wait_whole(args.start_timeout) is None:
            raise SystemExit(f"soak: the stack was not whole within {args.start_timeout:g} s: see {log_path}")
    startup_s = time.monotonic() - started
    pids = {"up": stack.process.pid, **stack.children()}
    if chaos is not None:  # by label: "engine 1 worker rank 0"
        pids = {"up": stack.process.pid, **{m.label: m.pid for m in members(stack.process.pid)}}
    print(f"soak: stack up in {startup_s:.1f} s at {stack.url} (Redis {stack.redis_url}); processes "
          + ", ".join(f"{n} {p}" for n, p in pids.items()), file=sys.stderr, flush=True)
    load, samples, warm, end, elapsed = asyncio.run(drive(stack.url, pids, args, chaos))
    settled, settle_s = True, 0.0
    if chaos is not None:  # every child back and ready before the leak check
        settle_start = time.monotonic()
        since = chaos.wait_whole(args.settle_timeout)
        settled, settle_s = since is not None, time.monotonic() - settle_start
        chaos.record_whole(since)
    if stack.process.poll() is None:
        drained, final_state, drain_s = wait_drained(stack.url, stack.redis_url, args.drain_timeout,
                                                     started=chaos is not None)
    else:  # it gave up (a crash loop): its exit code is the verdict's reason
        drained, final_state, drain_s = False, {}, 0.0
    after = Sample(round(elapsed + settle_s + drain_s, 2), rss_of(pids))
    now = {m.label: m.pid for m in members(stack.process.pid)} if chaos is not None else {}
    return SoakRun(pids, chaos, load, samples, warm, end, after, startup_s, elapsed, settled, settle_s, drained,
                   final_state, drain_s, now)


def verdict_reasons(run: SoakRun, memory: dict, args) -> list[str]:
    """Why the soak failed: failed or lost requests, server errors, RSS growth, chaos that did nothing
    or a stack not whole again, no drain, a nonzero exit code (none: it passed)."""
    t, chaos = run.load.tally, run.chaos
    reasons = []
    if t.failed:
        reasons.append(f"{t.failed} request(s) failed")
    if t.answered + t.cancelled + t.errored + t.failed != t.sent:
        reasons.append("requests unaccounted for")
    bad_status = {s: n for s, n in t.by_status.items() if s is None or (s >= 500 and chaos is None)}
    if bad_status:
        reasons.append(f"server errors {bad_status}")
    reasons += [f"{name} RSS grew {m.get('growth_mib')} MiB (allowed {m.get('allowed_mib')})"
                if "error" not in m else f"{name}: {m['error']}" for name, m in memory.items() if not m["ok"]]
    if chaos is not None:
        if not chaos.kills:
            reasons.append("chaos killed nothing: lower --chaos-interval or raise --duration")
        if not run.settled:
            reasons.append(f"the stack was not whole {args.settle_timeout:g} s after the load")
    if not run.drained and run.final_state:
        reasons.append(f"not drained after {args.drain_timeout:g} s: {run.final_state}")
    if run.exit_code != 0:
        reasons.append(f"pagoda up exited with {run.exit_code}")
    return reasons


def soak_result(command: str, up_flags: list[str], args, run: SoakRun, memory: dict, reasons: list[str]) -> dict:
    """The result JSON: the run, its requests by outcome, RSS per process, the verdict (and the chaos)."""
    t, chaos, elapsed = run.load.tally, run.chaos, run.elapsed
    result = {
        **header("soak", command),
        "up_flags": up_flags, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "startup_s": round(run.startup_s, 1), "load_s": round(elapsed, 1),
        "warmup_s": args.warmup, "concurrency": args.concurrency, "seed": args.seed,
        "requests": {"sent": t.sent, "answered": t.answered, "cancelled": t.cancelled, "failed": t.failed,
                     "per_s": round(t.sent / elapsed, 2),
                     "by_status": {str(k): v for k, v in sorted(t.by_status.items(), key=lambda kv: str(kv[0]))},
                     "by_kind": {k: dict(v) for k, v in sorted(t.by_kind.items())},
                     "cancelled_by_stage": dict(t.cancelled_stage.most_common())},
        "failures": t.failures,
        "rss": memory,
        "rss_thresholds": {"mib": args.rss_threshold_mib, "pct": args.rss_threshold_pct},
        "final_state": {**run.final_state, "drained": run.drained, "drain_s": round(run.drain_s, 2)},
        "stack_exit_code": run.exit_code,
        "verdict": "pass" if not reasons else "fail", "reasons": reasons,
        "samples": [{"t": s.t, "rss_mib": {k: round(v, 1) for k, v in s.rss_mib.items() if v is not None}}
                    for s in run.samples],
    }
    if chaos is not None:
        result["requests"]["errored"] = t.errored
        result["requests"]["errors_by_cause"] = dict(t.errors.most_common())
        result["chaos"] = {
            "interval_s": args.chaos_interval, "seed": chaos.rng_seed, "victims": chaos.kinds,
            "kills": [dataclasses.asdict(k) for k in chaos.kills],
            "kills_by_victim": dict(collections.Counter(k.victim for k in chaos.kills)),
            "settled": run.settled, "settle_s": round(run.settle_s, 2),
            "children_at_start": [label for _, label in chaos.expected], "children_at_end": run.children_at_end,
        }
    return result


def summary(result: dict) -> str:
    r = result["requests"]
    errored = f"{r['errored']} errors, " if "errored" in r else ""
    lines = [
        f"soak: {r['sent']} requests in {result['load_s']} s ({r['per_s']}/s): {r['answered']} answered, "
        f"{r['cancelled']} cancelled, {errored}{r['failed']} failed; statuses {r['by_status']}",
        f"  cancelled by stage: {r['cancelled_by_stage']}",
    ]
    if "chaos" in result:
        c = result["chaos"]
        lines.append(f"  chaos: {len(c['kills'])} kills {c['kills_by_victim']}; whole again after (s): "
                     + ", ".join(f"{k['label']} {k['whole_after_s']}" for k in c["kills"]))
        lines += [f"  errors: {n} x {cause}" for cause, n in r["errors_by_cause"].items()]
    w = max(13, *(len(name) for name in result["rss"]))  # "engine 0 worker rank 0" under chaos
    lines.append(f"  {'RSS (MiB)':<{w}}   start    warm     end    peak  growth     %  allowed")
    for name, m in result["rss"].items():
        if "error" in m:
            lines.append(f"  {name:<{w}} {m['error']}")
            continue
        lines.append(f"  {name:<{w}} {m['start_mib']:7.1f} {m['warm_mib']:7.1f} {m['end_mib']:7.1f} {m['peak_mib']:7.1f} "
                     f"{m['growth_mib']:+7.1f} {m['growth_pct']:+5.1f} {m['allowed_mib']:8.1f}  {'ok' if m['ok'] else 'FAIL'}")
    lines.append(f"  final state: {result['final_state']}; pagoda up exit code {result['stack_exit_code']}")
    lines += [f"  failure: {f}" for f in result["failures"][:10]]
    lines.append(f"soak: {result['verdict'].upper()}" + (f": {'; '.join(result['reasons'])}" if result["reasons"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
