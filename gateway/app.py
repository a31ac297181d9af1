"""The OpenAI-compatible HTTP API: validate, tokenize, admit, submit to Redis, answer (whole or SSE).

    POST /v1/completions        POST /v1/chat/completions        GET /v1/models
    GET  /v1/models/{model}     GET  /openapi.json
    POST /v1/responses          GET  /v1/responses/{id}          the Responses API (gateway/responses_api.py)
    POST /v1/messages           POST /v1/messages/count_tokens   the Messages API (gateway/messages_api.py)
    GET  /health                GET  /metrics                    the operator's routes, runtime LoRA (gateway/admin.py)
    GET  /dashboard             GET  /dashboard/events (SSE)     the memory page and its data (gateway/dashboard.py)
    POST /v1/embeddings         POST /v1/rerank, /rerank, /score a pooling model's routes (gateway/pooling_api.py)

Every answer carries X-Request-Id: the client's own, echoed, or else the request's id (the hex
part of a generation's `cmpl-`/`chatcmpl-` id).

Every check happens before the first byte of a response; an error after it (a stream whose
scheduler fails) is an SSE error event followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.admission import AdmissionLimits, check_admissible
from common.config import ConfigError, GatewayConfig, hf_overrides
from common.generation_config import default_sampling_params, read_generation_config, token_ids
from common.models import resolve_model
from common.protocol import GenerateRequest, LoRARequest, SchedulerStatus
from common.tokenizer import load_tokenizer
from common.pooling import pooler_config
from gateway import admin, dashboard, messages_api, pooling_api, responses_api
from gateway.agents import event_stream
from gateway.dashboard import DASHBOARD_ROUTES
from gateway.detokenizer import IncrementalDetokenizer, token_text_cache
from gateway.lora import LoRARegistry
from gateway.engine_client import EngineClient, Generation
from gateway.metrics import FinishedOutput, GatewayMetrics, scheduled_monotonic
from common.multimodal import image_limit
from gateway.media import MediaPolicy
from gateway.models import InvalidField
from gateway.multimodal import ImagePrompts
from gateway.openapi import openapi_endpoint
from gateway.reasoning import ReasoningStream
from gateway.openai_api import (
    RETRY_AFTER_UNAVAILABLE_S, APIError, ParsedRequest, bad_request, error_response, parse_chat, parse_completion,
    parse_json, unavailable,
)
from gateway.serving import (
    SHUTTING_DOWN, SSE_DONE, ChoiceState, Echo, EngineError, ResponseShape, engine_failure, sse, usage,
    wait_for_disconnect,
)
from gateway.structured import StructuredOutputChecker
from gateway.tokenizer import PromptEncoder
from gateway.tools import AUTO_TOOL_CHOICE_NEEDS_A_FORMAT, ToolCallStream

log = logging.getLogger(__name__)

RETRY_AFTER_QUEUE_FULL_S = 1
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health", "/metrics",
          "/openapi.json")
# The agents' APIs, translations to and from chat (docs/agents.md): OpenAI's and Anthropic's own
# shapes, outside /openapi.json
AGENT_ROUTES = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
POOLING_ROUTES = ("/v1/embeddings", "/v1/rerank", "/rerank", "/score")
REQUEST_ID = "X-Request-Id"


def create_app(config: GatewayConfig, tokenizer=None) -> Starlette:
    """The gateway app; its lifespan connects to Redis and starts the reply reader.

    `tokenizer` overrides loading the model's (tests share one).
    """
    gateway = Gateway(config, tokenizer)
    app = Starlette(
        routes=[*api_routes(gateway), *admin.routes(gateway), *dashboard.routes(gateway)],
        middleware=[Middleware(CountResponses, metrics=gateway.metrics), Middleware(RequestIds)],
        exception_handlers={APIError: _api_error, HTTPException: _http_exception, Exception: _unexpected},
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app


def api_routes(gateway: Gateway) -> list[Route]:
    """The OpenAI API, /openapi.json, and the agents' APIs."""
    return [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", gateway.response, methods=["GET"]),
        Route("/v1/messages", gateway.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", gateway.count_tokens, methods=["POST"]),
        Route("/v1/embeddings", gateway.pooling(pooling_api.embeddings), methods=["POST"]),
        Route("/v1/rerank", gateway.pooling(pooling_api.rerank), methods=["POST"]),
        Route("/rerank", gateway.pooling(pooling_api.rerank), methods=["POST"]),
        Route("/score", gateway.pooling(pooling_api.score), methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),  # an id may hold a '/'
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer=None) -> None:
        self.config = config
        source = resolve_model(config.model, config.revision, config.download_dir)
        self.served_model_name = config.served_model_name or source.name
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
        generation_config = read_generation_config(source)
        # what a request that leaves a sampling field unset gets (vLLM's default_sampling_params)
        self.default_sampling_params = default_sampling_params(generation_config, config.generation_config)
        if self.default_sampling_params:
            log.info("default sampling parameters from the model's generation_config.json: %s "
                     "(--generation-config vllm ignores them)", self.default_sampling_params)
        self.encoder = PromptEncoder(self.tokenizer, _read_template(config.chat_template), config.tool_call_parser,
                                     config.chat_template_kwargs, config.reasoning_parser)
        self.encoder.images = ImagePrompts.of(source, MediaPolicy(
            config.allowed_local_media_path, config.allow_private_media_urls, fetch_timeout_s=config.media_fetch_timeout_s,
        ), image_limit(config.limit_mm_per_prompt))
        if config.enable_auto_tool_choice and self.encoder.tool_call_format is None:
            raise ConfigError(AUTO_TOOL_CHOICE_NEEDS_A_FORMAT)
        self.vocab_size = len(self.tokenizer)
        # a pooling model's task (common/pooling.py): it serves the pooling routes, not generation
        self.pooler = pooler_config(source, config.runner, config.convert, hf_overrides(config.hf_overrides))
        self.token_text = token_text_cache(self.tokenizer)
        self.structured = StructuredOutputChecker(self.tokenizer, self.vocab_size)
        eos = self.tokenizer.eos_token_id  # with generation_config.json's: the worker's EOS ids end a sequence
        self.eos_token_ids = frozenset(([eos] if isinstance(eos, int) else [])
                                       + token_ids(generation_config.get("eos_token_id")))
        self.metrics = GatewayMetrics(self.served_model_name)
        # the adapters a request may name as its model (gateway/lora.py)
        self.loras = (LoRARegistry(source, self.served_model_name, config.max_lora_rank, config.lora_modules)
                      if config.enable_lora else None)
        self.engine: EngineClient | None = None
        self.created = int(time.time())
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        self._loop = asyncio.get_running_loop()
        self.engine = EngineClient(self.config.redis_url, self.config.gateway_id, self.config.redis_restart_grace_s,
                                   self.config.routing, self.config.routing_balance_margin)
        self.engine.router.on_route = lambda engine, reason: self.metrics.routing_decisions.labels(engine, reason).inc()
        await self.engine.start()
        log.info("gateway %s serving %s", self.config.gateway_id, self.served_model_name)
        try:
            yield
        finally:
            await self.engine.close()

    def drain(self) -> None:
        """Shutting down: admit nothing more; fail what is still in flight after drain_timeout_s.
        Safe to call from a signal handler."""
        if self.draining or self._loop is None:
            return
        self.draining = True  # a signal handler may call this: the rest runs on the loop
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._fail_after_drain()))

    async def _fail_after_drain(self) -> None:
        log.info("draining: requests in flight have %g s to finish", self.config.drain_timeout_s)
        await asyncio.sleep(self.config.drain_timeout_s)
        if self.engine is not None:
            self.engine.fail_all(SHUTTING_DOWN)

    # ------------------------------------------------------------------ the models served
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        loras = self.loras.cards(self.created) if self.loras is not None else []
        return JSONResponse({"object": "list", "data": [self._card(), *loras]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        lora = self._check_model(request.path_params["model"])
        return JSONResponse(self._card() if lora is None else self.loras.card(lora.lora_name, self.created))

    def _card(self) -> dict:
        return {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "pagoda"}

    # ------------------------------------------------------------------ pooling
    def pooling(self, route):
        async def endpoint(request: Request) -> Response:
            try:
                return await route(self, request)
            except ClientDisconnect:
                return Response(status_code=499)
            except pooling_api.ClientLeft:  # the sub-requests were aborted
                return Response(status_code=499)
            except EngineError as exc:
                return engine_error_response(exc)
        return endpoint

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    # ------------------------------------------------------------------ the agents' APIs (translations to chat)
    async def responses(self, request: Request) -> Response:
        return await responses_api.create(self, request)

    async def response(self, request: Request) -> Response:
        self._authorize(request)
        return await responses_api.retrieve(self, request)

    async def messages(self, request: Request) -> Response:
        return await messages_api.create(self, request)

    async def count_tokens(self, request: Request) -> Response:
        return await messages_api.count_tokens(self, request)

    async def tokenize_chat(self, body: dict) -> list[int]:
        """A chat body's prompt, as a generation would tokenize it (its model checked)."""
        self._check_model(body.get("model"))
        return (await asyncio.to_thread(self._parse, "chat", body)).prompts[0]

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            run = await self.start(request, kind)
        except ClientDisconnect:  # left while sending the body: nothing was submitted
            return Response(status_code=499)
        if run.parsed.stream:
            return event_stream(self._stream(run), run.generation)
        try:
            body = await self.whole(request, run)
        except EngineError as exc:
            return engine_error_response(exc)
        return Response(status_code=499) if body is None else JSONResponse(body)

    async def read_json(self, request: Request) -> dict:
        """The checks before a body is read (open, API key), then the body as a JSON object."""
        self._check_open()
        self._authorize(request)
        return parse_json(await self._read_body(request))

    async def start(self, request: Request, kind: str, body: dict | None = None) -> Run:
        """Check, parse, admit and submit a generation: the request's own body, or `body` (a chat body
        the Responses and Messages APIs translated theirs into, read with read_json)."""
        arrival_time, arrival = time.time(), time.monotonic()
        if body is None:
            body = await self.read_json(request)
        lora = self._check_model(body.get("model"))
        if self.pooler is not None:
            raise bad_request(f"the model {self.served_model_name!r} is a pooling model: it serves "
                              f"{', '.join(POOLING_ROUTES)}, not generation", "model", "model_not_generative")
        parsed = await asyncio.to_thread(self._parse, kind, body)  # a long prompt must not stall streams
        statuses = await self._statuses()
        self._check_admissible(parsed, self._ready(statuses))
        self._admit(statuses, sum(len(p) for p in parsed.prompts))
        model = self.served_model_name if lora is None else lora.lora_name
        shape = ResponseShape.new(kind, model, parsed.logprobs, self.token_text,
                                  request_id(request), parsed.prompt_logprobs)
        echoes = await asyncio.to_thread(self._echoes, parsed) if parsed.echo else None
        requests, choices = self._sub_requests(shape.id, parsed, arrival_time, arrival, echoes, lora)
        generation = await self._submit(requests)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in parsed.prompts))
        self.metrics.size_token_buckets(statuses)
        return Run(shape, parsed, generation, choices, arrival + self.config.request_timeout_s)

    def _echoes(self, parsed: ParsedRequest) -> list[Echo]:
        """Each prompt's echoed text (completions `echo`), decoded as the choices' text is."""
        return [Echo.of(self.tokenizer, prompt, parsed.skip_special_tokens) for prompt in parsed.prompts]

    def _parse(self, kind: str, body: dict) -> ParsedRequest:
        """The request, tokenized, and its structured output checked by the worker's rule (in a thread)."""
        parse = parse_completion if kind == "completion" else parse_chat
        parsed = parse(body, self.encoder, self.vocab_size, self.default_sampling_params)
        try:
            self.structured.check(parsed.params.structured_output, parsed.structured_param)
        except InvalidField as exc:
            raise bad_request(str(exc), exc.param) from None
        return parsed

    def _sub_requests(
        self, response_id: str, parsed: ParsedRequest, arrival_time: float, arrival: float,
        echoes: list[Echo] | None = None, lora: LoRARequest | None = None,
    ) -> tuple[list[GenerateRequest], list[ChoiceState]]:
        """One request per prompt, `<response id>-<prompt index>`, whose n outputs are the prompt's
        choices: one sequence group in the scheduler, its samples forked from the prompt's blocks
        (each streams and finishes on its own), or, when the outputs are chosen at the end
        (best_of > n, beam search), the n best, sent whole."""
        hidden = self.eos_token_ids | frozenset(parsed.params.stop_token_ids)
        requests, choices = [], []
        for p, prompt in enumerate(parsed.prompts):
            request_id = f"{response_id}-{p}"
            requests.append(GenerateRequest(request_id, prompt, parsed.params, self.engine.reply_stream, arrival_time,
                                            lora, parsed.mm_items))
            for i in range(parsed.n):
                detokenizer = IncrementalDetokenizer(self.tokenizer, parsed.skip_special_tokens,
                                                     parsed.skipped_token_ids)
                tools = ToolCallStream(parsed.tool_parser, parsed.max_tool_calls) if parsed.tool_parser else None
                reasoning = ReasoningStream(parsed.reasoning_parser, parsed.thinking) if parsed.reasoning_parser \
                    else None
                choices.append(ChoiceState(
                    p * parsed.n + i, request_id, detokenizer, parsed.stop, hidden, arrival, i, parsed.chosen_at_end,
                    num_prompt_tokens=len(prompt), echo=echoes[p] if echoes else None,
                    prompt_token_ids=prompt if parsed.prompt_logprobs is not None else [], tools=tools,
                    reasoning=reasoning,
                ))
        return requests, choices

    async def whole(self, request: Request, run: Run) -> dict | None:
        """The whole body once every choice has finished, or None when the client left first (then
        the requests are aborted); EngineError when the generation failed."""
        collect = asyncio.ensure_future(self._drain(run.generation, run.choices, run.deadline))
        disconnect = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return None  # nobody reads it
            collect.result()
        finally:
            for task in (collect, disconnect):
                task.cancel()
            run.generation.close()
        return run.shape.body(run.choices, usage(run.parsed.prompts, run.choices))

    async def _drain(self, generation: Generation, choices: list[ChoiceState], deadline: float) -> None:
        async for _ in self._events(generation, choices, deadline):
            pass

    async def _stream(self, run: Run):
        try:
            async with contextlib.aclosing(self.chunks(run)) as chunks:
                async for chunk in chunks:
                    yield sse(chunk)
        except EngineError as exc:
            yield sse(exc.body())
        yield SSE_DONE

    async def chunks(self, run: Run):
        """The stream's chunks as dicts (the usage chunk last, when asked); EngineError when the
        generation fails. The generation is closed however the stream ends."""
        shape, include_usage = run.shape, run.parsed.include_usage
        try:
            if shape.kind == "chat":
                for c in run.choices:
                    yield shape.chunk_body(shape.choice_delta(c.index, "", [], None, role=True), include_usage)
            async for choice in self._events(run.generation, run.choices, run.deadline):
                for delta in shape.choice_deltas(choice, *choice.take_delta()):
                    # in the first chunk after they came (the request's first event brings them)
                    if shape.prompt_logprobs is not None and choice.prompt_logprobs is not None \
                            and not choice.prompt_logprobs_sent:
                        choice.prompt_logprobs_sent = True
                        delta["prompt_logprobs"] = shape.choice_prompt_logprobs(choice)
                    yield shape.chunk_body(delta, include_usage)
            if include_usage:
                yield shape.chunk_body(None, True, usage(run.parsed.prompts, run.choices))
        finally:  # also on a disconnect, which cancels the stream at its await
            run.generation.close()

    async def _events(self, generation: Generation, choices: list[ChoiceState], deadline: float):
        """Each choice as an event changes it, until every choice has finished. An event goes to the
        choice of its (request id, output index); an "error" or "abort" event ends the whole request."""
        by_output = {(c.request_id, c.output_index): c for c in choices}
        by_request: dict[str, list[ChoiceState]] = {}
        for c in choices:
            by_request.setdefault(c.request_id, []).append(c)
        while generation.unfinished:
            try:
                event = await generation.next_event(deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise EngineError(
                    f"the request did not finish within request_timeout_s={self.config.request_timeout_s:g} s",
                    504, "timeout") from None
            scheduled = scheduled_monotonic(event.scheduled_at, time.time(), time.monotonic())
            if scheduled is not None:  # the request's first token-bearing event: when it was first scheduled
                for c in by_request.get(event.request_id, ()):
                    c.scheduled_at = scheduled
                    c.num_cached_tokens = event.num_cached_tokens
            if event.prompt_logprobs is not None:  # on one output's event: every choice of the request reports them
                for c in by_request.get(event.request_id, ()):
                    c.prompt_logprobs = event.prompt_logprobs
            if event.finish_reason in ("error", "abort"):
                choice = next((c for c in by_request.get(event.request_id, ()) if not c.finished), None)
            else:
                choice = by_output.get((event.request_id, event.index))
            if choice is None or choice.finished:
                continue
            self._observe_tokens(choice, event)
            choice.add(event)
            if choice.finished:
                failed = choice.finish_reason in ("error", "abort")
                # a stop string ends a streamed output early; an output chosen at the end came whole
                stopped_early = choice.stopped_by_string and not choice.chosen_at_end
                if failed or all(c.finished for c in by_request[choice.request_id]):
                    generation.finish(choice.request_id, abort=stopped_early)
                elif stopped_early:  # that sample alone: the request's others go on
                    generation.abort_output(choice.request_id, choice.output_index)
                self._observe_finish(choice)
                if failed:
                    raise engine_failure(choice.finish_reason, choice.error)
            yield choice

    def _observe_tokens(self, choice: ChoiceState, event) -> None:
        if not event.token_ids:
            return
        now, m = time.monotonic(), self.metrics
        if choice.first_token_at is None:
            choice.first_token_at = now
            m.time_to_first_token.observe(now - choice.arrival)
        else:
            m.observe_tokens((now - choice.last_token_at) / len(event.token_ids), len(event.token_ids))
        choice.last_token_at = now

    def _observe_finish(self, choice: ChoiceState) -> None:
        self.metrics.observe_finished(FinishedOutput(
            choice.finish_reason, choice.arrival, time.monotonic(), choice.scheduled_at, choice.first_token_at,
            choice.last_token_at, choice.num_prompt_tokens, choice.num_tokens))

    # ------------------------------------------------------------------ checks, in order
    def _check_open(self) -> None:
        if self.draining:
            raise unavailable(SHUTTING_DOWN)

    def _authorize(self, request: Request) -> None:
        """The API key as 'Authorization: Bearer KEY', or as Anthropic's 'x-api-key: KEY'."""
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return _check_key(token.strip(), key)
        if "x-api-key" in request.headers:
            return _check_key(request.headers["x-api-key"], key)
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key")

    def authorize_dashboard(self, request: Request) -> None:
        """The API key, if the gateway has one, in the header or else as `?api_key=` (a browser's
        EventSource, and a page opened from a link, cannot send headers)."""
        key = self.config.api_key
        if key is None or "authorization" in request.headers:
            return self._authorize(request)
        given = request.query_params.get("api_key")
        if given is None:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' or add "
                                "?api_key=<key> to the URL", code="invalid_api_key")
        _check_key(given, key)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise bad_request("Content-Length must be a number of bytes")
            if int(length) > limit:
                raise too_large
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise bad_request(f"Content-Type must be application/json, got {media_type or 'none'!r}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: object) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for any other."""
        if model is None or model == self.served_model_name:
            return None
        if self.loras is not None and isinstance(model, str) and model in self.loras.adapters:
            return self.loras.adapters[model]
        adapters = f" and the LoRA adapters {sorted(self.loras.adapters)}" if self.loras and self.loras.adapters else ""
        raise APIError(404, f"the model {model!r} does not exist; this server serves {self.served_model_name!r}"
                            f"{adapters}", param="model", code="model_not_found")

    async def _statuses(self, fresh: bool = False) -> list[SchedulerStatus]:
        try:
            return await self.engine.statuses(fresh=fresh)
        except Exception as exc:
            raise unavailable(f"Redis is unreachable ({exc}); the gateway cannot queue requests") from exc

    @staticmethod
    def _ready(statuses: list[SchedulerStatus]) -> list[SchedulerStatus]:
        ready = [s for s in statuses if s.workers_ready]
        if not ready:
            what = "no scheduler is running" if not statuses else "no scheduler has its workers ready yet"
            raise unavailable(f"{what}: start one with its workers (`pagoda up`), or wait while the model loads")
        return ready

    @staticmethod
    def _check_admissible(parsed: ParsedRequest, ready: list[SchedulerStatus]) -> None:
        """400 for a request no ready scheduler could ever serve (the scheduler's own rule)."""
        limits = AdmissionLimits.strictest(ready)
        where = "messages" if parsed.kind == "chat" else "prompt"
        for prompt in parsed.prompts:
            rejection = check_admissible(len(prompt), parsed.params, limits, where)
            if rejection is not None:
                raise bad_request(rejection.message, rejection.param, rejection.code)

    def _admit(self, statuses: list[SchedulerStatus], num_tokens: int) -> None:
        """429 when the queue is full: --max-num-queued-requests, or --max-num-queued-tokens with this
        request's `num_tokens` on top, or when its predicted wait is past --ttft-slo-ms. A scheduler
        counts only what it has read from the stream, and this gateway's submitted-but-unstarted
        requests also cover what still sits in Redis."""
        engine, config = self.engine, self.config
        pending = max(sum(s.num_waiting for s in statuses), engine.num_unstarted) + engine.num_unsubmitted
        if pending >= config.max_pending_requests:
            self.metrics.requests_rejected.labels("max_num_queued_requests").inc()
            raise APIError(
                429, f"the server is busy: {pending} requests are already waiting; retry shortly",
                "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})
        if config.max_num_queued_tokens is None and config.ttft_slo_ms is None:
            return
        queued = (max(sum(s.num_waiting_tokens for s in statuses), engine.num_unstarted_tokens)
                  + engine.num_unsubmitted_tokens)
        bound = config.max_num_queued_tokens
        if bound is not None and queued and queued + num_tokens > bound:  # alone, a request is never refused
            self.metrics.requests_rejected.labels("max_num_queued_tokens").inc()
            raise APIError(
                429, f"the server is busy: {queued} prompt tokens are already waiting and this request has "
                f"{num_tokens} (--max-num-queued-tokens {config.max_num_queued_tokens}); retry shortly",
                "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})
        if config.ttft_slo_ms is not None:
            self._check_ttft_slo(statuses, queued, num_tokens)

    def _check_ttft_slo(self, statuses: list[SchedulerStatus], queued: int, num_tokens: int) -> None:
        """429 when the predicted wait, the `queued` prompt tokens ahead and this request's own over
        the summed prefill rate of the groups whose workers are ready, passes --ttft-slo-ms (a
        request into an empty queue passes; one whose own prefill alone passes it is refused while
        anything waits)."""
        rate = sum(s.prefill_tokens_per_s for s in statuses if s.workers_ready and s.prefill_tokens_per_s > 0)
        if not queued or not rate:
            return
        predicted_ms = round((queued + num_tokens) / rate * 1000)
        if predicted_ms > self.config.ttft_slo_ms:
            self.metrics.requests_rejected.labels("ttft_slo_ms").inc()
            raise APIError(
                429, f"the server is busy: {queued} prompt tokens are waiting, and this request would wait about "
                f"{predicted_ms} ms for its first token (--ttft-slo-ms {self.config.ttft_slo_ms:g}); retry shortly",
                "rate_limit_error", code="queue_full",
                headers={"Retry-After": str(max(RETRY_AFTER_QUEUE_FULL_S, -(-predicted_ms // 1000)))})

    async def _submit(self, requests: list[GenerateRequest]) -> Generation:
        try:
            return await self.engine.submit(requests)
        except Exception as exc:
            raise unavailable(f"could not queue the request in Redis ({exc})") from exc


@dataclass(slots=True)
class Run:
    """One admitted generation: what its bodies share, the parsed request, its choices, its deadline."""

    shape: ResponseShape
    parsed: ParsedRequest
    generation: Generation
    choices: list[ChoiceState]
    deadline: float  # time.monotonic()


def engine_error_response(exc: EngineError) -> JSONResponse:
    retry = {"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)} if exc.status == 503 else None  # as every 503
    return JSONResponse(exc.body(), status_code=exc.status, headers=retry)


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _check_key(given: str, key: str) -> None:
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


async def _api_error(request: Request, exc: APIError) -> Response:
    """An APIError raised by a route: the OpenAI error object and its status."""
    return error_response(exc)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    body = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), kind).body()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Starlette answers this one outside every middleware: the request id is set here."""
    log.exception("unexpected error on %s", request.url.path)
    body = APIError(500, f"internal error: {exc}", "server_error", code="internal_error").body()
    return JSONResponse(body, status_code=500, headers={REQUEST_ID: request_id(request, echo=True)})


def request_id(request: Request, echo: bool = False) -> str:
    """This request's id (RequestIds sets it), or with `echo` the client's own X-Request-Id if it sent one."""
    return echo and request.headers.get(REQUEST_ID) or request.scope["state"]["request_id"]


class RequestIds:
    """ASGI middleware: give each request an id and answer with X-Request-Id (the client's, echoed,
    when it sent one)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["request_id"] = uuid.uuid4().hex
        value = request_id(Request(scope), echo=True).encode("latin-1")

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class CountResponses:
    """ASGI middleware: count responses by route and status (`pagoda:http_requests_total`)."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in ROUTES or path in DASHBOARD_ROUTES or path in AGENT_ROUTES:
            route = path
        elif path.startswith("/v1/responses/"):
            route = "/v1/responses/{response_id}"
        elif path.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        else:
            route = "/dashboard/static/{file}" if path.startswith("/dashboard/static/") else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
