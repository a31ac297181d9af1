"""The gateway over a real redis-server, with a scripted scheduler standing in for the real one.

The fake scheduler reads `pagoda:requests` as the consumer group does and answers on the
request's reply stream: by default it echoes the prompt's tokens back one per event, for each of
the request's n outputs (so the expected text of every choice is the prompt's), or it plays a
script chosen by a marker in the prompt.
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import pytest
import redis
from starlette.testclient import TestClient

try:  # the client the openai package and starlette's TestClient use now; httpx before it
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from common import streams
from common.config import GatewayConfig
from common.protocol import (
    GenerateRequest, HeldRequests, RequestEvent, SamplingParams, SchedulerStatus, decode, encode,
)
from common.redis_server import RedisServer, free_port, stable_port
from common.tokenizer import load_tokenizer
from gateway.app import create_app
from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import PromptEncoder
from tests.stack import serve_app

API_KEY = "sk-test"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
MAX_PENDING = 64
TIMEOUT_S = 3.0
HELLO = "Hello world, this is a test"  # tokens: Hello| world|,| this| is| a| test
EMOJI_TEXT = "I like 😀 a lot"  # 😀 is split across two tokens


def status(**changes) -> SchedulerStatus:
    fields = dict(
        scheduler_id="fake", model="default", max_model_len=MAX_MODEL_LEN, block_size=16, num_gpu_blocks=64,
        max_request_tokens=1000,
        workers_ready=True, num_running=1, num_waiting=2, num_swapped=0, kv_cache_usage=0.25,
        num_preemptions_total=3, prefix_cache_queries_total=10, prefix_cache_hits_total=4, updated_at=time.time(),
    )
    fields.update(changes)
    return SchedulerStatus(**fields)


class FakeScheduler:
    def __init__(self, url: str, tokenizer) -> None:
        self.redis = redis.Redis.from_url(url)
        self.tokenizer = tokenizer
        self.requests: dict[str, GenerateRequest] = {}
        self.scripts: dict[str, list[RequestEvent] | str] = {}  # marker in the prompt -> events or a mode
        self.stopping = threading.Event()
        self.redis.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="$", mkstream=True)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def publish(self, scheduler_id: str = "fake", **changes) -> None:
        key = streams.status_key(scheduler_id)
        self.redis.set(key, encode(status(scheduler_id=scheduler_id, **changes)), px=600_000)

    def _run(self) -> None:
        while not self.stopping.is_set():
            replies = self.redis.xreadgroup(streams.SCHEDULER_GROUP, "fake", {streams.REQUESTS: ">"}, block=100)
            for _, entries in replies or []:
                for entry_id, fields in entries:
                    request = decode(fields[streams.FIELD])
                    self.requests[request.request_id] = request
                    threading.Thread(target=self._answer, args=(request, entry_id), daemon=True).start()

    def aborted(self, request_id: str, index: int | None = None) -> bool:
        """Whether the gateway aborted the request (index None: as a whole), or only its output `index`."""
        return any(f[streams.ABORT_FIELD].decode() == request_id and _abort_index(f) == index
                   for _, f in self.redis.xrange(streams.ABORTS))

    def _send(self, request: GenerateRequest, event: RequestEvent) -> None:
        self.redis.xadd(request.reply_stream, {streams.FIELD: encode(event)})

    def _answer(self, request: GenerateRequest, entry_id: bytes) -> None:
        prompt_text = self.tokenizer.decode(request.prompt_token_ids)
        script = next((s for marker, s in self.scripts.items() if marker in prompt_text), "echo")
        rid = request.request_id
        if script == "silent":  # nothing until aborted
            while not self.aborted(rid) and not self.stopping.is_set():
                time.sleep(0.02)
        elif script == "slow":  # a token every 20 ms until aborted
            for _ in range(250):
                if self.aborted(rid) or self.stopping.is_set():
                    break
                self._send(request, RequestEvent(rid, [28], None))
                time.sleep(0.02)
        elif script == "echo":
            self._echo(request)
        else:
            for event in script:
                self._send(request, dataclasses.replace(event, request_id=rid))
        self.redis.xack(streams.REQUESTS, streams.SCHEDULER_GROUP, entry_id)

    def _echo(self, request: GenerateRequest) -> None:
        """The prompt's tokens back, one per event and output (a step of the n outputs at a time, as
        the scheduler steps a group), each with logprob -0.25 * position when asked."""
        params, prompt = request.sampling_params, request.prompt_token_ids
        count = min(params.max_tokens or len(prompt), len(prompt))
        for i, token in enumerate(prompt[:count]):
            logprobs = None
            if params.logprobs is not None:
                top = [[token, -0.25 * (i + 1)]] + [[token + j, -3.0 - j] for j in range(1, params.logprobs)]
                logprobs = [[-0.25 * (i + 1), top[:params.logprobs]]]
            finish = None
            if i == count - 1:
                finish = "length" if params.max_tokens == count else "stop"
            for index in range(params.n):
                self._send(request, RequestEvent(request.request_id, [token], logprobs, finish, index=index))


def _abort_index(fields: dict) -> int | None:
    index = fields.get(streams.ABORT_INDEX_FIELD)
    return None if index is None else int(index)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def fake(redis_url, tokenizer):
    scheduler = FakeScheduler(redis_url, tokenizer)
    scheduler.publish()
    scheduler.thread.start()
    yield scheduler
    scheduler.stopping.set()
    scheduler.thread.join(5)


@pytest.fixture(scope="module")
def gateway(redis_url, tokenizer, fake):
    """The app under uvicorn on a free local port, as `pagoda gateway` runs it."""
    config = GatewayConfig(redis_url=redis_url, port=free_port(), api_key=API_KEY,
                           max_pending_requests=MAX_PENDING, request_timeout_s=TIMEOUT_S)
    app = create_app(config, tokenizer=tokenizer)
    with serve_app(app, config.port):
        app.state.gateway.engine.status_ttl_s = 0.0  # every request sees the status the test just wrote
        yield app.state.gateway


@pytest.fixture(scope="module")
def base_url(gateway):
    return f"http://127.0.0.1:{gateway.config.port}"


@pytest.fixture()
def client(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10) as c:
        yield c


def sse_events(response) -> list:
    """The data payloads of an SSE response, parsed; '[DONE]' stays a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def stream(client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def without_id(body: dict) -> dict:
    assert isinstance(body.pop("created"), int)
    return {k: v for k, v in body.items() if k != "id"}


def wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# ----------------------------------------------------------------------------- bodies


def test_completion_returns_the_full_openai_body(client, fake):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": HELLO, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert without_id(body) == {
        "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": "Hello world,", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    sent = fake.requests[body["id"] + "-0"]
    assert sent.sampling_params.temperature == 0.0 and sent.sampling_params.max_tokens == 3
    assert sent.reply_stream.startswith(streams.REPLIES_PREFIX)


def test_chat_returns_the_full_openai_body_and_defaults_max_tokens_to_the_context(client, fake, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    prompt = PromptEncoder(tokenizer).encode_chat([{"role": "user", "content": "Hi"}])
    assert without_id(body) == {
        "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "system\nYou"}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    body = r.json()
    assert fake.requests[body["id"] + "-0"].sampling_params.max_tokens is None  # the rest of the context
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(prompt, skip_special_tokens=True)
    assert body["choices"][0]["finish_reason"] == "stop"


def test_models_lists_the_served_model(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [(MODEL, "model", "pagoda")]


def test_models_retrieve_answers_the_served_model_and_404_for_another(client, gateway):
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200
    assert r.json() == {"id": MODEL, "object": "model", "created": gateway.created, "owned_by": "pagoda"}
    for unknown in ("gpt-4", "HuggingFaceTB/SmolLM2-135M-Instruct"):  # an id may hold a '/'
        r = client.get(f"/v1/models/{unknown}")
        assert r.status_code == 404
        assert r.json() == {"error": {
            "message": f"the model {unknown!r} does not exist; this server serves 'SmolLM2-135M-Instruct'",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert client.get(f"/v1/models/{MODEL}", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_every_answer_carries_the_request_id_or_echoes_the_clients(client):
    r = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"].removeprefix("cmpl-")
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 1, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert r.headers["x-request-id"] == json.loads(first[len("data: "):])["id"].removeprefix("chatcmpl-")
    ids = [client.get("/health").headers["x-request-id"] for _ in range(2)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]
    mine = {"X-Request-Id": "client-trace-42"}
    answers = [
        client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1}, headers=mine),  # 200
        client.post("/v1/completions", json={"prompt": "x", "n": 0}, headers=mine),  # 400
        client.post("/v1/completions", json={"prompt": "x"}, headers={**mine, "Authorization": "Bearer no"}),  # 401
        client.get("/v1/models/gpt-4", headers=mine),  # 404
        client.get("/v1/nothing", headers=mine),  # 404, no route
        client.get("/v1/completions", headers=mine),  # 405
        client.get("/health", headers=mine), client.get("/metrics", headers=mine),
        client.get("/openapi.json", headers=mine), client.get("/v1/models", headers=mine),
    ]
    assert [r.status_code for r in answers] == [200, 400, 401, 404, 404, 405, 200, 200, 200, 200]
    assert [r.headers.get_list("x-request-id") for r in answers] == [["client-trace-42"]] * len(answers)


def test_n2_is_one_request_carrying_n_and_the_requests_seed(client, fake):
    """The samples are one sequence group; the scheduler and worker derive sample i's seed
    (sample_seed), as offline."""
    r = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2, "n": 2, "seed": 7})
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Hello world"), (1, "Hello world")]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 0}}
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.request_id == body["id"] + "-0"
    assert request.sampling_params == SamplingParams(n=2, seed=7, max_tokens=2)


def test_a_seed_may_use_all_64_bits(client, fake):
    """No room is kept above the seed for its samples any more: sample_seed wraps."""
    body = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1, "n": 3, "seed": 2**63 - 1}).json()
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.sampling_params.seed == 2**63 - 1 and request.sampling_params.n == 3


def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(client):
    r = client.post("/v1/completions", json={"prompt": ["Hello world", "One two three"], "max_tokens": 5})
    body = r.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello world", "stop"), (1, "One two three", "stop")]
    assert body["usage"]["prompt_tokens"] == 2 + 3


def test_token_id_prompts_are_accepted(client, tokenizer):
    ids = tokenizer.encode(HELLO)
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2}).json()
    assert body["choices"][0]["text"] == "Hello world"
    body = client.post("/v1/completions", json={"prompt": [ids[:2], ids[2:4]], "max_tokens": 2}).json()
    assert [c["text"] for c in body["choices"]] == ["Hello world", ", this"]


