"""OpenAI request bodies to validated, tokenized requests; the OpenAI error object and its response.

Everything here runs before the first byte of a response, so every mistake in a request becomes
a 4xx with `{"error": {"message", "type", "param", "code"}}`. Each field's type and bounds are
gateway/models.py's; what lies between fields is checked here. Unknown fields are ignored.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from common.protocol import MAX_BEAM_WIDTH, MAX_SAMPLES, SamplingParams
from gateway.media import MediaError
from gateway.models import ChatCompletionRequest, CompletionRequest, InvalidField, Request, SamplingRequest, validate
from gateway.reasoning import ReasoningParser
from gateway.structured import requested_structured_output
from gateway.tools import ToolCalling, ToolParser, chat_messages, has_images, renders_tool_calls, tool_calling

RETRY_AFTER_UNAVAILABLE_S = 5


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


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)})


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[list[int]]  # token ids, one list per prompt
    # n, and best_of or beam_width when `chosen_at_end` (each prompt is one request whose n
    # outputs are its choices); max_tokens None here means "the rest of the context"
    params: SamplingParams
    n: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives to report per token; None: no logprobs
    skip_special_tokens: bool = True
    user: str | None = None
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' entries) first
    prompt_logprobs: int | None = None  # vLLM's: each choice carries the prompt's logprobs, this many alternatives
    # the request field that asked for params.structured_output (a 400 about it names this field)
    structured_param: str | None = None
    tool_parser: ToolParser | None = None  # chat with tools: how each choice's output becomes tool_calls
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1
    reasoning_parser: ReasoningParser | None = None  # chat under --reasoning-parser: each choice's thinking apart
    thinking: bool = False  # the output starts in reasoning (the prompt did not turn thinking off)
    # skip_special_tokens, but a reasoning parser's special tags kept: the ids decoding leaves out
    skipped_token_ids: frozenset[int] | None = None
    mm_items: list = field(default_factory=list)  # chat: its prompt's images (common/protocol.MultiModalItem)

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


# ----------------------------------------------------------------------------- the two endpoints

def parse_completion(body: dict, encoder, vocab_size: int, defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """`defaults`: the model's sampling defaults (Gateway.default_sampling_params) for the fields
    the request leaves unset."""
    request = _validate(CompletionRequest, body, vocab_size)
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [encoder.encode_text(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [encoder.encode_text(p) for p in prompt]
    else:
        prompts = [list(prompt)] if isinstance(prompt[0], int) else [list(p) for p in prompt]
    if any(not p for p in prompts):
        raise bad_request("prompt must not be empty (it tokenizes to no tokens)", "prompt")
    max_tokens = _default(_max_tokens(request), 16)
    parsed = _common(request, "completion", prompts, max_tokens, request.logprobs, defaults)
    parsed.echo = bool(request.echo)
    if parsed.echo and parsed.logprobs is not None:  # the prompt tokens' entries come from prompt logprobs
        parsed.params.prompt_logprobs = max(parsed.params.prompt_logprobs or 0, parsed.logprobs)
    return parsed


def parse_chat(body: dict, encoder, vocab_size: int, defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """`defaults`: as parse_completion's."""
    request = _validate(ChatCompletionRequest, body, vocab_size)
    try:
        calling = tool_calling(request, encoder.tool_call_format)
        messages = chat_messages(request.messages, renders_tool_calls(encoder.template_text))
    except InvalidField as exc:
        raise bad_request(str(exc), exc.param) from None
    mm_items = []
    try:
        if has_images(messages):
            prompt, mm_items = _encode_chat_with_images(messages, calling.tools, request, encoder)
        else:
            prompt = encoder.encode_chat(messages, calling.tools, request.chat_template_kwargs)
    except APIError:
        raise
    except Exception as exc:  # a template that rejects the conversation (roles out of order, ...)
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
    if not prompt:
        raise bad_request("messages render to an empty prompt", "messages")
    logprobs = None
    if request.logprobs:
        logprobs = request.top_logprobs or 0
    elif request.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    parsed = _common(request, "chat", [prompt], _max_tokens(request), logprobs, defaults)
    parsed.mm_items = mm_items
    if mm_items and parsed.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot score a prompt with images", "prompt_logprobs")
    return _with_reasoning(_with_tool_calling(parsed, calling, encoder), request, encoder)


