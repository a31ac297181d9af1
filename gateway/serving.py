"""From RequestEvents to OpenAI responses: per-choice text (detokenizer, stop strings), logprobs,
usage, and the two shapes of body (completion, chat), whole or as Server-Sent Events."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from common.protocol import RequestEvent
from gateway.engine_client import REDIS_RESTARTED
from gateway.detokenizer import IncrementalDetokenizer
from gateway.reasoning import ReasoningStream, reasoning_tokens
from gateway.tools import ToolCallStream


SHUTTING_DOWN = "the server is shutting down"


async def wait_for_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def engine_failure(finish_reason: str | None, error: str | None, what: str = "generation") -> EngineError:
    """The error a request's "error" or "abort" ending answers: 503 (retry) when the server drains
    or Redis restarted, else 500."""
    if finish_reason == "abort":
        return EngineError("the request was aborted by the scheduler", code="aborted")
    if error in (SHUTTING_DOWN, REDIS_RESTARTED):
        return EngineError(f"{error}; retry the request", 503, "service_unavailable")
    return EngineError(f"{what} failed: {error or 'unknown error'}")


class EngineError(Exception):
    """A generation that failed after admission (a scheduler's error event, or the deadline)."""

    def __init__(self, message: str, status: int = 500, code: str = "engine_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "server_error", "param": None, "code": self.code}}


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the prompt's first token (echo)
    top: list | None  # [[token_id, logprob], ...], best first; None with logprob
    text_offset: int  # characters of the choice's text (the echoed prompt's included) before this token


@dataclass(slots=True)
class Echo:
    """The prompt a completion choice puts before its text (`echo`): the prompt decoded as the
    choice's own text is, and where each of its tokens starts in that text."""

    token_ids: list[int]
    text: str
    offsets: list[int]

    @staticmethod
    def of(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> Echo:
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        text, offsets = "", []
        for token_id in token_ids:
            offsets.append(len(text))
            text += detokenizer.add(token_id)
        return Echo(token_ids, text + detokenizer.flush(), offsets)

    def entries(self, prompt_logprobs: list | None) -> list[TokenLogprob]:
        """The prompt tokens' logprob entries (RequestEvent.prompt_logprobs; the first token's null)."""
        scored = prompt_logprobs or [None] * len(self.token_ids)
        return [TokenLogprob(t, None, None, offset) if entry is None else TokenLogprob(t, entry[0], entry[2], offset)
                for t, offset, entry in zip(self.token_ids, self.offsets, scored)]


@dataclass(slots=True)
class ChoiceState:
    """One choice (output `output_index` of a prompt's request): its text so far, what has been sent,
    and how it ended. A choice `chosen_at_end` (best_of > n, beam search) gets its output whole,
    in one event, once the scheduler has finished the request.

        text[:sent]          sent to the client
        text[sent:released]  may be sent
        text[released:]      held back: it could be the start of a stop string
    """

    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    hidden_token_ids: frozenset[int]  # eos and stop tokens: counted, never shown
    arrival: float  # time.monotonic() at the gateway
    output_index: int = 0  # the RequestEvent.index this choice takes
    chosen_at_end: bool = False
    text: str = ""
    sent: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    stopped_by_string: bool = False
    stop_string: str | None = None  # the stop string that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0
    num_prompt_tokens: int = 0
    scheduled_at: float | None = None  # time.monotonic() here when the scheduler first scheduled the request
    num_cached_tokens: int = 0  # the request's prompt tokens found in the prefix cache (RequestEvent's)
    first_token_at: float | None = None
    last_token_at: float | None = None
    echo: Echo | None = None  # completions `echo`: the prompt goes first (in the first chunk when streaming)
    echo_sent: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)  # set when prompt logprobs are reported
    prompt_logprobs: list | None = None  # the request's RequestEvent.prompt_logprobs, once it came
    prompt_logprobs_sent: bool = False
    tools: ToolCallStream | None = None  # chat with tools: the output as tool_calls
    reasoning: ReasoningStream | None = None  # chat under --reasoning-parser: the thinking apart from the answer

    @property
    def answer_text(self) -> str:
        """The text that is the answer: all of it, or what follows the thinking (tools parse only this)."""
        return self.text if self.reasoning is None else self.reasoning.split(self.text)[1]

    @property
    def output_text(self) -> str:
        """The choice's text as a whole body gives it: the echoed prompt first."""
        return self.text if self.echo is None else self.echo.text + self.text

    def output_logprobs(self, with_prompt: bool) -> list[TokenLogprob]:
        return self.echo.entries(self.prompt_logprobs) + self.logprobs if with_prompt else self.logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: RequestEvent) -> None:
        for i, token_id in enumerate(event.token_ids):
            if self.finished:
                break  # tokens the scheduler made before it saw our abort
            self.num_tokens += 1
            if event.logprobs is not None and i < len(event.logprobs):
                logprob, top = event.logprobs[i]
                echoed = len(self.echo.text) if self.echo is not None else 0
                self.logprobs.append(TokenLogprob(token_id, logprob, top, echoed + len(self.text)))
            last_of_stop = event.finish_reason == "stop" and i == len(event.token_ids) - 1
            if not (last_of_stop and token_id in self.hidden_token_ids):
                self._append(self.detokenizer.add(token_id))
            if self.reasoning is not None:
                self.reasoning.observe(self.text)
        if event.finish_reason is not None and not self.finished:
            self._append(self.detokenizer.flush())
            if not self.finished:
                self.finish_reason, self.error = event.finish_reason, event.error

    def _append(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - max(map(len, self.stop), default=0) + 1)
        self.text += piece
        hits = [(pos, s) for pos, s in ((self.text.find(s, start), s) for s in self.stop) if pos >= 0]
        if hits:
            pos, self.stop_string = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:pos]
            self.finish_reason, self.stopped_by_string = "stop", True

    def take_delta(self) -> tuple[str, list[TokenLogprob]]:
        """What may be sent now: released text and the logprobs of the tokens since the last take."""
        hold = 0 if self.finished else max(map(len, self.stop), default=1) - 1
        released = max(self.sent, len(self.text) - hold)
        text, self.sent = self.text[self.sent:released], released
        logprobs, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        if self.echo is not None and not self.echo_sent:  # the first chunk: the prompt first
            self.echo_sent = True
            text, logprobs = self.echo.text + text, self.echo.entries(self.prompt_logprobs) + logprobs
        return text, logprobs