def test_completion_logprobs_have_the_legacy_shape(client, tokenizer):
    body = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2, "logprobs": 2}).json()
    hello, world = tokenizer.encode("Hello world")
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hello", " world"],
        "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{"Hello": -0.25, tokenizer.decode([hello + 1]): -4.0},
                         {" world": -0.5, tokenizer.decode([world + 1]): -4.0}],
        "text_offset": [0, 5],
    }


def test_chat_logprobs_have_the_content_shape(client):
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [
        {"token": "<|im_start|>", "logprob": -0.25, "bytes": list(b"<|im_start|>"),
         "top_logprobs": [{"token": "<|im_start|>", "logprob": -0.25, "bytes": list(b"<|im_start|>")}]},
        {"token": "system", "logprob": -0.5, "bytes": list(b"system"),
         "top_logprobs": [{"token": "system", "logprob": -0.5, "bytes": list(b"system")}]},
    ]


# ----------------------------------------------------------------------------- streaming


def test_completion_stream_is_openai_chunks_ending_in_done(client):
    events = stream(client, "/v1/completions", {"prompt": HELLO, "max_tokens": 3})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == MODEL and "usage" not in c for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " world", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": ",", "logprobs": None, "finish_reason": "length"}],
    ]


def test_chat_stream_starts_with_the_role_and_ends_with_a_usage_chunk(client):
    events = stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "system"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "\n"}, "logprobs": None, "finish_reason": "length"}],
    ]  # the first token, <|im_start|>, is special: a chunk with no text is not sent
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "chat.completion.chunk"
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3


def test_stream_with_n2_interleaves_both_choices(client):
    events = stream(client, "/v1/completions", {"prompt": HELLO, "max_tokens": 2, "n": 2})
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in events[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hello world", 1: "Hello world"} and finishes == {0: "length", 1: "length"}


def test_32_concurrent_streams_each_get_their_own_text(base_url, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10) as c:
            events = stream(c, "/v1/completions", {"prompt": prompt(i), "max_tokens": 5})
        return "".join(e["choices"][0]["text"] for e in events[:-1])

    def prompt(i: int) -> str:
        return f"Request number {i} says hello"

    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, range(32)))
    assert texts == [tokenizer.decode(tokenizer.encode(prompt(i))[:5]) for i in range(32)]
    assert len(set(texts)) == 32


def test_a_character_split_across_two_tokens_is_emitted_whole(client, fake, tokenizer):
    ids = tokenizer.encode(EMOJI_TEXT)
    assert "\ufffd" in tokenizer.decode(ids[2:3])  # the premise: a token holding half of 😀
    fake.scripts["@emoji@"] = [RequestEvent("", [t], None) for t in ids] + [RequestEvent("", [], None, "stop")]
    events = stream(client, "/v1/completions", {"prompt": "@emoji@", "max_tokens": 50})
    texts = [c["choices"][0]["text"] for c in events[:-1]]
    assert "".join(texts) == EMOJI_TEXT
    assert " 😀" in texts and not any("\ufffd" in t for t in texts)


def test_an_event_sent_twice_is_taken_once(client, fake):
    """A scheduler's Redis write retried after a timeout can land twice: its seq gives it away."""
    fake.scripts["@twice@"] = [RequestEvent("", [19556], None, seq=1), RequestEvent("", [905], None, seq=2),
                               RequestEvent("", [905], None, seq=2), RequestEvent("", [28], None, "length", seq=3)]
    body = client.post("/v1/completions", json={"prompt": "@twice@", "max_tokens": 3}).json()
    assert body["choices"][0]["text"] == "Hello world,"
    assert body["usage"]["completion_tokens"] == 3


def test_a_stop_string_truncates_the_text_and_aborts_the_request(client, fake):
    body = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 7, "stop": [" this", "zzz"]}).json()
    assert body["choices"][0]["text"] == "Hello world,"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4  # the token that completed the stop string counts
    assert wait_for(lambda: fake.aborted(body["id"] + "-0"))


