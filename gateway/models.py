"""The request bodies of the two generation endpoints as typed models: the one declaration of each
field's type and bounds. Validation (`validate`, whose errors become the 400 error objects, worded
from the same declarations) and the request schemas of GET /openapi.json (gateway/openapi.py,
with pydantic's `models_json_schema`) both come from these classes.

What one field's type cannot say (best_of below n, beam search options without use_beam_search,
top_logprobs without logprobs, a prompt that does not fit the context, ...) is checked in
gateway/openai_api.py after the model has validated. Fields not declared are ignored.
"""
from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from common.protocol import (
    MAX_BEAM_WIDTH, MAX_INT_PARAM, MAX_LENGTH_PENALTY, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS, MAX_PENALTY,
    MAX_SAMPLES,
)

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_TOOLS = 128  # OpenAI's limit
MAX_CHOICES = 256  # guided_choice entries
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema's JSON text, a regex or a grammar
SEED_MAX = 2**63 - 1  # the samples of a seeded request use sample_seed(seed, i) (common/protocol.py)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# where an unset sampling field's default comes from first (vLLM's --generation-config auto)
MODEL_DEFAULT = "the model's generation_config.json value (unless the gateway runs with --generation-config vllm)"
# Per gateway: GET /openapi.json replaces these markers with the served model's id and vocabulary
SERVED_MODEL = "x-served-model"
TOKEN_ID = "x-token-id"

# What a field of several shapes may be, for the message when a value has none of them
SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "input": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "text_1": "a string or a list of strings",
    "text_2": "a string or a list of strings",
    "stop": "a string or a list of strings",
    "early_stopping": 'true, false or "never"',
    "content": 'a string or a list of {"type": "text", "text": ...} parts (other part types are not supported)',
}


def _whole_number(value: Any) -> Any:
    """2.0 is the integer 2 (as JSON Schema's "integer" has it); 2.5 stays a float and fails."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _in_vocabulary(token_id: int, info: ValidationInfo) -> int:
    vocab_size = (info.context or {}).get("vocab_size", 2**31)
    if not 0 <= token_id < vocab_size:
        raise PydanticCustomError("token_id", "has token id {token_id}, outside the vocabulary [0, {vocab_size})",
                                  {"token_id": token_id, "vocab_size": vocab_size})
    return token_id


def _logit_bias(bias: dict[str, float], info: ValidationInfo) -> list[list]:
    """{"token id": bias} -> [[token_id, bias], ...], checked as OpenAI checks it."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("logit_bias", "may hold at most {limit} entries, got {n}",
                                  {"limit": MAX_LOGIT_BIAS, "n": len(bias)})
    vocab_size = (info.context or {}).get("vocab_size", 2**31)
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise PydanticCustomError("logit_bias", "has key {key}, which is not a token id in [0, {vocab_size})",
                                      {"key": json.dumps(key), "vocab_size": vocab_size})
        if key != str(int(key)):  # "01" and "1" would both bias token 1 (and add up)
            raise PydanticCustomError("logit_bias", "has key {key}: write a token id without leading zeros",
                                      {"key": json.dumps(key)})
        if not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
            raise PydanticCustomError("logit_bias", "has bias {value} for token {key}, outside [-{limit}, {limit}]",
                                      {"value": value, "key": key, "limit": int(MAX_LOGIT_BIAS_VALUE)})
        out.append([int(key), float(value)])
    return out


def _unsupported(value: Any) -> Any:
    if value:  # absent, null, false, 0, "", [] and {} are all fine
        raise PydanticCustomError("unsupported", "is not supported yet")
    return value


T = TypeVar("T")
TokenId = Annotated[int, AfterValidator(_in_vocabulary),
                    WithJsonSchema({"type": "integer", "minimum": 0, TOKEN_ID: True})]
NonEmpty = Annotated[T, Field(min_length=1)]
TokenIds = NonEmpty[list[TokenId]]
Text = NonEmpty[str]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
LogitBias = Annotated[dict[str, float], AfterValidator(_logit_bias), WithJsonSchema({
    "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS_VALUE, "maximum": MAX_LOGIT_BIAS_VALUE},
    "description": f"Token id (as a string) to a bias in [-100, 100] added to its logit before sampling; at most "
                   f"{MAX_LOGIT_BIAS} entries. -100 bans a token, 100 all but forces it."})]
GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Unsupported = Annotated[Any, AfterValidator(_unsupported), WithJsonSchema({
    "enum": [None, False, 0, "", [], {}], "description": "Not supported: only a value that means 'off'."})]


def optional(kind: Any, description: str, **bounds) -> Any:
    """An optional field: null, or leaving it out, means its default."""
    if bounds:  # on the type itself, so that JSON Schema says minimum and maximum
        kind = Annotated[kind, Field(**bounds)]
    if kind is int or bounds and kind.__origin__ is int:
        kind = Annotated[kind, BeforeValidator(_whole_number)]
    return Annotated[kind | None, Field(None, description=description)]


class Strict(BaseModel):
    """JSON types as they are: no "1" for 1, no 1 for true (a whole float is an integer: `optional`)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size


class ImagePart(Strict):
    """An image (docs/vision.md): a data: URL, an http(s) URL, or a file: URL under --allowed-local-media-path."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(Strict):
    """A message needs a content, except that an assistant message may leave it out or null.
    developer is treated as system."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"properties": {"role": {"const": "assistant"}}},
    ]})

    role: Literal[CHAT_ROLES]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = Field(
        None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (then content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: str | list[TextPart | ImagePart] | None, info: ValidationInfo):
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "is required")
        return content


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Strict):
    """response_format's json_schema: the output is JSON that validates against `schema` (required)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema; a schema the grammar "
                                                                            "library rejects is a 400.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(Strict):
    """The fields both generation endpoints take."""

    model: Annotated[str | None, WithJsonSchema({SERVED_MODEL: True})] = Field(
        None, description="The served model's id (GET /v1/models); another is a 404.")
    max_tokens: optional(int, "Tokens to generate at most. Default: 16 for completions, the rest of the context for "
                              "chat. The prompt plus max_tokens must fit the model's context length, else 400 "
                              "(code context_length_exceeded). 0 only on completions with echo or "
                              "prompt_logprobs: score the prompt, generate nothing.", ge=0, le=MAX_INT_PARAM)
    max_completion_tokens: optional(int, "Same as max_tokens, and takes precedence.", ge=0, le=MAX_INT_PARAM)
    temperature: optional(float, f"Default: {MODEL_DEFAULT}, else 1 (0 with use_beam_search, which allows only 0); "
                                 "0 is greedy.", ge=0)
    top_p: optional(float, f"Default: {MODEL_DEFAULT}, else 1.", gt=0, le=1)
    top_k: optional(int, f"Default: {MODEL_DEFAULT}, else 0; 0 and -1 are off.", ge=-1, le=MAX_INT_PARAM)
    min_p: optional(float, f"Default: {MODEL_DEFAULT}, else 0.", ge=0, le=1)
    n: optional(int, f"Choices per prompt, default 1. n (or best_of) times the number of prompts must be <= "
                     f"{MAX_SAMPLES}; with use_beam_search, <= {MAX_BEAM_WIDTH}.", ge=1, le=MAX_SAMPLES)
    best_of: optional(int, "Sample best_of outputs per prompt and return the n of highest cumulative logprob; >= n. "
                           "best_of > n cannot stream.", ge=1, le=MAX_SAMPLES)
    use_beam_search: optional(bool, "Beam search with best_of beams (else n); cannot stream; needs temperature 0, "
                                    "top_p 1, top_k off, and no logprobs, min_p, penalties, min_tokens, "
                                    "stop_token_ids or ignore_eos.")
    length_penalty: optional(float, "Beam score = sum of logprobs / length ** length_penalty. Default 1; other "
                                    "values only with use_beam_search.", ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: optional(bool | Literal["never"], "Beam search stopping rule (transformers'); default false; "
                                                      "other values only with use_beam_search.")
    stop: optional(StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)],
                   "Strings that end a choice; they are not part of its text.")
    stop_token_ids: optional(list[TokenId], "Token ids that end a choice.", max_length=MAX_STOP_TOKEN_IDS)
    seed: optional(int, "Makes sampling reproducible.", ge=-(2**63), le=SEED_MAX)
    presence_penalty: optional(float, "Default 0.", ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: optional(float, "Default 0.", ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: optional(float, f"Default: {MODEL_DEFAULT}, else 1 (off).", gt=0)
    min_tokens: optional(int, "EOS and stop_token_ids cannot end a choice before this many tokens; <= max_tokens.",
                         ge=0, le=MAX_INT_PARAM)
    ignore_eos: optional(bool, "Keep generating after EOS. Default false.")
    skip_special_tokens: optional(bool, "Leave special tokens out of the text. Default true.")
    stream: optional(bool, "Answer with Server-Sent Events (text/event-stream).")
    stream_options: optional(StreamOptions, "Only with stream: true. include_usage adds a last chunk with the usage.")
    user: optional(str, "Ignored; accepted for compatibility.")
    logit_bias: optional(LogitBias, "Token id to a bias in [-100, 100] added to its logit; at most 300 entries.")
    prompt_logprobs: optional(int, "vLLM's: each prompt token's logprob, rank and this many alternatives "
                                   "(the first token has none). The prompt is then not served from the prefix "
                                   "cache.", ge=0, le=MAX_LOGPROBS)
    guided_json: optional(dict[str, Any] | GrammarText, "vLLM's: the output is JSON that validates against this "
                                                       "JSON schema (an object, or its JSON text).")
    guided_regex: optional(GrammarText, "vLLM's: the output matches this regular expression.")
    guided_choice: optional(Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)],
                            "vLLM's: the output is exactly one of these strings.")
    guided_grammar: optional(GrammarText, "vLLM's: the output follows this EBNF grammar (xgrammar's dialect).")


