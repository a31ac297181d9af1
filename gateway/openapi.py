"""The gateway's API as an OpenAPI 3.1 document, served at `GET /openapi.json`.

The request bodies' schemas are gateway/models.py's, derived with pydantic (the same classes
validate the requests); the answers, the stream's events and the errors are written out below.
Per gateway, the served model's id, its vocabulary size and the body size limit are filled in.
Fields not listed are ignored by the gateway, so no object here forbids additional properties.
What one field's range cannot say (a prompt that does not fit the context, `best_of` below `n`,
beam search options without `use_beam_search`, `top_logprobs` without `logprobs`, two structured
outputs at once, a JSON schema, regex or grammar the grammar library rejects, ...) is a 400 with the
error object.
"""
from __future__ import annotations

import importlib.metadata

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.models import SERVED_MODEL, TOKEN_ID, ChatCompletionRequest, CompletionRequest

REQUESTS = (CompletionRequest, ChatCompletionRequest)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_tokens_details": {
            "type": "object", "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0,
                                             "description": "Prompt tokens found in the prefix cache."}},
        },
        "completion_tokens_details": {
            "type": "object", "required": ["reasoning_tokens"],
            "description": "Chat under --reasoning-parser only.",
            "properties": {"reasoning_tokens": {"type": "integer", "minimum": 0,
                                                "description": "The tokens up to the one that ends the thinking."}},
        },
    },
}
REASONING = {"type": ["string", "null"], "description": "Under --reasoning-parser: the model's thinking (both names "
                                                         "carry the same text)."}

FINISH_REASON = {"enum": ["stop", "length"]}