def test_a_streamed_stop_string_never_leaks_its_start(client, fake):
    events = stream(client, "/v1/completions", {"prompt": HELLO, "max_tokens": 7, "stop": "is a"})
    texts = [c["choices"][0]["text"] for c in events[:-1]]
    assert "".join(texts) == "Hello world, this "
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    assert wait_for(lambda: fake.aborted(events[0]["id"] + "-0"))


# Samples of one prompt (n > 1, no best_of) are one request whose outputs stream side by side, each
# event carrying its output's index; a stop string found in one ends that output alone.
SAMPLES = [  # output 0 meets " this" at its 4th token, while output 1 goes on to max_tokens
    RequestEvent("", [19556], None, index=0), RequestEvent("", [2705], None, index=1),
    RequestEvent("", [905], None, index=0), RequestEvent("", [827], None, index=1),
    RequestEvent("", [28], None, index=0), RequestEvent("", [1296], None, index=1),
    RequestEvent("", [451], None, index=0), RequestEvent("", [28], None, index=1),
    RequestEvent("", [314], None, index=0), RequestEvent("", [451], None, "length", index=1),
]


def test_a_stop_string_in_one_sample_ends_that_sample_alone(client, fake):
    fake.scripts["@samples@"] = SAMPLES
    body = client.post("/v1/completions", json={"prompt": "@samples@", "n": 2, "max_tokens": 5,
                                                "stop": [" this is"]}).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello world,", "stop"), (1, "One two three, this", "length")]
    assert body["usage"]["completion_tokens"] == 5 + 5
    request_id = body["id"] + "-0"
    assert wait_for(lambda: fake.aborted(request_id, index=0))
    assert not fake.aborted(request_id)  # the request as a whole ran to its end


def test_a_streamed_stop_string_in_one_sample_ends_that_sample_alone(client, fake):
    fake.scripts["@samples-stream@"] = SAMPLES
    events = stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "@samples-stream@"}], "n": 2, "max_tokens": 5, "stop": " this",
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in events[2:-2]:  # after the two role chunks, before the usage chunk
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hello world,", 1: "One two three,"} and finishes == {0: "stop", 1: "stop"}
    assert events[-2]["usage"]["completion_tokens"] == 4 + 5
    request_id = events[0]["id"] + "-0"
    assert wait_for(lambda: fake.aborted(request_id, index=0))
    assert wait_for(lambda: fake.aborted(request_id))  # output 1 stopped last: the rest of the request goes


def test_eos_is_counted_but_never_shown(client, fake, tokenizer):
    eos = tokenizer.eos_token_id
    fake.scripts["@eos@"] = [RequestEvent("", [19556], None), RequestEvent("", [eos], None, "stop")]
    body = client.post("/v1/completions", json={"prompt": "@eos@", "skip_special_tokens": False}).json()
    assert body["choices"][0]["text"] == "Hello"
    assert body["usage"]["completion_tokens"] == 2


def test_streamed_prompt_logprobs_go_to_each_choice_once_they_came_whichever_output_brought_them(
        client, fake, gateway, tokenizer):
    """Output 1's first chunk goes before the event that brings the prompt logprobs (output 0's):
    it has none, and its next chunk carries them; each choice gets them exactly once."""
    prompt = tokenizer.encode("@pl-order@")
    scored = [None] + [[-0.5 * i, 1, [[t, -0.5 * i]]] for i, t in enumerate(prompt) if i]
    fake.scripts["@pl-order@"] = [
        RequestEvent("", [19556], None, index=1), RequestEvent("", [19556], None, index=0, prompt_logprobs=scored),
        RequestEvent("", [905], None, "length", index=1), RequestEvent("", [905], None, "length", index=0)]
    events = stream(client, "/v1/completions", {"prompt": "@pl-order@", "n": 2, "max_tokens": 2,
                                                "prompt_logprobs": 1})
    expected = [None] + [{str(t): {"logprob": -0.5 * i, "rank": 1, "decoded_token": gateway.token_text(t)}}
                         for i, t in enumerate(prompt) if i]
    chunks = [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0].get("prompt_logprobs", "absent"))
              for c in events[:-1]]
    assert chunks == [(1, "Hello", "absent"), (0, "Hello", expected), (1, " world", expected), (0, " world", "absent")]
    assert events[-1] == "[DONE]"


# ----------------------------------------------------------------------------- best_of and beam search
# Such a request is one GenerateRequest per prompt; the scheduler sends its n outputs whole, in one
# step at the end, best first, each an event with its index, all its token ids and its finish_reason.

HELLO_IDS = [19556, 905, 28, 451, 314, 253, 1028]  # Hello| world|,| this| is| a| test
ONE_TWO_THREE = [2705, 827, 1296]  # One| two| three


def sent_requests(fake, response_id: str) -> dict[str, GenerateRequest]:
    return {rid: r for rid, r in list(fake.requests.items()) if rid.startswith(response_id + "-")}


def test_best_of_is_one_request_whose_n_outputs_are_the_choices(client, fake, tokenizer):
    eos = tokenizer.eos_token_id
    fake.scripts["@best-of@"] = [  # index 1 first: choices follow the index, not the arrival order
        RequestEvent("", ONE_TWO_THREE + [eos], None, "stop", index=1),
        RequestEvent("", HELLO_IDS[:5], None, "length", index=0),
    ]
    r = client.post("/v1/completions", json={"prompt": "@best-of@", "n": 2, "best_of": 4, "max_tokens": 5,
                                             "temperature": 0.8, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.request_id == body["id"] + "-0"
    assert request.sampling_params == SamplingParams(n=2, best_of=4, temperature=0.8, seed=3, max_tokens=5)
    prompt_tokens = len(tokenizer.encode("@best-of@"))
    assert without_id(body) == {
        "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": "Hello world, this is", "logprobs": None, "finish_reason": "length"},
                    {"index": 1, "text": "One two three", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 5 + 4, "total_tokens": prompt_tokens + 9, "prompt_tokens_details": {"cached_tokens": 0}},
    }  # every choice's tokens count, the hidden eos included


def test_best_of_with_logprobs_and_a_list_of_prompts(client, fake, tokenizer):
    fake.scripts["@best-of-lp@"] = [
        RequestEvent("", HELLO_IDS[:2], [[-0.5, [[19556, -0.5]]], [-1.0, [[905, -1.0]]]], "length", index=0),
        RequestEvent("", ONE_TWO_THREE[:2], [[-2.0, [[2705, -2.0]]], [-3.0, [[827, -3.0]]]], "length", index=1),
    ]
    r = client.post("/v1/completions", json={"prompt": ["@best-of-lp@ first", "@best-of-lp@ second"], "n": 2,
                                             "best_of": 3, "max_tokens": 2, "logprobs": 1})
    body = r.json()
    requests = sent_requests(fake, body["id"])
    assert sorted(requests) == [body["id"] + "-0", body["id"] + "-1"]  # one request per prompt
    assert [tokenizer.decode(requests[body["id"] + f"-{p}"].prompt_token_ids) for p in range(2)] == [
        "@best-of-lp@ first", "@best-of-lp@ second"]
    assert all(r.sampling_params.n == 2 and r.sampling_params.best_of == 3 and r.sampling_params.logprobs == 1
               for r in requests.values())
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hello world", "length"), (1, "One two", "length"), (2, "Hello world", "length"), (3, "One two", "length")]
    assert body["choices"][1]["logprobs"] == {"tokens": ["One", " two"], "token_logprobs": [-2.0, -3.0],
                                              "top_logprobs": [{"One": -2.0}, {" two": -3.0}], "text_offset": [0, 3]}
    assert body["usage"]["completion_tokens"] == 8


def test_best_of_equal_to_n_is_n_streamed_samples(client, fake):
    body = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2, "n": 2, "best_of": 2}).json()
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.sampling_params.n == 2 and request.sampling_params.best_of is None
    assert [c["text"] for c in body["choices"]] == ["Hello world", "Hello world"]


