"""The gateway's API as an OpenAPI 3.1 document, served at `GET /openapi.json`.

The document is data: the schemas below say what `gateway/openai_api.py` and `gateway/app.py`
accept and answer, with the same bounds (taken from the same constants). Only the served model's
id, its vocabulary size and the body size limit are filled in per gateway. Fields not listed are
ignored by the gateway, so no object here forbids additional properties. What one field's range
cannot say (a prompt that does not fit the context, `best_of` below `n`, beam search options
without `use_beam_search`, `top_logprobs` without `logprobs`, ...) is a 400 with the error object.
"""
from __future__ import annotations

import importlib.metadata

from starlette.requests import Request
from starlette.responses import JSONResponse

from common.protocol import MAX_BEAM_WIDTH, MAX_INT_PARAM, MAX_LENGTH_PENALTY
from gateway.openai_api import (
    CHAT_ROLES, MAX_COMPLETION_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
)

MODEL = "__served_model_name__"  # placeholders, replaced by `openapi_document`
MAX_TOKEN_ID = "__max_token_id__"
MAX_BODY = "__max_body_bytes__"
SEED_MAX = 2**63 - 1 - MAX_N  # a seeded request's samples use seed, seed + 1, ... seed + n - 1


def _nullable(kind: str, **schema) -> dict:
    """An optional field: null (or leaving it out) means its default."""
    return {"type": [kind, "null"], **schema}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}

# Fields both generation endpoints take (openai_api._common and _max_tokens).
SAMPLING_FIELDS = {
    "model": {"enum": [MODEL, None], "description": "The served model's id (GET /v1/models); another is a 404."},
    "max_tokens": _nullable(
        "integer", minimum=1, maximum=MAX_INT_PARAM,
        description="Tokens to generate at most. Default: 16 for completions, the rest of the context for chat. "
                    "The prompt plus max_tokens must fit the model's context length, else 400 "
                    "(code context_length_exceeded)."),
    "max_completion_tokens": _nullable(
        "integer", minimum=1, maximum=MAX_INT_PARAM, description="Same as max_tokens, and takes precedence."),
    "temperature": _nullable(
        "number", minimum=0, description="Default 1 (0 with use_beam_search, which allows only 0); 0 is greedy."),
    "top_p": _nullable("number", exclusiveMinimum=0, maximum=1, description="Default 1."),
    "top_k": _nullable("integer", minimum=-1, maximum=MAX_INT_PARAM, description="Default 0; 0 and -1 are off."),
    "min_p": _nullable("number", minimum=0, maximum=1, description="Default 0."),
    "n": _nullable(
        "integer", minimum=1, maximum=MAX_N,
        description=f"Choices per prompt, default 1. n (or best_of) times the number of prompts must be <= {MAX_N}; "
                    f"with use_beam_search, <= {MAX_BEAM_WIDTH}."),
    "best_of": _nullable(
        "integer", minimum=1, maximum=MAX_N,
        description="Sample best_of outputs per prompt and return the n of highest cumulative logprob; >= n. "
                    "best_of > n cannot stream."),
    "use_beam_search": _nullable(
        "boolean", description="Beam search with best_of beams (else n); cannot stream; needs temperature 0, "
                               "top_p 1, top_k off, and no logprobs, min_p, penalties, min_tokens, "
                               "stop_token_ids or ignore_eos."),
    "length_penalty": _nullable(
        "number", minimum=-MAX_LENGTH_PENALTY, maximum=MAX_LENGTH_PENALTY,
        description="Beam score = sum of logprobs / length ** length_penalty. Default 1; "
                    "other values only with use_beam_search."),
    "early_stopping": {
        "anyOf": [{"type": "boolean"}, {"const": "never"}, {"type": "null"}],
        "description": "Beam search stopping rule (transformers'); default false; other values only with "
                       "use_beam_search."},
    "stop": {
        "anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP}, {"type": "null"}],
        "description": "Strings that end a choice; they are not part of its text."},
    "stop_token_ids": _nullable(
        "array", items=TOKEN_ID, maxItems=MAX_STOP_TOKEN_IDS, description="Token ids that end a choice."),
    "seed": _nullable("integer", minimum=-(2**63), maximum=SEED_MAX, description="Makes sampling reproducible."),
    "presence_penalty": _nullable("number", minimum=-2, maximum=2, description="Default 0."),
    "frequency_penalty": _nullable("number", minimum=-2, maximum=2, description="Default 0."),
    "repetition_penalty": _nullable("number", exclusiveMinimum=0, description="Default 1 (off)."),
    "min_tokens": _nullable(
        "integer", minimum=0, maximum=MAX_INT_PARAM,
        description="EOS and stop_token_ids cannot end a choice before this many tokens; <= max_tokens."),
    "ignore_eos": _nullable("boolean", description="Keep generating after EOS. Default false."),
    "skip_special_tokens": _nullable("boolean", description="Leave special tokens out of the text. Default true."),
    "stream": _nullable("boolean", description="Answer with Server-Sent Events (text/event-stream)."),
    "stream_options": _nullable(
        "object", properties={"include_usage": _nullable("boolean")},
        description="Only with stream: true. include_usage adds a last chunk with the usage."),
    "user": _nullable("string", description="Ignored; accepted for compatibility."),
}