COMPLETION_LOGPROBS = {
    "type": "object",
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        # with echo the prompt's first token has neither (null)
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {"type": "array", "items": {"anyOf": [
            {"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]}},
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


PROMPT_LOGPROBS = {  # vLLM's: per prompt token null (the first) or token id -> its entry (its own, then the top k)
    "description": "With prompt_logprobs: per prompt token null (the first) or {\"<token id>\": {logprob, rank, "
                   "decoded_token}}: the prompt token's own entry, then the top prompt_logprobs.",
    "anyOf": [{"type": "array", "items": {"anyOf": [{"type": "null"}, {
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "required": ["logprob", "rank", "decoded_token"],
            "properties": {"logprob": {"type": "number"}, "rank": {"type": "integer", "minimum": 1},
                           "decoded_token": {"type": "string"}},
        },
    }]}}, {"type": "null"}],
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
    finish_reason = FINISH_REASON["enum"] + (["tool_calls"] if name != "text" else [])
    return {
        "type": "object",
        "required": ["index", name, "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            name: schema,
            "logprobs": {"anyOf": [_ref(logprobs), {"type": "null"}]},
            "finish_reason": {"enum": finish_reason + [None] if chunk else finish_reason},
            "prompt_logprobs": PROMPT_LOGPROBS,
        },
    }


TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text."}}},
    },
}
TOOL_CALL_DELTA = {
    "type": "object",
    "required": ["index"],
    "description": "A call's first delta has its id, type and function name; later ones pieces of its arguments.",
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
    },
}


COMPLETION_RESPONSE = _completion_body("cmpl", "text_completion", _choice({"text": {"type": "string"}}))
COMPLETION_CHUNK = _completion_body("cmpl", "text_completion", _choice({"text": {"type": "string"}}, True), True)
CHAT_RESPONSE = _completion_body("chatcmpl", "chat.completion", _choice({"message": {
    "type": "object",
    "required": ["role", "content"],
    "description": "With tool calls (finish_reason tool_calls) the content is null, or the text before the calls.",
    "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                   "tool_calls": {"type": "array", "items": TOOL_CALL},
                   "reasoning_content": REASONING, "reasoning": REASONING},
}}))
CHAT_CHUNK = _completion_body("chatcmpl", "chat.completion.chunk", _choice({"delta": {
    "type": "object",
    "description": "The first chunk of each choice holds its role and an empty content; later ones the new "
                   "text, if any, or the tool calls' deltas.",
    "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                   "tool_calls": {"type": "array", "items": TOOL_CALL_DELTA},
                   "reasoning_content": REASONING, "reasoning": REASONING},
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


def _generation(summary: str, request: str, response: str, chunk: str, max_body_bytes: int) -> dict:
    return {
        "post": {
            "summary": summary,
            "security": [{}, {"bearerAuth": []}],
            "requestBody": {
                "required": True,
                "description": f"JSON, at most {max_body_bytes} bytes.",
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
                "400": _error("A malformed body, a field out of its range, a structured output (response_format, "
                              "guided_*) the grammar library rejects, or a prompt that does not fit the context or "
                              "the KV cache; `param` names the field."),
                "401": UNAUTHORIZED,
                "404": _error("An unknown model (code model_not_found)."),
                "413": _error(f"The body is larger than {max_body_bytes} bytes (code request_too_large)."),
                "429": _error("Too many requests are waiting (code queue_full).", RETRY_AFTER),
                "500": _error("The generation failed in the engine (code engine_error or aborted)."),
                "503": _error("No scheduler with ready workers, or Redis unreachable (code service_unavailable).",
                              RETRY_AFTER),
                "504": _error("The request did not finish within the gateway's request timeout (code timeout)."),
            },
        },
    }


def openapi_document(served_model_name: str, vocab_size: int, max_body_bytes: int) -> dict:
    """The document for this gateway's model, vocabulary size and body limit."""
    _, requests = models_json_schema([(model, "validation") for model in REQUESTS],
                                     ref_template="#/components/schemas/{model}")
    schemas = {name: _served(schema, served_model_name, vocab_size) for name, schema in requests["$defs"].items()}
    return _with_request_ids(_document(schemas, max_body_bytes))


def _served(node, served_model_name: str, vocab_size: int):
    """A request schema with the markers of gateway/models.py made this gateway's values."""
    if isinstance(node, list):
        return [_served(v, served_model_name, vocab_size) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _served(v, served_model_name, vocab_size) for k, v in node.items()}
    if node.pop(SERVED_MODEL, False):
        node["enum"] = [served_model_name, None]
    if node.pop(TOKEN_ID, False):
        node["maximum"] = vocab_size - 1
    return node


def _document(request_schemas: dict, max_body_bytes: int) -> dict:
    """The OpenAPI 3.1 document: the info, every path, the components (`request_schemas` among them)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Pagoda",
            "version": _version(),
            "description": "An OpenAI-compatible LLM API. Errors are OpenAI error objects "
                           "({\"error\": {\"message\", \"type\", \"param\", \"code\"}}); an unknown route is a 404 "
                           "and a wrong method a 405, with the same object. Fields a request body does not list are "
                           "ignored. Every answer carries an X-Request-Id.",
        },
        "paths": {
            "/v1/completions": _generation(
                "Complete one or more prompts", "CompletionRequest", "CompletionResponse", "CompletionChunk",
                max_body_bytes),
            "/v1/chat/completions": _generation(
                "Answer a conversation", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk",
                max_body_bytes),
            **_model_paths(),
            **_service_paths(),
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "Only when the server was started with an API key."}},
            "schemas": _schemas(request_schemas),
        },
    }


def _model_paths() -> dict:
    """/v1/models and /v1/models/{model}: the served model."""
    return {
        "/v1/models": {"get": {
            "summary": "The served model",
            "security": [{}, {"bearerAuth": []}],
            "responses": {
                "200": {"description": "One model.",
                        "content": {"application/json": {"schema": _ref("ModelList")}}},
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
    }


def _service_paths() -> dict:
    """/health, /metrics and /openapi.json."""
    return {
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
    }


def _schemas(request_schemas: dict) -> dict:
    """The components' schemas: the requests', then the responses' and the errors'."""
    return {
        **request_schemas,
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
    }


REQUEST_ID_HEADER = {"X-Request-Id": {
    "required": True, "schema": {"type": "string"},
    "description": "The client's own X-Request-Id, echoed, else this request's id (a generation's id without its "
                   "cmpl- or chatcmpl- prefix)."}}
REQUEST_ID_PARAMETER = {"name": "X-Request-Id", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "An id of the client's own, echoed in the answer's X-Request-Id."}


def _with_request_ids(document: dict) -> dict:
    """Every operation takes an optional X-Request-Id and every answer carries one."""
    for path, operations in document["paths"].items():
        document["paths"][path] = {method: {
            **operation,
            "parameters": operation.get("parameters", []) + [REQUEST_ID_PARAMETER],
            "responses": {status: {**response, "headers": {**response.get("headers", {}), **REQUEST_ID_HEADER}}
                          for status, response in operation["responses"].items()},
        } for method, operation in operations.items()}
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