def test_beam_search_params_reach_the_scheduler_and_chat_gets_the_beams_best_first(client, fake, tokenizer):
    fake.scripts["@beam@"] = [RequestEvent("", HELLO_IDS[:3], None, "length", index=0),
                              RequestEvent("", ONE_TWO_THREE, None, "length", index=1)]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "@beam@"}], "n": 2, "best_of": 3, "max_tokens": 3,
        "use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"})
    assert r.status_code == 200, r.text
    body = r.json()
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.sampling_params == SamplingParams(
        n=2, beam_width=3, length_penalty=0.5, early_stopping="never", temperature=0.0, max_tokens=3)
    prompt_tokens = len(request.prompt_token_ids)
    assert without_id(body) == {
        "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world,"}, "logprobs": None,
                     "finish_reason": "length"},
                    {"index": 1, "message": {"role": "assistant", "content": "One two three"}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6, "prompt_tokens_details": {"cached_tokens": 0}},
    }


def test_the_beam_width_is_n_without_best_of(client, fake):
    fake.scripts["@beam-n@"] = [RequestEvent("", [330], None, "length", index=0),
                                RequestEvent("", [389], None, "length", index=1)]
    body = client.post("/v1/completions", json={"prompt": "@beam-n@", "n": 2, "max_tokens": 1, "temperature": 0,
                                                "use_beam_search": True, "early_stopping": True}).json()
    (request,) = sent_requests(fake, body["id"]).values()
    assert request.sampling_params == SamplingParams(n=2, beam_width=2, early_stopping=True, temperature=0.0,
                                                     max_tokens=1)
    assert [c["text"] for c in body["choices"]] == [" A", " B"]


def test_a_stop_string_truncates_each_whole_output_without_an_abort(client, fake):
    fake.scripts["@beam-stop@"] = [RequestEvent("", HELLO_IDS, None, "length", index=0),
                                   RequestEvent("", ONE_TWO_THREE, None, "length", index=1)]
    body = client.post("/v1/completions", json={"prompt": "@beam-stop@", "n": 2, "max_tokens": 7,
                                                "use_beam_search": True, "stop": [" this", " four"]}).json()
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [
        ("Hello world,", "stop"), ("One two three", "length")]
    assert body["usage"]["completion_tokens"] == 4 + 3  # up to the token that completed the stop string
    time.sleep(0.2)
    assert not fake.aborted(body["id"] + "-0")  # the request was already over


@pytest.mark.parametrize("reason, status, message, code", [
    ("error", 500, "generation failed: boom", "engine_error"),
    ("abort", 500, "the request was aborted by the scheduler", "aborted"),
])
def test_an_error_or_abort_event_ends_every_output_of_the_request(client, fake, reason, status, message, code):
    fake.scripts[f"@best-of-{reason}@"] = [RequestEvent("", [], None, reason, "boom" if reason == "error" else None)]
    r = client.post("/v1/completions", json={"prompt": f"@best-of-{reason}@", "n": 3, "best_of": 4})
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def test_a_group_larger_than_the_kv_pool_is_400(client, fake):
    fake.publish(max_request_tokens=100)
    try:  # 4 sequences of 36 tokens, each whole (a recomputed group shares nothing): 12 blocks of 16
        e = error(client.post("/v1/completions", json={"prompt": [19556] * 20, "max_tokens": 16, "best_of": 4}), 400,
                  param="prompt", code="kv_cache_exceeded")
        assert e["message"] == ("the request's 4 sequences need up to 192 tokens of KV cache, more than the server's "
                                "whole pool (100 tokens); shorten the prompt, lower max_tokens or lower best_of")
        # n samples are one group too, reckoned the same way
        e = error(client.post("/v1/completions", json={"prompt": [19556] * 20, "max_tokens": 16, "n": 4}), 400,
                  param="prompt", code="kv_cache_exceeded")
        assert e["message"] == ("the request's 4 sequences need up to 192 tokens of KV cache, more than the server's "
                                "whole pool (100 tokens); shorten the prompt, lower max_tokens or lower n")
        r = client.post("/v1/completions", json={"prompt": [19556] * 20, "max_tokens": 16, "n": 2})
        assert r.status_code == 200  # 2 x 3 blocks of 16
    finally:
        fake.publish()


BEAM = {"prompt": "x", "use_beam_search": True}
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of", "best_of must be >= n, got best_of=1, n=2"),
    ("/v1/completions", {"prompt": "x", "best_of": 129}, "best_of", "best_of must be in [1, 128], got 129"),
    ("/v1/completions", {"prompt": ["x", "y"], "best_of": 65}, "best_of",
     "best_of times the number of prompts must be <= 128, got 130"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "stream",
     "stream is not supported with best_of > n: the outputs are chosen only when the request ends"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "stream": True}, "stream",
     "stream is not supported with use_beam_search: the outputs are chosen only when the request ends"),
    ("/v1/completions", {**BEAM, "logprobs": 1}, "logprobs", "logprobs is not supported with use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "logprobs": True}, "logprobs",
     "logprobs is not supported with use_beam_search"),
    ("/v1/completions", {**BEAM, "temperature": 0.7}, "temperature",
     "temperature must be 0 with use_beam_search (beam search is deterministic); leave it out or set it to 0"),
    ("/v1/completions", {**BEAM, "top_p": 0.9}, "top_p", "top_p must be 1 with use_beam_search"),
    ("/v1/completions", {**BEAM, "top_k": 5}, "top_k", "top_k must be off (0 or -1) with use_beam_search"),
    ("/v1/completions", {**BEAM, "repetition_penalty": 1.2}, "repetition_penalty",
     "repetition_penalty is not supported with use_beam_search"),
    ("/v1/completions", {**BEAM, "min_tokens": 2}, "min_tokens", "min_tokens is not supported with use_beam_search"),
    ("/v1/completions", {**BEAM, "ignore_eos": True}, "ignore_eos", "ignore_eos is not supported with use_beam_search"),
    ("/v1/completions", {**BEAM, "best_of": 33}, "best_of",
     "beam search runs at most 32 beams: the beam width (best_of) must be <= 32, got 33"),
    ("/v1/completions", {**BEAM, "n": 33}, "n",
     "beam search runs at most 32 beams: the beam width (n) must be <= 32, got 33"),
    ("/v1/completions", {**BEAM, "early_stopping": "sometimes"}, "early_stopping",
     'early_stopping must be true, false or "never", got "sometimes"'),
    ("/v1/completions", {**BEAM, "length_penalty": "long"}, "length_penalty",
     'length_penalty must be a number, got "long"'),
    ("/v1/completions", {"prompt": "x", "length_penalty": 2.0}, "length_penalty",
     "length_penalty applies only to beam search (use_beam_search: true)"),
    ("/v1/chat/completions", {**CHAT, "early_stopping": True}, "early_stopping",
     "early_stopping applies only to beam search (use_beam_search: true)"),
])
def test_best_of_and_beam_search_errors_are_400_naming_the_param(client, fake, path, body, param, message):
    before = len(fake.requests)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    assert len(fake.requests) == before  # nothing was submitted