def _encode_chat_with_images(messages: list[dict], tools: list[dict] | None, request: ChatCompletionRequest,
                             encoder) -> tuple[list[int], list]:
    """The prompt and its images (gateway/multimodal.py); a 400 for a model that takes none, an
    image outside a user message, or one that cannot be used."""
    if encoder.images is None:
        raise bad_request("this model does not take images", "messages", "model_not_multimodal")
    if any(isinstance(m["content"], list) and m["role"] != "user" for m in messages):
        raise bad_request("only user messages may hold images", "messages")
    try:
        return encoder.images.encode_chat(messages, tools, encoder.chat_template,
                                          encoder.template_variables(request.chat_template_kwargs))
    except MediaError as exc:
        raise bad_request(str(exc), "messages", "invalid_image") from None


def _with_reasoning(parsed: ParsedRequest, request: ChatCompletionRequest, encoder) -> ParsedRequest:
    """Under --reasoning-parser: whether the output starts in thinking (the prompt's end and the
    template's kwargs say), and if so, the parser's tags kept in the text even when they are special
    tokens (thinking off, the output is decoded as without a parser)."""
    parser = encoder.reasoning_parser
    if parser is None:
        if request.thinking_token_budget is not None:
            raise bad_request("thinking_token_budget needs a reasoning parser (the server's --reasoning-parser)",
                              "thinking_token_budget")
        return parsed
    kwargs = {**encoder.chat_template_kwargs, **(request.chat_template_kwargs or {})}
    parsed.reasoning_parser = parser
    parsed.thinking = parser.thinking(encoder.prompt_tail(parsed.prompts[0]), kwargs)
    if parsed.thinking and parsed.skip_special_tokens:
        parsed.skipped_token_ids = encoder.skipped_ids_keeping(parser.tags)
    if parsed.thinking and (request.thinking_token_budget is not None or parsed.params.structured_output):
        end = encoder.tokenizer.encode(parser.end, add_special_tokens=False)
        _gate_on_the_thinking(parsed.params, end, request.thinking_token_budget)
    return parsed


def _gate_on_the_thinking(params: SamplingParams, end_token_ids: list[int], budget: int | None) -> None:
    """The worker lets the model think freely until these tokens, then applies the grammar; with a
    budget it forces them once the thinking holds that many tokens (worker/reasoning_gate.py)."""
    if params.beam_width:
        raise bad_request("thinking_token_budget does not apply to beam search", "thinking_token_budget")
    params.reasoning_end_token_ids = end_token_ids
    params.thinking_token_budget = budget


def _with_tool_calling(parsed: ParsedRequest, calling: ToolCalling, encoder) -> ParsedRequest:
    """tool_choice "required" or a named function: the call's grammar is the request's structured
    output (tool_calling refused any other beside it). Tags that the tokenizer marks special stay
    in the text, for the parser to see (vLLM's rule)."""
    if calling.structured_output is not None:
        parsed.params.structured_output, parsed.structured_param = calling.structured_output, "tools"
    if calling.parser is not None and any(encoder.is_special_token(tag) for tag in calling.parser.tags):
        parsed.skip_special_tokens = False
    parsed.tool_parser, parsed.max_tool_calls = calling.parser, calling.max_calls
    return parsed


def _validate(model: type[Request], body: dict, vocab_size: int) -> Request:
    try:
        return validate(model, body, vocab_size)
    except InvalidField as exc:
        raise bad_request(str(exc), exc.param) from None


def _default(value, default):
    return default if value is None else value


def _max_tokens(request: SamplingRequest) -> int | None:
    """max_completion_tokens takes precedence (both are validated)."""
    return _default(request.max_completion_tokens, request.max_tokens)


