"""The pooling routes of a pooling model (common/pooling.py; docs/pooling.md): vectors, not text.

    POST /v1/embeddings             OpenAI's: input (text, texts, token ids), encoding_format float |
                                    base64, dimensions (the first d, renormalized), usage
    POST /v1/rerank, /rerank        Jina's and Cohere's: query, documents, top_n, return_documents ->
                                    results [{index, document, relevance_score}], best first
    POST /score                     vLLM's: text_1 and text_2 (one to many, or pairwise) -> data [{index, score}]

Each input is one prefill-only request through the scheduler (batched with whatever else runs,
chunked when long, prefix-cached when it pools its last token); its one event carries the vector.
A classifier scores a (query, document) pair as its tokenizer joins the two (a cross-encoder); an
embedder scores the cosine similarity of their embeddings. Inputs longer than the context are a
400 unless the request sets `truncate_prompt_tokens` (the first k tokens are kept; -1: the context).
"""
from __future__ import annotations

import asyncio
import base64
import sys
import time
import uuid
from array import array
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.admission import AdmissionLimits, check_admissible
from common.pooling import cosine, encode_pair, vector
from common.protocol import MAX_INT_PARAM, GenerateRequest, SamplingParams
from gateway.models import SERVED_MODEL, NonEmpty, Strict, Text, TokenIds, optional
from gateway.engine_client import Generation
from gateway.openai_api import _validate, bad_request
from gateway.serving import EngineError, engine_failure, wait_for_disconnect

if TYPE_CHECKING:
    from gateway.app import Gateway

MAX_INPUTS = 2048  # inputs (or documents) per request, as OpenAI's embeddings API
Truncate = optional(int, "Keep the first k tokens of each input (-1: as many as the context holds); unset: an input "
                         "longer than the context is a 400.", ge=-1, le=MAX_INT_PARAM)


class EmbeddingRequest(Strict):
    model: Annotated[str | None, Field(json_schema_extra={SERVED_MODEL: True})] = None
    input: Text | NonEmpty[list[Text]] | TokenIds | NonEmpty[list[TokenIds]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: optional(int, "Return the first d values, normalized again (Matryoshka embeddings).", ge=1,
                         le=MAX_INT_PARAM)
    user: str | None = None
    truncate_prompt_tokens: Truncate


class RerankRequest(Strict):
    model: Annotated[str | None, Field(json_schema_extra={SERVED_MODEL: True})] = None
    query: Text
    documents: NonEmpty[list[str]]
    top_n: optional(int, "Return the n most relevant documents (default: all).", ge=0, le=MAX_INT_PARAM)
    return_documents: bool = True
    truncate_prompt_tokens: Truncate


class ScoreRequest(Strict):
    model: Annotated[str | None, Field(json_schema_extra={SERVED_MODEL: True})] = None
    text_1: Text | NonEmpty[list[Text]]
    text_2: Text | NonEmpty[list[Text]]
    truncate_prompt_tokens: Truncate


async def embeddings(gateway: Gateway, request: Request) -> Response:
    body = await gateway.read_json(request)
    parsed = _parse(gateway, EmbeddingRequest, body, "embed")
    texts = [parsed.input] if isinstance(parsed.input, str) or isinstance(parsed.input[0], int) else parsed.input
    _check_count(len(texts), "input")
    if parsed.dimensions is not None and parsed.dimensions > gateway.pooler.dimensions:
        raise bad_request(f"dimensions must be at most the model's {gateway.pooler.dimensions}, got "
                          f"{parsed.dimensions}", "dimensions")
    prompts = await _tokenize(gateway, texts, parsed.truncate_prompt_tokens)
    vectors, num_tokens = await _pool(gateway, request, prompts, parsed.truncate_prompt_tokens, "input")
    normalize = gateway.pooler.normalize

    def shaped() -> list[dict]:
        return [{"object": "embedding", "index": i,
                 "embedding": _encode(_shorten(v, parsed.dimensions, normalize), parsed.encoding_format)}
                for i, v in enumerate(vectors)]

    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": gateway.served_model_name, "data": await asyncio.to_thread(shaped),
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def rerank(gateway: Gateway, request: Request) -> Response:
    body = await gateway.read_json(request)
    parsed = _parse(gateway, RerankRequest, body, "score")
    _check_count(len(parsed.documents), "documents")
    scores, num_tokens = await _scores(gateway, request, [parsed.query], parsed.documents,
                                       parsed.truncate_prompt_tokens, "documents")
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if parsed.top_n is not None:
        order = order[:parsed.top_n]
    results = [{"index": i, "relevance_score": scores[i]}
               | ({"document": {"text": parsed.documents[i]}} if parsed.return_documents else {}) for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": gateway.served_model_name,
                         "usage": {"total_tokens": num_tokens}, "results": results})


async def score(gateway: Gateway, request: Request) -> Response:
    body = await gateway.read_json(request)
    parsed = _parse(gateway, ScoreRequest, body, "score")
    first = [parsed.text_1] if isinstance(parsed.text_1, str) else parsed.text_1
    second = [parsed.text_2] if isinstance(parsed.text_2, str) else parsed.text_2
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"text_1 must be one text or as many as text_2 ({len(second)}), got {len(first)}", "text_1")
    _check_count(len(second), "text_2")
    scores, num_tokens = await _scores(gateway, request, first, second, parsed.truncate_prompt_tokens, "text_2")
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": gateway.served_model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _parse(gateway: Gateway, model: type, body: dict, use: str):
    """The body validated, for a model that serves `use` ("embed"; "score": a one-label classifier or an embedder)."""
    gateway._check_model(body.get("model"))  # another name than the served model's or an adapter's: a 404
    if body.get("model") not in (None, gateway.served_model_name):
        raise bad_request("LoRA adapters serve generation, not pooling", "model")
    pooler = gateway.pooler
    if pooler is None:
        raise bad_request(f"the model {gateway.served_model_name!r} serves generation, not pooling: start the server "
                          "with an embedding or reranker model, or with --runner pooling", "model",
                          "model_not_pooling")
    if use == "embed" and pooler.task != "embed":
        raise bad_request(f"the model {gateway.served_model_name!r} is a classifier: it scores (/v1/rerank, /score), "
                          "it does not embed", "model", "model_not_embedding")
    if use == "score" and pooler.task == "classify" and pooler.num_labels != 1:
        raise bad_request(f"the model {gateway.served_model_name!r} classifies into {pooler.num_labels} labels: "
                          "scoring needs one", "model")
    return _validate(model, body, gateway.vocab_size)