# ----------------------------------------------------------------------------- engine failures


def test_an_engine_error_is_a_500_before_any_byte(client, fake):
    fake.scripts["@error@"] = [RequestEvent("", [], None, "error", "the worker failed: boom")]
    r = client.post("/v1/completions", json={"prompt": "@error@"})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "generation failed: the worker failed: boom", "type": "server_error",
                                  "param": None, "code": "engine_error"}}


def test_an_engine_error_mid_stream_is_an_error_event_then_done(client, fake):
    fake.scripts["@late-error@"] = [RequestEvent("", [19556], None), RequestEvent("", [], None, "error", "boom")]
    events = stream(client, "/v1/completions", {"prompt": "@late-error@"})
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[1] == {"error": {"message": "generation failed: boom", "type": "server_error", "param": None,
                                   "code": "engine_error"}}
    assert events[2:] == ["[DONE]"]


def test_a_request_past_its_deadline_is_a_504_and_is_aborted(client, fake):
    fake.scripts["@timeout@"] = "silent"
    started = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "@timeout@"})
    assert r.status_code == 504 and time.monotonic() - started >= TIMEOUT_S - 0.5
    assert r.json()["error"]["code"] == "timeout"
    (request_id,) = [rid for rid, req in fake.requests.items()
                     if "@timeout@" in fake.tokenizer.decode(req.prompt_token_ids)]
    assert wait_for(lambda: fake.aborted(request_id))


# ----------------------------------------------------------------------------- disconnects


def test_a_client_leaving_a_stream_aborts_its_request(client, fake):
    fake.scripts["@slow@"] = "slow"
    with client.stream("POST", "/v1/completions", json={"prompt": "@slow@", "max_tokens": 200, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[len("data: "):])["id"] + "-0"
    assert wait_for(lambda: fake.aborted(request_id))


def test_a_client_leaving_before_a_whole_body_aborts_its_request(base_url, fake):
    fake.scripts["@silent@"] = "silent"
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "@silent@"})
    assert wait_for(lambda: any(
        "@silent@" in fake.tokenizer.decode(req.prompt_token_ids) and fake.aborted(rid)
        for rid, req in list(fake.requests.items())))


# ----------------------------------------------------------------------------- errors


def error(r, status: int, type: str = "invalid_request_error", param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (type, param, code)
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sk-test"}])
def test_a_missing_or_wrong_api_key_is_401(base_url, headers):
    with httpx.Client(base_url=base_url, headers=headers) as c:
        error(c.post("/v1/completions", json={"prompt": "x"}), 401, code="invalid_api_key")
        error(c.get("/v1/models"), 401, code="invalid_api_key")
        assert c.get("/health").status_code == 200  # probes need no key


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}])
def test_the_key_as_x_api_key_is_accepted_and_the_messages_api_answers_401_in_anthropics_shape(base_url, headers):
    with httpx.Client(base_url=base_url, headers={"x-api-key": API_KEY}) as c:
        assert c.get("/v1/models").status_code == 200
    with httpx.Client(base_url=base_url, headers=headers) as c:
        r = c.post("/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        error(c.post("/v1/responses", json={"input": "x"}), 401, code="invalid_api_key")


def test_an_unknown_model_or_route_is_404(client):
    e = error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, param="model",
              code="model_not_found")
    assert e["message"] == "the model 'gpt-4' does not exist; this server serves 'SmolLM2-135M-Instruct'"
    error(client.get("/v1/nothing"), 404)
    error(client.get("/v1/completions"), 405)


def test_a_body_over_the_limit_is_413_by_header_or_by_size(client):
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    e = error(client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413,
              code="request_too_large")
    assert e["message"] == "the request body is larger than 1048576 bytes"

    def chunked():  # no Content-Length: the size is only known by reading
        for _ in range(17):
            yield b"a" * 65536

    error(client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}), 413,
          code="request_too_large")


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", None),
    ("/v1/completions", {"prompt": "x", "use_beam_search": "yes"}, "use_beam_search", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", None),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage",
     None),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo", None),
    ("/v1/completions", {"prompt": [1, 49152]}, "prompt", None),
    ("/v1/completions", {"prompt": []}, "prompt", None),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, "prompt", None),
    ("/v1/completions", {"prompt": "word " * 250, "max_tokens": 16}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 250}]}, "messages",
     "context_length_exceeded"),
])
def test_invalid_values_are_400_naming_the_param(client, path, body, param, code):
    error(client.post(path, json=body), 400, param=param, code=code)


@pytest.mark.parametrize("path, schema, base", [("/v1/completions", "CompletionRequest", {"prompt": "x"}),
                                                ("/v1/chat/completions", "ChatCompletionRequest", CHAT)])
def test_every_documented_bound_is_the_validated_one(client, path, schema, base):
    """/openapi.json and the validation come from one declaration: just past each numeric bound the
    document states is a 400 naming that field."""
    properties = client.get("/openapi.json").json()["components"]["schemas"][schema]["properties"]
    checked = []
    for name, prop in properties.items():
        for s in prop.get("anyOf", []):
            if s.get("type") not in ("integer", "number"):
                continue
            step = 1 if s["type"] == "integer" else 0.001
            outside = ([s["maximum"] + step] if "maximum" in s else []) + (
                [s["minimum"] - step] if "minimum" in s else []) + (
                [s["exclusiveMinimum"]] if "exclusiveMinimum" in s else [])
            for value in outside:
                error(client.post(path, json={**base, name: value}), 400, param=name)
                checked.append(name)
    assert len(checked) >= 20 and {"n", "best_of", "max_tokens", "seed", "top_p", "length_penalty"} <= set(checked)


def test_the_context_length_error_says_what_to_do(client):
    e = error(client.post("/v1/completions", json={"prompt": [19556] * 250, "max_tokens": 16}), 400, param="prompt",
              code="context_length_exceeded")
    assert e["message"] == ("this model's maximum context length is 256 tokens, but the request needs 266 (250 in "
                            "the prompt, 16 for the completion); shorten the prompt or lower max_tokens")


def test_a_request_larger_than_the_kv_pool_is_400(client, fake):
    fake.publish(max_request_tokens=100)
    try:
        e = error(client.post("/v1/completions", json={"prompt": [19556] * 90, "max_tokens": 16}), 400,
                  param="prompt", code="kv_cache_exceeded")
        assert e["message"] == ("the request needs up to 106 tokens of KV cache, more than the server's whole pool "
                                "(100 tokens); shorten the prompt or lower max_tokens")
    finally:
        fake.publish()
    assert client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1}).status_code == 200


def test_bad_json_and_wrong_content_type_are_400(client):
    headers = {"Content-Type": "application/json"}
    assert error(client.post("/v1/completions", content=b"{nope", headers=headers), 400)["message"].startswith(
        "the request body is not valid JSON")
    error(client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    error(client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}', headers=headers), 400)
    e = error(client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"}), 400)
    assert e["message"] == "Content-Type must be application/json, got 'text/plain'"


def test_unknown_fields_are_ignored(client):
    r = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1, "frobnicate": {"x": 1}, "user": "u1"})
    assert r.json()["choices"][0]["text"] == "Hello"


