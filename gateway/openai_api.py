"""OpenAI request bodies to validated, tokenized requests; the OpenAI error object.

Everything here runs before the first byte of a response, so every mistake in a request becomes
a 4xx with `{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from common.protocol import MAX_BEAM_WIDTH, InvalidParamError, SamplingParams

MAX_N = 128  # sequences per request: n (or best_of, or the beam width) times the number of prompts
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_TOP_LOGPROBS = 20  # chat's limit
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[list[int]]  # token ids, one list per prompt
    # n=1 (each choice is its own request), or, when `chosen_at_end`, n, best_of or beam_width
    # (each prompt is one request whose n outputs are its choices); max_tokens None here means
    # "the rest of the context"
    params: SamplingParams
    n: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives to report per token; None: no logprobs
    skip_special_tokens: bool = True
    user: str | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def chosen_at_end(self) -> bool:
        """best_of > n or beam search: the scheduler picks the n outputs when the request ends."""
        return self.params.beam_width > 0 or self.params.best_of is not None


def parse_json(raw: bytes) -> dict:
    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:  # e.g. 100,000 nested '['
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


# ----------------------------------------------------------------------------- typed getters

def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {json.dumps(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number, got {json.dumps(value)[:64]}", name)
    return number


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = 2**63 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {json.dumps(value)}", name)
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {bounds}, got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {json.dumps(value)}", name)
    return value


def _token_ids(value, name: str, vocab_size: int) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{name} must be a list of token ids (integers)", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{name} has token id {bad[0]}, outside the vocabulary [0, {vocab_size})", name)
    return list(value)


# ----------------------------------------------------------------------------- the two endpoints

def parse_completion(body: dict, encoder, vocab_size: int) -> ParsedRequest:
    _reject_unsupported(body, ("echo", "suffix", "logit_bias"))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [encoder.encode_text(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [encoder.encode_text(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [_token_ids(prompt, "prompt", vocab_size)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, "prompt", vocab_size) for p in prompt]
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            "prompt")
    if any(not p for p in prompts):
        raise bad_request("prompt must not be empty (it tokenizes to no tokens)", "prompt")
    logprobs = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    max_tokens = _max_tokens(body, default=16)
    return _common(body, "completion", prompts, max_tokens, logprobs, vocab_size)


def parse_chat(body: dict, encoder, vocab_size: int) -> ParsedRequest:
    _reject_unsupported(body, ("logit_bias", "tools", "functions"))
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad_request("response_format other than {\"type\": \"text\"} is not supported yet", "response_format")
    messages = _messages(body.get("messages"))
    try:
        prompt = encoder.encode_chat(messages)
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
    if not prompt:
        raise bad_request("messages render to an empty prompt", "messages")
    logprobs = None
    top_logprobs = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if _bool(body, "logprobs", False):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens = _max_tokens(body, default=None)
    return _common(body, "chat", [prompt], max_tokens, logprobs, vocab_size)


def _max_tokens(body: dict, default: int | None) -> int | None:
    max_tokens = _int(body, "max_tokens", default, 1)  # checked even when max_completion_tokens overrides it
    if body.get("max_completion_tokens") is not None:
        return _int(body, "max_completion_tokens", None, 1)
    return max_tokens


def _reject_unsupported(body: dict, names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name):  # absent, null, false, "" and {} are all fine
            raise bad_request(f"{name} is not supported yet", name)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}] must be an object whose role is one of {sorted(CHAT_ROLES)}", f"messages[{i}].role")
        role, content = m["role"], m.get("content")
        if content is None and role == "assistant":
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                        "other part types are not supported", f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return list(dict.fromkeys(stop))


def _common(
    body: dict, kind: str, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, vocab_size: int,
) -> ParsedRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of must be >= n, got best_of={best_of}, n={n}", "best_of")
    beam_search = _bool(body, "use_beam_search", False)
    width = best_of or n  # samples per prompt, or beams (vLLM's rule: best_of, else n)
    width_param = "n" if best_of is None else "best_of"
    if len(prompts) * width > MAX_N:
        raise bad_request(
            f"{width_param} times the number of prompts must be <= {MAX_N}, got {len(prompts) * width}", width_param)
    length_penalty = _number(body, "length_penalty", 1.0)
    early_stopping = body.get("early_stopping", False)
    if early_stopping is None:
        early_stopping = False
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise bad_request(f"early_stopping must be true, false or \"never\", got {json.dumps(early_stopping)}",
                          "early_stopping")
    if beam_search:
        if width > MAX_BEAM_WIDTH:
            raise bad_request(f"beam search runs at most {MAX_BEAM_WIDTH} beams: the beam width ({width_param}) must "
                              f"be <= {MAX_BEAM_WIDTH}, got {width}", width_param)
    else:
        if length_penalty != 1.0:
            raise bad_request("length_penalty applies only to beam search (use_beam_search: true)", "length_penalty")
        if early_stopping is not False:
            raise bad_request("early_stopping applies only to beam search (use_beam_search: true)", "early_stopping")
    chosen_at_end = beam_search or width > n
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(stream_options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False)
    if stream and chosen_at_end:
        what = "use_beam_search" if beam_search else "best_of > n"
        raise bad_request(f"stream is not supported with {what}: the outputs are chosen only when the request ends",
                          "stream")
    temperature = _number(body, "temperature", 0.0 if beam_search else 1.0)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = []
    if not isinstance(stop_token_ids, list) or len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1 - MAX_N)
    try:
        params = SamplingParams(
            n=n if chosen_at_end else 1,
            best_of=width if chosen_at_end and not beam_search else None,
            beam_width=width if beam_search else 0,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            temperature=temperature,
            top_p=_number(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0),
            min_p=_number(body, "min_p", 0.0),
            seed=seed,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=_int(body, "min_tokens", 0),
            stop_token_ids=_token_ids(stop_token_ids, "stop_token_ids", vocab_size),
            ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs,
        )
    except InvalidParamError as exc:
        param = "max_completion_tokens" if exc.param == "max_tokens" and "max_completion_tokens" in body else exc.param
        if exc.param == "logprobs" and kind == "chat":
            param = "top_logprobs"
        raise bad_request(str(exc), param) from exc
    if beam_search:
        _check_beam_search(params)
    return ParsedRequest(
        kind=kind, model=model, prompts=prompts, params=params, n=n, stop=_stop(body), stream=stream,
        include_usage=include_usage, logprobs=logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True), user=user,
    )


def _check_beam_search(params: SamplingParams) -> None:
    """Beam search is deterministic and ranks beams by the model's own logprobs: what would change
    the draw (vLLM's rule: temperature 0, top_p 1, top_k off) or what the beams do not honour is a 400."""
    if params.temperature != 0.0:
        raise bad_request("temperature must be 0 with use_beam_search (beam search is deterministic); "
                          "leave it out or set it to 0", "temperature")
    if params.top_p != 1.0:
        raise bad_request("top_p must be 1 with use_beam_search", "top_p")
    if params.top_k not in (0, -1):
        raise bad_request("top_k must be off (0 or -1) with use_beam_search", "top_k")
    unsupported = [
        ("min_p", params.min_p != 0.0), ("presence_penalty", params.presence_penalty != 0.0),
        ("frequency_penalty", params.frequency_penalty != 0.0),
        ("repetition_penalty", params.repetition_penalty != 1.0),
        ("min_tokens", params.min_tokens != 0), ("stop_token_ids", bool(params.stop_token_ids)),
        ("ignore_eos", params.ignore_eos), ("logprobs", params.logprobs is not None),
    ]
    for name, given in unsupported:
        if given:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