def _common(
    request: SamplingRequest, kind: str, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None,
    defaults: Mapping[str, Any] | None,
) -> ParsedRequest:
    """The rules between fields, and the sampling params the scheduler gets: a field the request
    leaves unset is the model's default (`defaults`), else the API's; beam search is deterministic
    and takes none of the model's."""
    n = _default(request.n, 1)
    width, width_param = _width(request, n, len(prompts))
    beam_search = bool(request.use_beam_search)
    length_penalty = _default(request.length_penalty, 1.0)
    early_stopping = _default(request.early_stopping, False)
    _check_beam_fields(beam_search, width, width_param, length_penalty, early_stopping)
    chosen_at_end = beam_search or width > n
    structured = _structured_output(request, beam_search)
    stream = bool(request.stream)
    _check_stream(request, stream, beam_search, chosen_at_end)
    min_tokens = _min_tokens(request, kind, max_tokens)
    model = defaults if defaults and not beam_search else {}
    params = SamplingParams(
        n=n,
        best_of=width if chosen_at_end and not beam_search else None,
        beam_width=width if beam_search else 0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        temperature=_default(request.temperature, model.get("temperature", 0.0 if beam_search else 1.0)),
        top_p=_default(request.top_p, model.get("top_p", 1.0)),
        top_k=_default(request.top_k, model.get("top_k", 0)),
        min_p=_default(request.min_p, model.get("min_p", 0.0)),
        seed=request.seed,
        presence_penalty=_default(request.presence_penalty, 0.0),
        frequency_penalty=_default(request.frequency_penalty, 0.0),
        repetition_penalty=_default(request.repetition_penalty, model.get("repetition_penalty", 1.0)),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs,
        logit_bias=request.logit_bias or [],
        prompt_logprobs=request.prompt_logprobs,
        structured_output=None if structured is None else structured[1],
    )
    if beam_search:
        _check_beam_search(params)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    return ParsedRequest(
        kind=kind, model=request.model, prompts=prompts, params=params, n=n, stop=list(dict.fromkeys(stop)),
        stream=stream, include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=logprobs, skip_special_tokens=_default(request.skip_special_tokens, True), user=request.user,
        prompt_logprobs=request.prompt_logprobs,
        structured_param=None if structured is None else structured[0],
    )


def _width(request: SamplingRequest, n: int, num_prompts: int) -> tuple[int, str]:
    """(samples per prompt, or beams, and the field that sets it): vLLM's rule, best_of, else n."""
    best_of = request.best_of
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of must be >= n, got best_of={best_of}, n={n}", "best_of")
    width = best_of or n
    width_param = "n" if best_of is None else "best_of"
    if num_prompts * width > MAX_SAMPLES:
        raise bad_request(
            f"{width_param} times the number of prompts must be <= {MAX_SAMPLES}, got {num_prompts * width}",
            width_param)
    return width, width_param


def _check_beam_fields(beam_search: bool, width: int, width_param: str, length_penalty: float,
                       early_stopping: bool | str) -> None:
    """Beam search's width within its limit; its own fields only with it."""
    if beam_search:
        if width > MAX_BEAM_WIDTH:
            raise bad_request(f"beam search runs at most {MAX_BEAM_WIDTH} beams: the beam width ({width_param}) must "
                              f"be <= {MAX_BEAM_WIDTH}, got {width}", width_param)
    else:
        if length_penalty != 1.0:
            raise bad_request("length_penalty applies only to beam search (use_beam_search: true)", "length_penalty")
        if early_stopping is not False:
            raise bad_request("early_stopping applies only to beam search (use_beam_search: true)", "early_stopping")


def _structured_output(request: SamplingRequest, beam_search: bool):
    """The request's (field, structured output), or None; a 400 if it is malformed or asked with beam search."""
    try:
        structured = requested_structured_output(request)
    except InvalidField as exc:
        raise bad_request(str(exc), exc.param) from None
    if structured is not None and beam_search:
        raise bad_request(f"{structured[0]} is not supported with use_beam_search (beam search ranks beams by the "
                          "model's own logprobs)", structured[0])
    return structured


def _check_stream(request: SamplingRequest, stream: bool, beam_search: bool, chosen_at_end: bool) -> None:
    """stream_options only with stream; no stream when the outputs are chosen only at the end."""
    if request.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if stream and chosen_at_end:
        what = "use_beam_search" if beam_search else "best_of > n"
        raise bad_request(f"stream is not supported with {what}: the outputs are chosen only when the request ends",
                          "stream")


def _min_tokens(request: SamplingRequest, kind: str, max_tokens: int | None) -> int:
    """min_tokens (default 0), checked with max_tokens: 0 tokens only to score a completion's prompt."""
    if max_tokens == 0 and (kind == "chat" or not (request.echo or request.prompt_logprobs is not None)):
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        raise bad_request(f"{param} must be >= 1; 0 (score the prompt, generate nothing) is allowed only on "
                          "completions, with echo or prompt_logprobs", param)
    min_tokens = _default(request.min_tokens, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}",
                          "min_tokens")
    return min_tokens


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
        ("logit_bias", bool(params.logit_bias)),  # the beams are ranked by the raw logprobs
    ]
    for name, given in unsupported:
        if given:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