def test_a_full_queue_is_429_with_retry_after(client, fake):
    fake.publish("fake-busy", workers_ready=False, num_waiting=MAX_PENDING)
    try:
        r = client.post("/v1/completions", json={"prompt": "x"})
        error(r, 429, type="rate_limit_error", code="queue_full")
        assert r.headers["retry-after"] == "1"
    finally:
        fake.redis.delete(streams.status_key("fake-busy"))
    assert client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1}).status_code == 200


def _rejected(client, reason: str) -> float:
    line = f'pagoda:requests_rejected_total{{model_name="{MODEL}",reason="{reason}"}}'
    return next(float(l.rpartition(" ")[2]) for l in client.get("/metrics").text.splitlines() if l.startswith(line))


def test_past_max_num_queued_tokens_a_request_is_429_unless_it_would_be_alone(client, fake, gateway):
    """Waiting prompt tokens (the schedulers' own count, or this gateway's submitted-but-unstarted
    ones) plus the request's must fit --max-num-queued-tokens; a request into an empty queue always
    goes in, however long. Each refusal is counted under the bound it met."""
    import dataclasses

    config, before = gateway.config, _rejected(client, "max_num_queued_tokens")
    fake.publish("fake-busy", workers_ready=False, num_waiting=1, num_waiting_tokens=90)
    try:
        gateway.config = dataclasses.replace(config, max_num_queued_tokens=100)
        r = client.post("/v1/completions", json={"prompt": [19556] * 11, "max_tokens": 1})
        e = error(r, 429, type="rate_limit_error", code="queue_full")
        assert e["message"] == ("the server is busy: 90 prompt tokens are already waiting and this request has 11 "
                                "(--max-num-queued-tokens 100); retry shortly")
        assert r.headers["retry-after"] == "1"
        assert client.post("/v1/completions", json={"prompt": [19556] * 10, "max_tokens": 1}).status_code == 200
        fake.redis.delete(streams.status_key("fake-busy"))
        gateway.config = dataclasses.replace(config, max_num_queued_tokens=5)
        assert client.post("/v1/completions", json={"prompt": [19556] * 11, "max_tokens": 1}).status_code == 200
    finally:
        gateway.config = config
        fake.redis.delete(streams.status_key("fake-busy"))
    assert _rejected(client, "max_num_queued_tokens") == before + 1
    assert gateway.engine.num_unstarted_tokens == 0 and gateway.engine.num_unsubmitted_tokens == 0


def test_past_the_ttft_slo_a_request_is_shed_with_its_predicted_wait(client, fake, gateway):
    """--ttft-slo-ms: the waiting prompt tokens and the request's own over the groups' measured
    prefill rate (of the groups whose workers are ready) predict its wait; past the SLO it is 429
    with a Retry-After of that wait, counted under ttft_slo_ms. Into an empty queue, or at the SLO
    exactly, it goes in."""
    import dataclasses

    config, before = gateway.config, _rejected(client, "ttft_slo_ms")
    try:
        gateway.config = dataclasses.replace(config, ttft_slo_ms=100.0)
        # a group whose workers are not ready adds nothing to the rate: no prediction, no shedding
        fake.publish("fake-busy", workers_ready=False, num_waiting=1, num_waiting_tokens=90, prefill_tokens_per_s=1e3)
        assert client.post("/v1/completions", json={"prompt": [19556] * 11, "max_tokens": 1}).status_code == 200
        fake.publish("fake-busy", workers_ready=True, num_waiting=1, num_waiting_tokens=90, prefill_tokens_per_s=1e3)
        r = client.post("/v1/completions", json={"prompt": [19556] * 11, "max_tokens": 1})
        e = error(r, 429, type="rate_limit_error", code="queue_full")
        assert e["message"] == ("the server is busy: 90 prompt tokens are waiting, and this request would wait about "
                                "101 ms for its first token (--ttft-slo-ms 100); retry shortly")
        assert r.headers["retry-after"] == "1"
        assert client.post("/v1/completions", json={"prompt": [19556] * 10, "max_tokens": 1}).status_code == 200
        fake.publish("fake-busy", workers_ready=True, num_waiting=1, num_waiting_tokens=90, prefill_tokens_per_s=20.0)
        r = client.post("/v1/completions", json={"prompt": [19556] * 11, "max_tokens": 1})
        assert error(r, 429, type="rate_limit_error", code="queue_full")["message"].endswith(
            "would wait about 5050 ms for its first token (--ttft-slo-ms 100); retry shortly")
        assert r.headers["retry-after"] == "6"
        fake.redis.delete(streams.status_key("fake-busy"))
        assert client.post("/v1/completions", json={"prompt": [19556] * 50, "max_tokens": 1}).status_code == 200
    finally:
        gateway.config = config
        fake.redis.delete(streams.status_key("fake-busy"))
    assert _rejected(client, "ttft_slo_ms") == before + 2

def test_no_ready_scheduler_is_503_with_retry_after_and_health_follows(client, fake):
    assert client.get("/health").json() == {"status": "ok"}
    fake.publish(workers_ready=False)
    try:
        r = client.post("/v1/completions", json={"prompt": "x"})
        e = error(r, 503, type="server_error", code="service_unavailable")
        assert r.headers["retry-after"] == "5"
        assert e["message"].startswith("no scheduler has its workers ready yet")
        error(client.get("/health"), 503, type="server_error", code="service_unavailable")
        fake.redis.delete(streams.status_key("fake"))
        e = error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 503,
                  type="server_error", code="service_unavailable")
        assert e["message"].startswith("no scheduler is running")
    finally:
        fake.publish()
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1}).status_code == 200


def test_without_redis_the_gateway_answers_503_and_recovers_when_redis_comes_back(tokenizer):
    port = stable_port()  # down, then up on it
    with TestClient(create_app(GatewayConfig(redis_url=f"redis://127.0.0.1:{port}/0"), tokenizer=tokenizer)) as c:
        for _ in range(2):
            e = error(c.get("/health"), 503, type="server_error", code="service_unavailable")
            assert e["message"].startswith("Redis is unreachable")
            error(c.post("/v1/completions", json={"prompt": "x"}), 503, type="server_error", code="service_unavailable")
        assert c.get("/metrics").status_code == 200
        server = RedisServer(port=port).start()
        scheduler = FakeScheduler(server.url, tokenizer)
        try:
            scheduler.publish()
            scheduler.thread.start()
            assert c.get("/health").json() == {"status": "ok"}
            r = c.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2})  # the reader reconnected
            assert r.json()["choices"][0]["text"] == "Hello world"
        finally:
            scheduler.stopping.set()
            scheduler.thread.join(5)
            server.stop()