PROMPT = {
    "description": "Text, texts, token ids, or lists of token ids; each must be at least one token.",
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_N},
        {"type": "array", "items": TOKEN_ID, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": TOKEN_ID, "minItems": 1}, "minItems": 1,
         "maxItems": MAX_N},
    ],
}

TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

CONTENT = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}],
    "description": "Text, or text parts (joined with newlines).",
}

MESSAGE = {
    "description": "A message needs a content, except that an assistant message may leave it out or null. "
                   "developer is treated as system.",
    "anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": sorted(CHAT_ROLES)}, "content": CONTENT}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [CONTENT, {"type": "null"}]}}},
    ],
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "description": "echo, suffix and logit_bias are not supported: a 400 unless absent, null, false or empty.",
    "properties": {
        "prompt": PROMPT,
        **SAMPLING_FIELDS,
        "logprobs": _nullable(
            "integer", minimum=0, maximum=MAX_COMPLETION_LOGPROBS,
            description="Return the logprob of each token and of this many alternatives."),
    },
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "description": "tools, functions and logit_bias are not supported: a 400 unless absent, null, false or empty. "
                   "The messages are rendered with the model's chat template.",
    "properties": {
        "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
        **SAMPLING_FIELDS,
        "logprobs": _nullable("boolean", description="Return the logprob of each token."),
        "top_logprobs": _nullable(
            "integer", minimum=0, maximum=MAX_TOP_LOGPROBS, description="Alternatives per token; needs logprobs."),
        "response_format": _nullable(
            "object", required=["type"], properties={"type": {"const": "text"}},
            description="Only {\"type\": \"text\"} is supported."),
    },
}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {name: {"type": "integer", "minimum": 0}
                   for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
}

FINISH_REASON = {"enum": ["stop", "length"]}

COMPLETION_LOGPROBS = {
    "type": "object",
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}

TOKEN_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    },
}

CHAT_LOGPROBS = {
    "type": "object",
    "required": ["content"],
    "properties": {
        "content": {"type": "array", "items": {
            "allOf": [TOKEN_LOGPROB],
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "array", "items": TOKEN_LOGPROB}},
        }},
    },
}