def _check_count(n: int, param: str) -> None:
    if n > MAX_INPUTS:
        raise bad_request(f"{param} may hold at most {MAX_INPUTS} items, got {n}", param)


async def _tokenize(gateway: Gateway, inputs: list, truncate: int | None, pairs: bool = False) -> list[list[int]]:
    """Each input's token ids (off the event loop): a text as the tokenizer encodes it, or a pair
    as it joins two (`pairs`); token ids as given. `truncate`: at most that many tokens, cut as the
    tokenizer truncates (its special tokens kept); -1: the context length."""
    tokenizer = gateway.tokenizer
    limit = truncate
    if truncate == -1:
        limit = AdmissionLimits.strictest(gateway._ready(await gateway._statuses())).max_model_len

    def encode(item) -> list[int]:
        if pairs:
            return encode_pair(tokenizer, *item, limit)
        if isinstance(item, str):
            return list(tokenizer(item, truncation=limit is not None, max_length=limit)["input_ids"])
        return list(item[:limit] if limit is not None else item)

    return await asyncio.to_thread(lambda: [encode(item) for item in inputs])


async def _scores(gateway: Gateway, request: Request, first: list[str], second: list[str], truncate: int | None,
                  where: str) -> tuple[list[float], int]:
    """Each pair's score (one first text for every second one, or pairwise)."""
    pairs = list(zip(first * len(second) if len(first) == 1 else first, second))
    if gateway.pooler.task == "classify":
        prompts = await _tokenize(gateway, pairs, truncate, pairs=True)
        vectors, num_tokens = await _pool(gateway, request, prompts, truncate, where)
        return [v[0] for v in vectors], num_tokens
    texts = list(dict.fromkeys([*first, *second]))
    vectors, num_tokens = await _pool(gateway, request, await _tokenize(gateway, texts, truncate), truncate, where)
    by_text = dict(zip(texts, vectors))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs], num_tokens


async def _pool(gateway: Gateway, request: Request, prompts: list[list[int]], truncate: int | None, where: str
                ) -> tuple[list[list[float]], int]:
    """Each prompt's vector, and the prompt tokens they took: one prefill-only request each, all
    aborted when one fails, the client leaves or the deadline passes."""
    arrival_time, arrival = time.time(), time.monotonic()
    statuses = await gateway._statuses()
    limits = AdmissionLimits.strictest(gateway._ready(statuses))
    params = SamplingParams(temperature=0.0, max_tokens=0, pooling=gateway.pooler.params())
    for i, prompt in enumerate(prompts):
        rejection = check_admissible(len(prompt), params, limits, where)
        if rejection is not None:
            hint = "" if truncate is not None or rejection.param != where else " (or set truncate_prompt_tokens)"
            at = f"{where}[{i}]: " if len(prompts) > 1 else ""
            raise bad_request(at + rejection.message + hint, rejection.param, rejection.code)
    num_tokens = sum(len(p) for p in prompts)
    gateway._admit(statuses, num_tokens)
    response_id = uuid.uuid4().hex
    requests = [GenerateRequest(f"pool-{response_id}-{i}", prompt, params, gateway.engine.reply_stream, arrival_time)
                for i, prompt in enumerate(prompts)]
    generation = await gateway._submit(requests)
    gateway.metrics.prompt_tokens.inc(num_tokens)
    collect = asyncio.ensure_future(_collect(gateway, generation, requests, arrival + gateway.config.request_timeout_s))
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            raise ClientLeft()
        return collect.result(), num_tokens
    finally:
        for task in (collect, disconnect):
            task.cancel()
        generation.close()  # aborts whatever has not finished


class ClientLeft(Exception):
    """The client disconnected before the vectors were ready (answered 499; nothing is sent)."""


async def _collect(gateway: Gateway, generation: Generation, requests: list[GenerateRequest], deadline: float
                   ) -> list[list[float]]:
    index = {r.request_id: i for i, r in enumerate(requests)}
    vectors: list[list[float] | None] = [None] * len(requests)
    while generation.unfinished:
        try:
            event = await generation.next_event(deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise EngineError(f"the request did not finish within request_timeout_s="
                              f"{gateway.config.request_timeout_s:g} s", 504, "timeout") from None
        if event.request_id not in index or event.finish_reason is None:
            continue
        if event.finish_reason in ("error", "abort"):
            raise engine_failure(event.finish_reason, event.error, "pooling")
        if event.embedding is None:
            raise EngineError("pooling failed: the engine returned no vector (do the workers serve this model as a "
                              "pooling model?)")
        vectors[index[event.request_id]] = await asyncio.to_thread(vector, event.embedding)
        generation.finish(event.request_id)
    return vectors


def _shorten(values: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values, normalized again when the model normalizes (Matryoshka)."""
    if dimensions is None:
        return values
    values = values[:dimensions]
    if not normalize:
        return values
    norm = sum(v * v for v in values) ** 0.5
    return [v / norm for v in values] if norm else values


def _encode(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