def test_a_request_lost_by_a_redis_restart_is_queued_again_at_once_under_its_id(tokenizer):
    """Queued unread when Redis restarts empty: the gateway, which kept the entry until the
    request's first event, puts it on the new stream as soon as the scheduler says it holds nothing,
    and the request is served."""
    import concurrent.futures

    server = RedisServer().start()
    publisher = redis.Redis.from_url(server.url)
    try:
        publisher.set(streams.status_key("fake"), encode(status()), px=60_000)  # ready, but reads nothing
        with TestClient(create_app(GatewayConfig(redis_url=server.url), tokenizer=tokenizer)) as c:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(c.post, "/v1/completions", json={"prompt": HELLO, "max_tokens": 2})
                deadline = time.monotonic() + 5
                while not publisher.xlen(streams.REQUESTS) and time.monotonic() < deadline:
                    time.sleep(0.05)
                [(_, sent)] = publisher.xrange(streams.REQUESTS)  # queued, unread
                time.sleep(1.5)  # the gateway has seen this Redis's run_id
                server.stop()
                server.start()  # empty: the queued request is gone
                publisher.set(streams.status_key("fake"), encode(status()), px=60_000)
                publisher.set(streams.held_key("fake"), encode(HeldRequests("fake", [])))  # as a scheduler does
                restarted = time.monotonic()
                assert wait_for(lambda: publisher.xlen(streams.REQUESTS) == 1, 5.0)
                [(_, again)] = publisher.xrange(streams.REQUESTS)
                assert again == sent and time.monotonic() - restarted < 5  # the same entry: its id, its reply stream
                request = decode(again[streams.FIELD])
                publisher.xadd(request.reply_stream, {streams.FIELD: encode(
                    RequestEvent(request.request_id, request.prompt_token_ids[:2], None, "length"))})
                r = pending.result(timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world"
            assert publisher.xlen(streams.ABORTS) == 0
    finally:
        publisher.close()
        server.stop()


def test_a_request_the_new_redis_holds_under_another_entry_is_not_queued_again(tokenizer):
    """A draining scheduler hands a request back under a new entry id: after a restart, the gateway
    looks for the request by its id, not by the entry it sent, and adds no second copy."""
    import concurrent.futures

    server = RedisServer().start()
    publisher = redis.Redis.from_url(server.url)
    try:
        publisher.set(streams.status_key("fake"), encode(status()), px=60_000)
        with TestClient(create_app(GatewayConfig(redis_url=server.url), tokenizer=tokenizer)) as c:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(c.post, "/v1/completions", json={"prompt": HELLO, "max_tokens": 2})
                assert wait_for(lambda: publisher.xlen(streams.REQUESTS) == 1, 5.0)
                [(_, sent)] = publisher.xrange(streams.REQUESTS)
                time.sleep(1.5)  # the gateway has seen this Redis's run_id
                server.stop()
                server.start()
                publisher.xadd(streams.REQUESTS, {"pad": b"1"})  # the handed-back entry gets a later id
                publisher.xadd(streams.REQUESTS, sent)  # handed back (as after a drain), kept by the new Redis
                publisher.set(streams.status_key("fake"), encode(status()), px=60_000)
                publisher.set(streams.held_key("fake"), encode(HeldRequests("fake", [])))
                time.sleep(2.5)  # past the gateway's look at the new Redis
                assert [fields for _, fields in publisher.xrange(streams.REQUESTS)] == [{b"pad": b"1"}, sent]
                request = decode(sent[streams.FIELD])
                publisher.xadd(request.reply_stream, {streams.FIELD: encode(
                    RequestEvent(request.request_id, request.prompt_token_ids[:2], None, "length"))})
                assert pending.result(timeout=10).json()["choices"][0]["text"] == "Hello world"
    finally:
        publisher.close()
        server.stop()

def test_after_a_redis_restart_only_what_no_scheduler_holds_is_queued_again(tokenizer):
    """Of three requests, one was read by a scheduler before Redis restarted (it says it holds it),
    one was queued unread (lost: queued again under its id once the scheduler has said what it
    holds), one was sent to the new Redis before the gateway saw the restart (kept). All three then
    finish as usual."""
    import concurrent.futures

    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    body = {"prompt": HELLO, "max_tokens": 2}
    config = GatewayConfig(redis_url=server.url, redis_restart_grace_s=30.0)  # the schedulers' word, not the grace
    try:
        r.set(streams.status_key("fake"), encode(status()), px=60_000)
        r.xgroup_create(streams.REQUESTS, streams.SCHEDULER_GROUP, id="0", mkstream=True)
        with TestClient(create_app(config, tokenizer=tokenizer)) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
            c.app.state.gateway.engine.status_ttl_s = 0.0
            held_response = pool.submit(c.post, "/v1/completions", json=body)
            assert wait_for(lambda: r.xlen(streams.REQUESTS) == 1)
            [(_, [(_, fields)])] = r.xreadgroup(streams.SCHEDULER_GROUP, "fake", {streams.REQUESTS: ">"})
            held = decode(fields[streams.FIELD])  # read by the scheduler: it holds it
            lost_response = pool.submit(c.post, "/v1/completions", json=body)
            assert wait_for(lambda: r.xlen(streams.REQUESTS) == 2)
            [(_, lost_fields)] = r.xrange(streams.REQUESTS, "(" + r.xrange(streams.REQUESTS)[0][0].decode())
            lost = decode(lost_fields[streams.FIELD])
            time.sleep(1.5)  # the gateway has seen this Redis's run_id and the scheduler's status
            server.stop()
            server.start()  # empty: the unread request is gone
            r.set(streams.status_key("fake"), encode(status()), px=60_000)  # back, and yet to say what it holds
            new_response = pool.submit(c.post, "/v1/completions", json=body)
            assert wait_for(lambda: r.xlen(streams.REQUESTS) == 1, 5.0)  # the new request, in the new Redis
            time.sleep(1.5)  # the gateway sees the restart and waits for the scheduler's word
            assert not lost_response.done()
            r.set(streams.held_key("fake"), encode(HeldRequests("fake", [held.request_id])))
            assert wait_for(lambda: r.xlen(streams.REQUESTS) == 2, 5.0)
            [(_, new_fields), (_, again_fields)] = r.xrange(streams.REQUESTS)
            assert again_fields == lost_fields and r.xlen(streams.ABORTS) == 0
            for request in (held, decode(new_fields[streams.FIELD]), lost):  # the scheduler answers all three
                r.xadd(request.reply_stream, {streams.FIELD: encode(
                    RequestEvent(request.request_id, request.prompt_token_ids[:2], None, "length"))})
            for response in (held_response.result(timeout=5), new_response.result(timeout=5),
                             lost_response.result(timeout=5)):
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == "Hello world"
    finally:
        r.close()
        server.stop()


def test_logit_bias_keys_name_each_token_once_and_max_tokens_0_is_for_completions_only(client, fake):
    for bias in ({"01": 1}, {"1": 50, "01": 50}, {"00": -1}):  # "01" and "1" would add up on token 1
        e = error(client.post("/v1/completions", json={"prompt": "x", "logit_bias": bias}), 400, param="logit_bias")
        key = next(k for k in bias if k.startswith("0"))
        assert e["message"] == f'logit_bias has key "{key}": write a token id without leading zeros'
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": {"0": 5, "10": -5}})
    assert fake.requests[body.json()["id"] + "-0"].sampling_params.logit_bias == [[0, 5.0], [10, -5.0]]
    chat = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}
    for param in ("max_tokens", "max_completion_tokens"):
        e = error(client.post("/v1/chat/completions", json={**chat, param: 0}), 400, param=param)
        assert e["message"] == (f"{param} must be >= 1; 0 (score the prompt, generate nothing) is allowed only on "
                                "completions, with echo or prompt_logprobs")


# ----------------------------------------------------------------------------- metrics