def _completion_body(kind: str, obj: str, choice: dict, chunk: bool = False) -> dict:
    """A whole answer, or (`chunk`) one streamed event's: its choices carry what is new since the
    last event, and with stream_options.include_usage a last chunk has no choices and the usage."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"] + ([] if chunk else ["usage"]),
        "properties": {
            "id": {"type": "string", "pattern": f"^{kind}-"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 0 if chunk else 1, "items": choice},
            "usage": {"anyOf": [_ref("Usage"), {"type": "null"}]} if chunk else _ref("Usage"),
        },
    }


def _choice(content: dict, chunk: bool = False) -> dict:
    (name, schema), = content.items()
    logprobs = "CompletionLogprobs" if name == "text" else "ChatLogprobs"
    return {
        "type": "object",
        "required": ["index", name, "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            name: schema,
            "logprobs": {"anyOf": [_ref(logprobs), {"type": "null"}]},
            "finish_reason": {"enum": ["stop", "length", None]} if chunk else FINISH_REASON,
        },
    }


COMPLETION_RESPONSE = _completion_body("cmpl", "text_completion", _choice({"text": {"type": "string"}}))
COMPLETION_CHUNK = _completion_body("cmpl", "text_completion", _choice({"text": {"type": "string"}}, True), True)
CHAT_RESPONSE = _completion_body("chatcmpl", "chat.completion", _choice({"message": {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
}}))
CHAT_CHUNK = _completion_body("chatcmpl", "chat.completion.chunk", _choice({"delta": {
    "type": "object",
    "description": "The first chunk of each choice holds its role and an empty content; later ones the new "
                   "text, if any.",
    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
}}, True), True)


def _sse_event(chunk: str) -> dict:
    """One Server-Sent Event of a stream (OpenAPI 3.1: the schema of text/event-stream is per event)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}},
            ]},
        },
    }


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"enum": ["invalid_request_error", "rate_limit_error", "server_error"]},
                "param": {"type": ["string", "null"], "description": "The request field at fault, if one is."},
                "code": {"type": ["string", "null"]},
            },
        },
    },
}

RETRY_AFTER = {"Retry-After": {"required": True, "description": "Seconds to wait before retrying.",
                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def _error(description: str, headers: dict | None = None) -> dict:
    response = {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}
    if headers:
        response["headers"] = headers
    return response


UNAUTHORIZED = _error("The API key is missing or wrong (only when the server has one).")


def _generation(summary: str, request: str, response: str, chunk: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "security": [{}, {"bearerAuth": []}],
            "requestBody": {
                "required": True,
                "description": f"JSON, at most {MAX_BODY} bytes.",
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": f"The whole answer, or with stream: true, Server-Sent Events: one {chunk} "
                                   "per event (`data: {...}`), ending with `data: [DONE]`. An error after the "
                                   "stream has started is an event holding the error object, then `data: [DONE]`.",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _sse_event(chunk)},
                    },
                },
                "400": _error("A malformed body, a field out of its range, or a prompt that does not fit the "
                              "context or the KV cache; `param` names the field."),
                "401": UNAUTHORIZED,
                "404": _error("An unknown model (code model_not_found)."),
                "413": _error(f"The body is larger than {MAX_BODY} bytes (code request_too_large)."),
                "429": _error("Too many requests are waiting (code queue_full).", RETRY_AFTER),
                "500": _error("The generation failed in the engine (code engine_error or aborted)."),
                "503": _error("No scheduler with ready workers, or Redis unreachable (code service_unavailable).",
                              RETRY_AFTER),
                "504": _error("The request did not finish within the gateway's request timeout (code timeout)."),
            },
        },
    }


