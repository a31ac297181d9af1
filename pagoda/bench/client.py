"""The benches' one client of the OpenAI-compatible API: a completion or chat request streamed as
server-sent events and read into a `Stream` (its status, each choice's text, when each chunk that
carried text came, the usage, the error event), and a batch of them sent at given times or a few
at a time.

    streams, seconds = asyncio.run(stream_all(url + "/v1/completions", bodies, times))
    streams[0].ttft, streams[0].itl, streams[0].output_len, streams[0].failure
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field

REQUEST_TIMEOUT_S = 3600.0
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}  # a body's keys: streamed, with usage


def choice_text(choice: dict) -> str:
    """The text of a whole response's choice or of a stream chunk's choice, either API."""
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


@dataclass
class Stream:
    """What a client has seen of one streamed response so far (it may be cancelled at any point)."""

    headers: bool = False  # the response's headers arrived
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # a non-200's body
    events: int = 0  # data chunks, [DONE] excluded
    done: bool = False  # saw data: [DONE]
    texts: dict[int, str] = field(default_factory=lambda: collections.defaultdict(str))  # by choice index
    finish: dict[int, str] = field(default_factory=dict)  # finish_reason by choice index
    usage: dict | None = None
    error: dict | None = None  # the error event's object
    after_error: int = 0  # data chunks after the error event: none is right
    times: list[float] = field(default_factory=list)  # seconds from the request to each chunk carrying text
    e2e: float | None = None  # seconds from the request to the end of the stream (None: not read to its end)
    exception: str | None = None  # what the transport raised (`send` keeps it)

    def read(self, chunk: dict, elapsed: float) -> None:
        """One `data:` chunk of a completions or chat stream, `elapsed` seconds after the request. A
        chunk carries text when a choice has text, content or reasoning content (a chat's role
        chunk does not)."""
        self.events += 1
        if self.error is not None:
            self.after_error += 1
        if "error" in chunk:
            self.error = chunk["error"]
        carried = False
        for choice in chunk.get("choices") or ():
            text = choice_text(choice)
            self.texts[choice.get("index", 0)] += text
            carried = carried or bool(text or (choice.get("delta") or {}).get("reasoning_content"))
            if choice.get("finish_reason"):
                self.finish[choice.get("index", 0)] = choice["finish_reason"]
        if carried:
            self.times.append(elapsed)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def finish_reason(self) -> str | None:
        return self.finish.get(0)

    @property
    def output_len(self) -> int:
        """Completion tokens, from the usage chunk."""
        return self.usage["completion_tokens"] if self.usage else 0

    @property
    def prompt_len(self) -> int:
        return self.usage.get("prompt_tokens", 0) if self.usage else 0

    @property
    def ttft(self) -> float | None:
        """Seconds to the first chunk that carried text; for a stream without one, to its end."""
        return self.times[0] if self.times else self.e2e

    @property
    def itl(self) -> list[float]:
        """The gaps between the chunks that carried text."""
        return [b - a for a, b in zip(self.times, self.times[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): undefined for fewer than two tokens."""
        if self.e2e is None or self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def failure(self) -> str | None:
        """Why the request failed: the transport's exception, a status other than 200 or an error
        event; None when it did not."""
        if self.exception is not None:
            return self.exception
        if self.status != 200:
            return f"HTTP {self.status}: {self.body[:200]!r}"
        return None if self.error is None else str(self.error)


async def read_stream(client, url: str, body: dict, stream: Stream, stop_after: int | None = None) -> Stream:
    """POST `body` with `client` (httpx) and read the response into `stream`; close it after
    `stop_after` data chunks unless an error event came ([DONE] must follow one). What the
    transport raises, it raises."""
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        stream.headers, stream.status, stream.response_headers = True, response.status_code, dict(response.headers)
        if response.status_code != 200:
            stream.body = await response.aread()
            return stream
        if stop_after == 0:
            return stream
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                stream.done = True
                break
            if line.startswith("data: "):
                stream.read(json.loads(line[6:]), time.perf_counter() - start)
                if stop_after is not None and stream.events >= stop_after and stream.error is None:
                    return stream
    stream.e2e = time.perf_counter() - start
    return stream


async def send(client, url: str, body: dict) -> Stream:
    """One streamed request; what the transport raises is kept in the stream (a benchmark reports
    failures, it does not stop on them)."""
    stream = Stream()
    try:
        await read_stream(client, url, body, stream)
    except Exception as exc:
        stream.exception = f"{type(exc).__name__}: {exc}"
    return stream


def http_client(connections: int, timeout: float = REQUEST_TIMEOUT_S):
    """An httpx.AsyncClient for `connections` requests at once (and one more), httpx's log quiet
    (not a line per request)."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    limits = httpx.Limits(max_connections=connections + 1, max_keepalive_connections=connections + 1)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits)


async def stream_all(url: str, bodies: list[dict], times: list[float] | None = None, concurrency: int | None = None,
                     timeout: float = REQUEST_TIMEOUT_S) -> tuple[list[Stream], float]:
    """Each of `bodies` POSTed to `url` and streamed: body i at times[i] seconds after the start
    (default: all at once), at most `concurrency` in flight (default: all), in order; the streams
    and the seconds until the last one ended."""
    slots = asyncio.Semaphore(concurrency or len(bodies))
    async with http_client(concurrency or len(bodies), timeout) as client:
        start = time.perf_counter()

        async def one(at: float, body: dict) -> Stream:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                return await send(client, url, body)

        streams = await asyncio.gather(*(one(at, body) for at, body in zip(times or [0.0] * len(bodies), bodies)))
        return list(streams), time.perf_counter() - start