class CompletionRequest(SamplingRequest):
    """suffix is not supported: a 400 unless absent, null or empty."""

    prompt: Text | NonEmpty[list[Text]] | TokenIds | NonEmpty[list[TokenIds]] = Field(
        description="Text, texts, token ids, or lists of token ids; each must be at least one token.")
    logprobs: optional(int, "Return the logprob of each token and of this many alternatives; with echo, the "
                            "prompt's tokens' too (the first one's null).", ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: optional(bool, "Put the prompt before each choice's text (and, with logprobs, its tokens' logprobs "
                         "first). With max_tokens 0: score the prompt, generate nothing.")
    suffix: Unsupported = None


class ChatCompletionRequest(SamplingRequest):
    """functions (the legacy form of tools) is not supported: a 400 unless absent, null or empty.
    The messages are rendered with the model's chat template (with the tools, where it takes them)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: optional(bool, "Return the logprob of each token.")
    top_logprobs: optional(int, "Alternatives per token; needs logprobs.", ge=0, le=MAX_LOGPROBS)
    response_format: optional(ResponseFormat, '{"type": "text"} (the default), {"type": "json_object"} (the '
                                              'output is a JSON object) or {"type": "json_schema", "json_schema": '
                                              '{"name": ..., "schema": {...}}} (the output validates against it).')
    tools: optional(Annotated[list[Tool], Field(max_length=MAX_TOOLS)],
                    f"Functions the model may call (at most {MAX_TOOLS}).")
    tool_choice: optional(Literal["none", "auto", "required"] | NamedToolChoice,
                          '"none", "auto" (the default with tools: the model\'s chat template\'s tool format), '
                          '"required" (at least one call, constrained by a grammar) or {"type": "function", '
                          '"function": {"name": ...}} (that function, constrained by a grammar).')
    parallel_tool_calls: optional(bool, "Default true; false: at most one call.")
    chat_template_kwargs: optional(dict[str, Any], "vLLM's: variables for the chat template, over the server's "
                                                   "--default-chat-template-kwargs (e.g. {\"enable_thinking\": "
                                                   "false} turns a Qwen3 template's thinking off); keys the "
                                                   "template does not use are ignored.")
    thinking_token_budget: optional(int, "vLLM's: the thinking's tokens at most (needs --reasoning-parser); then "
                                         "the end-of-thinking tag is forced and the answer follows.",
                                    ge=0, le=MAX_INT_PARAM)
    functions: Unsupported = None


ChatMessage.model_rebuild()
ChatCompletionRequest.model_rebuild()
Request = TypeVar("Request", CompletionRequest, ChatCompletionRequest)
_FIELD_NAMES = {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, ImagePart, ImageURL,
                                   StreamOptions,
                                   ResponseFormat, JSONSchemaFormat, Tool, FunctionDefinition, NamedToolChoice,
                                   ToolCall, FunctionCall) for name in model.model_fields} | {"schema"}


class InvalidField(ValueError):
    """A request body that does not validate: the first wrong field's name and what is wrong with it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def validate(model: type[Request], body: dict, vocab_size: int) -> Request:
    try:
        return model.model_validate(body, context={"vocab_size": vocab_size})
    except ValidationError as exc:
        raise _invalid_field(model, exc.errors(include_url=False)) from None


# ----------------------------------------------------------------------------- errors, in words


def _invalid_field(model: type[BaseModel], errors: list[dict]) -> InvalidField:
    """The first wrong field's error. A field of several shapes fails once per shape: the error of
    the shape the value has (its bound or an item), else the list of shapes it may take."""
    field = _field_loc(errors[0]["loc"])
    errors = [e for e in errors if _field_loc(e["loc"]) == field]
    param = _param(field)
    specific = [e for e in errors if not _is_shape_error(e)]
    if len(errors) > 1 and not specific:
        shapes = SHAPES.get(str(field[-1]), "of the documented type")
        return InvalidField(f"{_path(field)} must be {shapes}, got {_show(errors[0]['input'])}", param)
    error = (specific or errors)[0]
    where = _path(field if error["type"] in _CUSTOM else error["loc"])
    return InvalidField(f"{where} {_describe(model, error)}", param)


def _field_loc(loc: tuple) -> tuple:
    """The part of an error's location that names a field: ("messages", 0, "content") for an
    error anywhere inside a message's content, ("prompt",) for one anywhere in the prompt."""
    if loc[0] == "messages" and len(loc) > 1:
        return loc[:3] if len(loc) > 2 and loc[2] in ("role", "content") else loc[:2]
    if loc[:2] == ("stream_options", "include_usage"):
        return loc[:2]
    return loc[:1]


def _param(field: tuple) -> str:
    """The error object's `param`: the top field, messages[i].role / messages[i].content, or include_usage."""
    if field[0] == "messages" and len(field) > 1:
        return f"messages[{field[1]}].{field[2] if len(field) > 2 else 'role'}"
    if field == ("stream_options", "include_usage"):
        return "include_usage"  # the param this error has always named
    return str(field[0])


def _path(loc: tuple) -> str:
    """A location as the client wrote it: messages[0].content[1].type (union branch names left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
    return out


_CUSTOM = ("token_id", "unsupported", "missing", "logit_bias")  # errors that name the field, not the item


def _is_shape_error(error: dict) -> bool:
    return error["type"].endswith("_type") or error["type"] in ("literal_error", "missing", "unsupported")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, default=str)
    except (RecursionError, ValueError):
        return type(value).__name__
    return text if len(text) <= 64 else text[:61] + "..."


_MESSAGES = {
    "missing": "is required",
    "int_type": "must be an integer, got {input}",
    "bool_type": "must be true or false, got {input}",
    "string_type": "must be a string, got {input}",
    "list_type": "must be a list, got {input}",
    "model_type": "must be an object, got {input}",
    "dict_type": "must be an object, got {input}",
    "model_attributes_type": "must be an object, got {input}",
    "finite_number": "must be a finite number, got {input}",
    "literal_error": "must be {expected}, got {input}",
    "too_short": "must hold at least {min_length} items",
    "too_long": "may hold at most {max_length} items, got {actual_length}",
    "string_too_long": "may have at most {max_length} characters",
}


def _describe(model: type[BaseModel], error: dict) -> str:
    kind, value, ctx = error["type"], error["input"], error.get("ctx") or {}
    if kind == "float_type":  # an integer too large for a float is not finite either
        return f"must be a {'finite ' if isinstance(value, int) and not isinstance(value, bool) else ''}number, " \
               f"got {_show(value)}"
    if kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"must be {_range(model, error['loc'][0])}, got {_show(value)}"
    if kind in _MESSAGES:
        return _MESSAGES[kind].format(input=_show(value), **ctx)
    return error["msg"]  # a PydanticCustomError's own words


def _range(model: type[BaseModel], name: str) -> str:
    """A numeric field's bounds as the schema states them: "in [1, 128]", "in (0, 1]", ">= 0"."""
    schema = next(s for s in _schema(model)["properties"][name]["anyOf"] if s["type"] != "null")
    lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
    if lo is None:
        return f"<= {_number(hi)}"
    opening = "[" if "minimum" in schema else "("
    if hi is None:
        return f"{'>=' if opening == '[' else '>'} {_number(lo)}"
    return f"in {opening}{_number(lo)}, {_number(hi)}]"


@functools.cache
def _schema(model: type[BaseModel]) -> dict:
    return model.model_json_schema()


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