DOCUMENT = {
    "openapi": "3.1.0",
    "info": {
        "title": "Pagoda",
        "version": "__version__",
        "description": "An OpenAI-compatible LLM API. Errors are OpenAI error objects "
                       "({\"error\": {\"message\", \"type\", \"param\", \"code\"}}); an unknown route is a 404 and a "
                       "wrong method a 405, with the same object. Fields a request body does not list are ignored.",
    },
    "paths": {
        "/v1/completions": _generation(
            "Complete one or more prompts", "CompletionRequest", "CompletionResponse", "CompletionChunk"),
        "/v1/chat/completions": _generation(
            "Answer a conversation", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk"),
        "/v1/models": {"get": {
            "summary": "The served model",
            "security": [{}, {"bearerAuth": []}],
            "responses": {
                "200": {"description": "One model.", "content": {"application/json": {"schema": _ref("ModelList")}}},
                "401": UNAUTHORIZED,
            },
        }},
        "/v1/models/{model}": {"get": {
            "summary": "The served model, by its id (the openai SDK's models.retrieve)",
            "security": [{}, {"bearerAuth": []}],
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "The model.", "content": {"application/json": {"schema": _ref("Model")}}},
                "401": UNAUTHORIZED,
                "404": _error("Another model's id (code model_not_found)."),
            },
        }},
        "/health": {"get": {
            "summary": "Whether a scheduler with ready workers is alive",
            "security": [],
            "responses": {
                "200": {"description": "Ready.", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}}}},
                "503": _error("Not ready (code service_unavailable).", RETRY_AFTER),
            },
        }},
        "/metrics": {"get": {
            "summary": "Prometheus metrics (pagoda:...)",
            "security": [],
            "responses": {"200": {"description": "The Prometheus text format.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
        "/openapi.json": {"get": {
            "summary": "This document",
            "security": [],
            "responses": {"200": {"description": "OpenAPI 3.1.",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
    },
    "components": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                           "description": "Only when the server was started with an API key."}},
        "schemas": {
            "CompletionRequest": COMPLETION_REQUEST,
            "ChatCompletionRequest": CHAT_REQUEST,
            "ChatMessage": MESSAGE,
            "CompletionResponse": COMPLETION_RESPONSE,
            "ChatCompletionResponse": CHAT_RESPONSE,
            "CompletionChunk": COMPLETION_CHUNK,
            "ChatCompletionChunk": CHAT_CHUNK,
            "CompletionLogprobs": COMPLETION_LOGPROBS,
            "ChatLogprobs": CHAT_LOGPROBS,
            "Usage": USAGE,
            "ModelList": {
                "type": "object",
                "required": ["object", "data"],
                "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": _ref("Model")},
                },
            },
            "Model": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                               "created": {"type": "integer"}, "owned_by": {"type": "string"}},
            },
            "Error": ERROR,
        },
    },
}


def openapi_document(served_model_name: str, vocab_size: int, max_body_bytes: int) -> dict:
    """DOCUMENT with this gateway's model, vocabulary size and body limit filled in."""
    values = {MODEL: served_model_name, MAX_TOKEN_ID: vocab_size - 1, MAX_BODY: max_body_bytes, "__version__": _version()}

    def fill(node):
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if isinstance(node, str):
            for placeholder, value in values.items():
                if node == placeholder:
                    return value
                node = node.replace(placeholder, str(value))
        return node

    return _with_request_ids(fill(DOCUMENT))


REQUEST_ID_HEADER = {"X-Request-Id": {
    "required": True, "schema": {"type": "string"},
    "description": "The client's own X-Request-Id, echoed, else this request's id (a generation's id without its "
                   "cmpl- or chatcmpl- prefix)."}}
REQUEST_ID_PARAMETER = {"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "An id of the client's own, echoed in the answer's X-Request-Id."}


def _with_request_ids(document: dict) -> dict:
    """Every operation takes an optional X-Request-Id and every answer carries one."""
    for path in document["paths"].values():
        for operation in path.values():
            operation["parameters"] = operation.get("parameters", []) + [REQUEST_ID_PARAMETER]
            for response in operation["responses"].values():
                response["headers"] = {**response.get("headers", {}), **REQUEST_ID_HEADER}
    return document


def _version() -> str:
    try:
        return importlib.metadata.version("pagoda-llm")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


async def openapi_endpoint(request: Request) -> JSONResponse:
    state = request.app.state
    if getattr(state, "openapi", None) is None:
        gateway = state.gateway
        state.openapi = openapi_document(gateway.served_model_name, gateway.vocab_size, gateway.config.max_body_bytes)
    return JSONResponse(state.openapi)