def test_metrics_label_each_engine_groups_series_and_every_series_with_the_model_name(client, fake, gateway):
    """One sample per engine group (schedulers sharing an engine id summed), `model_name` on every series."""
    # the request first, while engine 0's fake scheduler is the only one (fake-2 and fake-3 answer nothing)
    r = client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text
    fake.publish("fake-2", engine="1", num_running=4, num_waiting=1, num_gpu_blocks=192, kv_cache_usage=0.5,
                 num_preemptions_total=2, prefix_cache_queries_total=5, prefix_cache_hits_total=1,
                 compiled_step_recompiles_total=1)
    fake.publish("fake-3", engine="1", num_running=2, num_waiting=0, num_gpu_blocks=64, kv_cache_usage=0.0,
                 num_preemptions_total=1, prefix_cache_queries_total=0, prefix_cache_hits_total=0)
    try:
        r = client.get("/metrics")
    finally:
        fake.redis.delete(streams.status_key("fake-2"), streams.status_key("fake-3"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    model = f'model_name="{gateway.served_model_name}"'
    engine = {e: f'{{engine="{e}",{model}}}' for e in ("0", "1")}  # the exposition sorts labels by name
    assert values[f"pagoda:num_schedulers{{{model}}}"] == 3
    expected = {  # engine 0: the fake scheduler's status(); engine 1: fake-2 and fake-3
        "num_requests_running": (1, 4 + 2), "num_requests_waiting": (2, 1), "num_requests_swapped": (0, 0),
        "kv_cache_usage_perc": (0.25, (0.5 * 192 + 0.0 * 64) / (192 + 64)), "num_preemptions_total": (3, 2 + 1),
        "prefix_cache_queries_total": (10, 5), "prefix_cache_hits_total": (4, 1),
        "compiled_step_recompiles_total": (0, 1),
    }
    for name, (engine_0, engine_1) in expected.items():
        assert {key: v for key, v in values.items() if key.startswith(f"pagoda:{name}{{")} == {
            f"pagoda:{name}{engine['0']}": engine_0, f"pagoda:{name}{engine['1']}": engine_1}
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert values[f"pagoda:{histogram}_count{{{model}}}"] >= 1
    assert values[f'pagoda:http_requests_total{{{model},route="/v1/completions",status="200"}}'] >= 1
    assert values[f'pagoda:request_success_total{{finished_reason="length",{model}}}'] >= 1
    assert values[f"pagoda:generation_tokens_total{{{model}}}"] >= 3
    assert values[f"pagoda:prompt_tokens_total{{{model}}}"] >= 7
    unlabelled = [line for line in r.text.splitlines()
                  if line.startswith("pagoda:") and "model_name=" not in line and "_created" not in line]
    assert unlabelled == []


# ----------------------------------------------------------------------------- detokenizer and layering


def test_no_gateway_module_names_torch():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in sorted((root / "gateway").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in {"torch", "triton", "zmq"}]
    assert offenders == []


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_incremental_detokenizer_reproduces_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    byte_tokens = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])][:400]  # partial characters
    for _ in range(150):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(vocab)
               for _ in range(rng.randint(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        pieces = [detokenizer.add(t) for t in ids] + [detokenizer.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # a partial character waits for the rest


def test_finished_and_aborted_requests_leave_no_state_behind(gateway, client):
    client.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1})
    engine = gateway.engine
    assert wait_for(lambda: not engine._requests and engine.num_unstarted == 0 and engine.num_unsubmitted == 0)


def test_gateway_config_validates_and_names_itself():
    from common.config import ConfigError

    config = GatewayConfig()
    assert len(config.gateway_id) == 16 and config.host == "127.0.0.1" and config.port == 8000
    assert config.replace(port=9000).gateway_id == config.gateway_id
    for bad in ({"max_pending_requests": 0}, {"api_key": ""}, {"gateway_id": "a b"}, {"redis_url": "localhost:6379"},
                {"request_timeout_s": 0}, {"max_body_bytes": 10}, {"port": 70000}):
        with pytest.raises(ConfigError):
            GatewayConfig(**bad)


def test_an_abort_that_finds_redis_down_is_sent_once_redis_is_back():
    """A client that leaves while Redis is down: its abort (a whole request, or one output) is sent
    to the Redis that comes back, else its request would run to max_tokens for no one."""
    import asyncio

    from gateway.engine_client import EngineClient

    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)

    async def leave_while_redis_is_down() -> None:
        client = EngineClient(server.url, "gateway-test")
        await client.start()
        server.stop()
        client.abort("cmpl-a-0")
        client.abort("cmpl-b-0", 1)
        await asyncio.sleep(0.5)
        server.start()  # the same port, empty (no persistence): what it holds was sent after
        deadline = time.monotonic() + 15
        while r.xlen(streams.ABORTS) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await client.close()

    try:
        asyncio.run(leave_while_redis_is_down())
        assert [fields for _, fields in r.xrange(streams.ABORTS)] == [
            {streams.ABORT_FIELD: b"cmpl-a-0"}, {streams.ABORT_FIELD: b"cmpl-b-0", streams.ABORT_INDEX_FIELD: b"1"}]
    finally:
        r.close()
        server.stop()


def test_a_redis_restart_that_loses_a_started_requests_events_fails_it_instead_of_a_hang_or_a_gap():
    """The events a gateway had not read die with Redis: a started request that no scheduler holds
    lost its end (it would wait for it until request_timeout_s), and one whose next event skips a
    seq lost part of its text. Both end with an error and are aborted in the schedulers."""
    import asyncio

    from gateway.engine_client import OUTPUT_LOST, EngineClient

    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)

    def event(request_id: str, seq: int) -> RequestEvent:
        e = RequestEvent(request_id, [7], None)
        e.seq = seq
        return e

    async def scenario() -> tuple[list[RequestEvent], list[RequestEvent]]:
        client = EngineClient(server.url, "gateway-test", restart_grace_s=1.0)
        await client.start()
        ended = await client.submit([GenerateRequest("ended-0", [1, 2], SamplingParams(), client.reply_stream, 0.0)])
        gapped = await client.submit([GenerateRequest("gapped-0", [1, 2], SamplingParams(), client.reply_stream, 0.0)])
        for e in (event("ended-0", 1), event("gapped-0", 1)):
            r.xadd(client.reply_stream, {streams.FIELD: encode(e)})
        first = [await ended.next_event(10), await gapped.next_event(10)]
        await asyncio.sleep(1.5)  # the reader has seen this Redis's run_id
        server.stop()
        server.start()  # empty: the end of "ended-0" (never written here) is what it lost
        r.set(streams.held_key("scheduler-1"), encode(HeldRequests("scheduler-1", ["gapped-0"])))  # it runs on
        r.xadd(client.reply_stream, {streams.FIELD: encode(event("gapped-0", 3))})  # seq 2 lost
        then = [await ended.next_event(15), await gapped.next_event(15)]
        await asyncio.sleep(0.2)  # the aborts go out
        await client.close()
        return first, then

    try:
        first, then = asyncio.run(scenario())
        assert [(e.request_id, e.token_ids, e.finish_reason) for e in first] == [("ended-0", [7], None),
                                                                                  ("gapped-0", [7], None)]
        assert [(e.request_id, e.token_ids, e.finish_reason, e.error) for e in then] == [
            ("ended-0", [], "error", OUTPUT_LOST), ("gapped-0", [], "error", OUTPUT_LOST)]
        assert sorted(fields[streams.ABORT_FIELD] for _, fields in r.xrange(streams.ABORTS)) == [b"ended-0",
                                                                                                 b"gapped-0"]
    finally:
        r.close()
        server.stop()