# ----------------------------------------------------------------------------- logprobs shapes

def completion_logprobs(entries: list[TokenLogprob], token_text, k: int) -> dict:
    """The legacy completions shape: parallel lists."""
    return {
        "tokens": [token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else {token_text(t): lp for t, lp in e.top[:k]} for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(entries: list[TokenLogprob], token_text, k: int) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:k]]}
                        for e in entries]}


def vllm_prompt_logprobs(prompt_token_ids: list[int], entries: list, token_text, k: int) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt token null (the first) or {"<token id>":
    {"logprob", "rank", "decoded_token"}}: the prompt token's own entry, then the top k."""
    shaped = []
    for token_id, entry in zip(prompt_token_ids, entries):
        if entry is None:
            shaped.append(None)
            continue
        logprob, rank, top = entry
        one = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}}
        for i, (top_id, top_logprob) in enumerate(top[:k]):
            one.setdefault(str(top_id), {"logprob": top_logprob, "rank": i + 1, "decoded_token": token_text(top_id)})
        shaped.append(one)
    return shaped


# ----------------------------------------------------------------------------- bodies

@dataclass(slots=True)
class ResponseShape:
    """What every body and chunk of one response shares."""

    kind: str  # "completion" | "chat"
    id: str
    created: int
    model: str
    logprobs: int | None
    token_text: object  # token_id -> str
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs asked: each choice carries them

    @staticmethod
    def new(kind: str, model: str, logprobs: int | None, token_text, request_uid: str,
            prompt_logprobs: int | None = None) -> ResponseShape:
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        return ResponseShape(kind, prefix + request_uid, int(time.time()), model, logprobs, token_text,
                             prompt_logprobs)

    def choice_prompt_logprobs(self, choice: ChoiceState) -> list | None:
        if choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(choice.prompt_token_ids, choice.prompt_logprobs, self.token_text,
                                    self.prompt_logprobs)

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.logprobs is None:
            return None
        shape = completion_logprobs if self.kind == "completion" else chat_logprobs
        return shape(entries, self.token_text, self.logprobs)

    def body(self, choices: list[ChoiceState], usage: dict) -> dict:
        out = []
        for c in choices:
            entry = {"index": c.index}
            if self.kind == "completion":
                entry["text"] = c.output_text
            else:
                entry["message"] = chat_message(c)
            entry["logprobs"] = self._logprobs(c.output_logprobs(c.echo is not None and self.logprobs is not None))
            entry["finish_reason"] = chat_finish_reason(c) if self.kind == "chat" else c.finish_reason
            if self.prompt_logprobs is not None:
                entry["prompt_logprobs"] = self.choice_prompt_logprobs(c)
            out.append(entry)
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": out,
                "usage": usage}

    def chunk_body(self, choice: dict | None, include_usage: bool, usage: dict | None = None) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice] if choice is not None else []}
        if include_usage:
            body["usage"] = usage
        return body

    def choice_delta(self, index: int, text: str, entries: list[TokenLogprob], finish_reason: str | None,
                     role: bool = False) -> dict:
        if self.kind == "completion":
            return {"index": index, "text": text, "logprobs": self._logprobs(entries) if entries else None,
                    "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(entries) if entries else None,
                "finish_reason": finish_reason}

    def choice_deltas(self, choice: ChoiceState, text: str, entries: list[TokenLogprob]) -> list[dict]:
        """The chunks' choices for what `choice` released (take_delta): one, or none when there is
        nothing to send; with tools or a reasoning parser, a chunk per reasoning, content or
        tool_calls delta (the logprobs and the finish_reason on the last)."""
        if choice.tools is None and choice.reasoning is None:
            if text or entries or choice.finished:
                return [self.choice_delta(choice.index, text, entries, choice.finish_reason)]
            return []
        deltas = message_deltas(choice, text)
        if not deltas and (entries or choice.finished):
            deltas = [{}]
        out = [{"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if out:
            out[-1]["logprobs"] = self._logprobs(entries) if entries else None
            out[-1]["finish_reason"] = chat_finish_reason(choice) if choice.finished else None
        return out


def chat_message(choice: ChoiceState) -> dict:
    """A chat choice's whole message: its answer as content (or tool_calls, with tools) and, under
    a reasoning parser, its thinking as reasoning_content and reasoning (null when there is none;
    content then null when empty)."""
    if choice.reasoning is None:
        return choice.tools.message(choice.text) if choice.tools else {"role": "assistant", "content": choice.text}
    reasoning, answer = choice.reasoning.split(choice.text)
    message = choice.tools.message(answer) if choice.tools else {"role": "assistant", "content": answer}
    message["content"] = message["content"] or None
    return message | {"reasoning_content": reasoning, "reasoning": reasoning}


def chat_finish_reason(choice: ChoiceState) -> str | None:
    """"tool_calls" when the answer holds calls; else the scheduler's reason."""
    return choice.tools.finish_reason(choice.answer_text, choice.finish_reason) if choice.tools else choice.finish_reason


def message_deltas(choice: ChoiceState, text: str) -> list[dict]:
    """The chat deltas for `text`, what `choice` released: its thinking as a reasoning delta, then
    its answer as content, or tool_calls with tools."""
    deltas = []
    if choice.reasoning is not None:
        thought, text = choice.reasoning.feed(text, choice.finished)
        if thought:
            deltas.append({"reasoning_content": thought, "reasoning": thought})
    if choice.tools is not None:
        return deltas + choice.tools.feed(text, choice.finished)
    return deltas + ([{"content": text}] if text else [])


def usage(prompts: list[list[int]], choices: list[ChoiceState]) -> dict:
    """OpenAI's usage; cached_tokens counts each request's prompt once, however many choices it has."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_tokens for c in choices)
    cached_tokens = sum({c.request_id: c.num_cached_tokens for c in choices}.values())
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    details = reasoning_tokens([(c.reasoning, c.text) for c in choices])
    return body if details is None else body | {"completion_tokens_details": details}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
