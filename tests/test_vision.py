"""Images in (docs/vision.md): a tiny random Gemma 3 with its SigLIP tower and processor
(tests/vision_models.py), its greedy tokens and logprobs against transformers' `generate` on the
same chats, offline and served (openai SDK, data: URLs, tensor-parallel size 2); the encoder cache;
image-aware prefix caching; and every bad image answered with 400."""
from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json

import httpx
import openai
import pytest
import torch

from common.multimodal import chunk_end, invalid_items, placeholder_ids
from common.protocol import MultiModalItem, SamplingParams
from gateway.media import MediaError, MediaPolicy, load_image
from tests.families import prompt_text, token_strings
from tests.stack import Stack, wait_for
from tests.vision_models import as_urls, data_url, gemma3_vlm, image, qwen2_5_vl, qwen3_vl, qwen_inputs, reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_TOKENS = 10
MAX_LOGPROB_ERROR = 1e-4
CHATS = {
    "one image": [{"role": "user", "content": [
        {"type": "image", "image": image(1)}, {"type": "text", "text": prompt_text(range(10, 40))}]}],
    "two images": [{"role": "user", "content": [
        {"type": "text", "text": prompt_text(range(50, 60))}, {"type": "image", "image": image(1)},
        {"type": "text", "text": prompt_text(range(60, 75))}, {"type": "image", "image": image(2)},
        {"type": "text", "text": "w7 w8"}]}],
    "then a text turn": [
        {"role": "user", "content": [{"type": "image", "image": image(3)},
                                     {"type": "text", "text": prompt_text(range(20, 30))}]},
        {"role": "assistant", "content": "w100 w101 w102"},
        {"role": "user", "content": prompt_text(range(30, 36))}],
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("gemma3-vlm")
    model = gemma3_vlm(directory)
    processor = transformers.AutoProcessor.from_pretrained(directory)
    references = {name: reference(model, processor, chat, MAX_TOKENS) for name, chat in CHATS.items()}
    return directory, model, processor, references


def assert_matches(ref: tuple[list[int], list[float]], tokens: list[int], logprobs: list[float]) -> None:
    assert tokens == ref[0]
    assert max(abs(a - b) for a, b in zip(logprobs, ref[1], strict=True)) < MAX_LOGPROB_ERROR


# ---------------------------------------------------------------------------------------------- offline
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 14])
def test_greedy_tokens_equal_transformers(gemma3, max_num_batched_tokens):
    """Whole prompts, and 14-token chunks (the second chat's first image starts at 12: the chunk
    stops before it rather than split tokens that attend to each other both ways)."""
    directory, _, _, references = gemma3
    cache = _generate_offline(directory, CHATS, references, max_num_batched_tokens=max_num_batched_tokens)
    assert cache == (4, 1)  # image(1) twice: encoded once


def _generate_offline(directory, chats: dict, references: dict, **config) -> tuple[int, int]:
    """Every chat through the offline LLM at once, each equal to its reference; the encoder cache's
    (queries, hits)."""
    from pagoda.offline import LLM

    llm = LLM(str(directory), device="cpu", dtype="float32", num_gpu_blocks=64, **config)
    try:
        outputs = llm.generate([{"messages": as_urls(chat)} for chat in chats.values()],
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
        for out, ref in zip(outputs, references.values(), strict=True):
            assert_matches(ref, out.token_ids, [t[0] for t in out.logprobs])
        return llm.executor.images.cache.queries, llm.executor.images.cache.hits
    finally:
        llm.close()


def test_a_prompt_holds_each_images_placeholder_ids(gemma3):
    directory, _, processor, _ = gemma3
    from common.models import resolve_model
    from gateway.multimodal import ImagePrompts

    images = ImagePrompts.of(resolve_model(str(directory)), MediaPolicy(), 16)
    ids, items = images.encode_chat(_template(CHATS["two images"]), None, None, {})
    plain = processor.apply_chat_template(CHATS["two images"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True, return_tensors="np")["input_ids"][0].tolist()
    assert [(item.offset, item.length, item.bidirectional) for item in items] == [(12, 4, True), (33, 4, True)]
    assert items[0].hash != items[1].hash
    expected = list(plain)
    for item in items:
        expected[item.offset:item.offset + item.length] = placeholder_ids(item.hash, item.length)
    assert ids == expected and plain[12:16] == [513] * 4
    assert invalid_items(ids, items, 515) is None
    assert "placeholder" in invalid_items([*ids[:12], 513, *ids[13:]], items, 515)
    assert "in order" in invalid_items(ids, items[::-1], 515)


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    both, causal = MultiModalItem(b"h" * 32, 10, 4, b"", True), MultiModalItem(b"h" * 32, 10, 4, b"", False)
    assert chunk_end(0, 12, [both]) == 10  # stops before it
    assert chunk_end(0, 14, [both]) == 14 and chunk_end(0, 10, [both]) == 10
    assert chunk_end(11, 2, [both]) == 0  # starts inside it (a prefix-cache hit), cannot finish it
    assert chunk_end(11, 3, [both]) == 3
    assert chunk_end(0, 12, [causal]) == 12


@pytest.mark.parametrize("url, says", [
    ("data:image/png;base64,aGVsbG8=", "could not be decoded as PNG"),
    ("data:image/png;base64,@@@", "malformed"),
    ("data:image/png,abc", "must be base64"),
    ("ftp://example.com/a.png", "must be a data:"),
    ("file:///etc/hostname", "--allowed-local-media-path"),
    ("http://127.0.0.1:9/a.png", "private address"),
])
def test_bad_image_urls_are_refused_with_the_reason(url, says):
    with pytest.raises(MediaError, match=says):
        load_image(url, MediaPolicy())


def test_local_files_only_under_the_allowed_folder(tmp_path):
    (tmp_path / "ok").mkdir()
    image(1).save(tmp_path / "ok" / "a.png")
    image(1).save(tmp_path / "b.png")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path / "ok"))
    assert load_image(f"file://{tmp_path}/ok/a.png", policy).size == (40, 30)
    with pytest.raises(MediaError, match="outside"):
        load_image(f"file://{tmp_path}/ok/../b.png", policy)


def _template(chat: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "image", "url": data_url(p["image"])} if p["type"] == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in chat]


# ---------------------------------------------------------------------------------------------- Qwen2.5-VL
QWEN_CHATS = {
    "one image": [{"role": "user", "content": [
        {"type": "image", "image": image(1, (60, 45))}, {"type": "text", "text": prompt_text(range(10, 40))}]}],
    "two images": [{"role": "user", "content": [
        {"type": "text", "text": prompt_text(range(50, 60))}, {"type": "image", "image": image(1, (60, 45))},
        {"type": "text", "text": prompt_text(range(60, 75))}, {"type": "image", "image": image(2, (100, 70))},
        {"type": "text", "text": "w7 w8"}]}],
    "then a text turn": [
        {"role": "user", "content": [{"type": "image", "image": image(3, (90, 90))},
                                     {"type": "text", "text": prompt_text(range(20, 30))}]},
        {"role": "assistant", "content": "w100 w101 w102"},
        {"role": "user", "content": prompt_text(range(30, 36))}],
}


# per family: each chat's images' patch counts; the encoder cache's (queries, hits) over the three
# chats whole and in 7-token chunks (image(1) twice; a cut image's later parts are hits too)
QWEN_FAMILIES = {
    "qwen2_5_vl": (qwen2_5_vl, [[16], [16, 32], [36]], (4, 1), (7, 4)),  # 14-pixel patches: 4, 8, 9 tokens
    "qwen3_vl": (qwen3_vl, [[8], [8, 24], [36]], (4, 1), (6, 3)),  # 16-pixel patches: 2, 6, 9 tokens
}


@pytest.fixture(scope="module", params=list(QWEN_FAMILIES))
def qwen(request, tmp_path_factory):
    build, patches, whole, chunked = QWEN_FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    model = build(directory)
    inputs = functools.partial(qwen_inputs, directory)
    assert [inputs(chat)["image_grid_thw"].prod(-1).tolist() for chat in QWEN_CHATS.values()] == patches
    references = {name: reference(model, inputs, chat, MAX_TOKENS) for name, chat in QWEN_CHATS.items()}
    return directory, model, inputs, references, {2048: whole, 7: chunked}


@pytest.mark.parametrize("max_num_batched_tokens, size", [(2048, 1), (7, 1), (7, 2)])
def test_qwen_vl_greedy_tokens_equal_transformers(qwen, max_num_batched_tokens, size):
    """M-RoPE positions (each image's grid, the text after it shifted; Qwen3-VL's interleaved, and
    its deepstack features), whole prompts and 7-token chunks that split images (their encoder
    output computed once and sliced), at tensor-parallel sizes 1 and 2."""
    directory, _, _, references, cache_counts = qwen
    cache = _generate_offline(directory, QWEN_CHATS, references, max_num_batched_tokens=max_num_batched_tokens,
                              tensor_parallel_size=size)
    assert cache == cache_counts[max_num_batched_tokens]


def test_mrope_positions_follow_transformers_get_rope_index(qwen):
    """Every position of the two-image chat, from its items, against transformers' own."""
    from common.models import resolve_model
    from gateway.multimodal import ImagePrompts
    from worker.multimodal import mrope_positions

    directory, model, inputs, _, _ = qwen
    chat = QWEN_CHATS["two images"]
    ids, items = ImagePrompts.of(resolve_model(str(directory)), MediaPolicy(), 16).encode_chat(
        _template(chat), None, None, {})
    ref = inputs(chat)
    expected, _ = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
    grids = [[int(t), int(h) // 2, int(w) // 2] for t, h, w in ref["image_grid_thw"].tolist()]
    assert [item.grid for item in items] == grids and grids[1][2] > grids[1][1] > 1
    assert mrope_positions(items, 0, len(ids)).tolist() == expected[:, 0].tolist()
    assert mrope_positions(items, 13, 30).tolist() == expected[:, 0, 13:30].tolist()  # a chunk inside
    assert invalid_items(ids, items, len(model.model.language_model.embed_tokens.weight), grids=True) is None
    bad_grid = [dataclasses.replace(items[0], grid=[1, 1, items[0].length + 1]), items[1]]
    assert "grid" in invalid_items(ids, bad_grid, 10**6, grids=True)


def test_the_encoder_cache_keeps_the_newest_output_even_beyond_its_bytes():
    from worker.multimodal import EncoderCache

    cache = EncoderCache(capacity_bytes=64)
    cache.put(b"a", torch.zeros(2, 4))  # 32 bytes
    cache.put(b"b", torch.zeros(2, 4))
    cache.put(b"c", torch.zeros(8, 4))  # 128 bytes: alone beyond the capacity, kept
    assert list(cache.entries) == [b"c"] and cache.get(b"c") is not None and cache.get(b"a") is None
    assert (cache.queries, cache.hits) == (2, 1)


def test_downloads_follow_redirects_within_one_deadline_from_the_checked_address():
    """A local server (allowed with allow_private_media_urls): userinfo kept out of the Host
    header, a redirect, an IPv6 literal, a 404, and a body trickled past the deadline."""
    import http.server
    import socket
    import threading
    import time

    buffer = io.BytesIO()
    image(1).save(buffer, format="PNG")
    png, hosts = buffer.getvalue(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            hosts.append(self.headers["Host"])
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/a.png")
                self.end_headers()
                return
            self.send_response(404 if self.path == "/missing" else 200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            for i in range(0, len(png), 64 if self.path == "/slow" else len(png)):
                self.wfile.write(png[i:i + 64 if self.path == "/slow" else len(png)])
                self.wfile.flush()
                time.sleep(0.2 if self.path == "/slow" else 0)

    class IPv6Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler), IPv6Server(("::1", 0), Handler)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        v4, v6 = (server.server_address[1] for server in servers)
        policy = MediaPolicy(allow_private_media_urls=True, fetch_timeout_s=1.0)
        assert load_image(f"http://user:secret@127.0.0.1:{v4}/redirect", policy).size == (40, 30)
        assert hosts == [f"127.0.0.1:{v4}"] * 2
        assert load_image(f"http://[::1]:{v6}/a.png", policy).size == (40, 30)
        with pytest.raises(MediaError, match="HTTP 404"):
            load_image(f"http://127.0.0.1:{v4}/missing", policy)
        start = time.monotonic()
        with pytest.raises(MediaError, match="timed out|--media-fetch-timeout"):
            load_image(f"http://127.0.0.1:{v4}/slow", policy)  # about 4 s of body: cut at 1 s
        assert time.monotonic() - start < 1.5
    finally:
        for server in servers:
            server.shutdown()


# ---------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def stack(gemma3, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    image(6).save(media / "six.png")
    stack = Stack("--model", str(gemma3[0]), "--tensor-parallel-size", "2", "--num-gpu-blocks", "64",
                  "--max-num-batched-tokens", "14", "--allowed-local-media-path", str(media),
                  "--limit-mm-per-prompt", '{"image": 2}').wait_ready()
    stack.media = media
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=_model(client), messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=True, **kwargs)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_served_greedy_tokens_equal_transformers_at_tensor_parallel_size_2(gemma3, client):
    _assert_chats(client, CHATS, gemma3[3])


def _assert_chats(client, chats: dict, references: dict) -> None:
    """Each chat through the API equals its reference, token for token (logprobs within 1e-4)."""
    for name, chat in chats.items():
        choice = _chat(client, as_urls(chat)).choices[0]
        tokens, logprobs = references[name]
        assert [t.token for t in choice.logprobs.content] == token_strings(tokens), name
        assert max(abs(t.logprob - lp) for t, lp in zip(choice.logprobs.content, logprobs)) < MAX_LOGPROB_ERROR


def test_the_same_image_is_encoded_once_and_its_blocks_are_cached(client, stack):
    """image(6) three times: its first request encodes it; the same image and text again reads the
    image's blocks from the prefix cache (no encoding); the same image from a file, with other
    text, misses the prefix cache and hits the encoder cache."""
    text = [{"type": "text", "text": prompt_text(range(10, 40))}]
    chat = [{"role": "user", "content": [_image_part(data_url(image(6))), *text]}]
    from_file = [{"role": "user", "content": [_image_part(f"file://{stack.media}/six.png"), {"type": "text", "text": "w3"}]}]
    queries, hits = "pagoda:mm_encoder_cache_queries_total", "pagoda:mm_encoder_cache_hits_total"
    start = stack.wait_drained(10)  # counts published after the tests before (a status is 0.5 s old at most)

    def counted(expected: tuple[int, int]) -> None:
        wait_for(lambda: (stack.metrics()[queries] - start[queries], stack.metrics()[hits] - start[hits]) == expected,
                 10, f"encoder cache (queries, hits) {expected}")

    first = _chat(client, chat)
    counted((1, 0))
    second = _chat(client, chat)
    counted((1, 0))
    third = _chat(client, from_file)
    counted((2, 1))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert second.usage.prompt_tokens == 37
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # two full blocks, the image's among them
    assert third.usage.prompt_tokens_details.cached_tokens == 0  # the image's block holds other text


def test_two_images_with_the_same_text_share_only_the_text_blocks_and_answer_apart(gemma3, client):
    """20 words, an image, 12 words: the first block is text alone, the second holds the image."""
    model, processor = gemma3[1], gemma3[2]
    chats = [[{"role": "user", "content": [
        {"type": "text", "text": prompt_text(range(100, 120))}, {"type": "image", "image": image(seed)},
        {"type": "text", "text": prompt_text(range(300, 312))}]}] for seed in (7, 8)]
    references = [reference(model, processor, chat, MAX_TOKENS)[0] for chat in chats]
    assert references[0] != references[1]  # the tiny model tells them apart
    answers = [_chat(client, as_urls(chat)) for chat in chats]
    assert [[t.token for t in a.choices[0].logprobs.content] for a in answers] == [token_strings(r) for r in references]
    again = _chat(client, as_urls(chats[0]))
    assert [a.usage.prompt_tokens for a in answers] == [39, 39]
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 16  # the text block; not the image's
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def _png(width: int, height: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BAD = {
    "undecodable": ([_image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())],
                    "could not be decoded"),
    "too large together": ([_image_part(_png(6000, 6000)), _image_part(_png(6000, 6000))], "left for this prompt's images"),
    "not base64": ([_image_part("data:image/png;base64,%%%")], "malformed"),
    "a BMP": ([_image_part("data:image/bmp;base64,Qk0eAAAAAAAAABoAAAAMAAAAAQABAAEAGAAAAP8A")],
              "could not be decoded as PNG, JPEG, WebP or GIF"),
    "too many": ([_image_part(data_url(image(1)))] * 3, "at most 2 images"),
    "too large": ([_image_part(_png(9000, 8000))], "more than"),
    "outside the folder": ([_image_part("file:///etc/hostname")], "outside --allowed-local-media-path"),
    "a private host": ([_image_part("http://127.0.0.1:1/a.png")], "private address"),
    "another scheme": ([_image_part("ftp://example.com/a.png")], "must be a data:"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_get_400_and_leave_the_server_healthy(stack, case):
    parts, says = BAD[case]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "w5"}]}], "max_tokens": 2}
    response = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages" and says in error["message"]
    assert httpx.get(stack.url + "/health").status_code == 200
    wait_for(lambda: stack.metrics()["pagoda:kv_cache_usage_perc"] == 0, 5, "every KV block freed")


def test_images_outside_user_messages_and_prompt_logprobs_are_refused(stack):
    url = stack.url + "/v1/chat/completions"
    assistant = {"messages": [{"role": "assistant", "content": [_image_part(data_url(image(1)))]},
                              {"role": "user", "content": "w5"}]}
    response = httpx.post(url, json=assistant, timeout=30)
    assert response.status_code == 400 and "only user messages" in response.json()["error"]["message"]
    scored = {"messages": as_urls(CHATS["one image"]), "prompt_logprobs": 1, "max_tokens": 1}
    response = httpx.post(url, content=json.dumps(scored), headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


def test_the_responses_and_messages_apis_take_images_as_chat_does(stack, client):
    """An `input_image` part (openai SDK, /v1/responses) and an `image` block (anthropic SDK,
    /v1/messages, base64 and url sources) answer as the chat completion of the same content."""
    import anthropic

    url, text = data_url(image(1)), prompt_text(range(10, 40))
    chat = _chat(client, [{"role": "user", "content": [_image_part(url), {"type": "text", "text": text}]}])
    answer = chat.choices[0].message.content
    assert answer
    response = client.responses.create(model=_model(client), max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": text}]}])
    assert response.output_text == answer
    claude = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)
    data = url.split(",", 1)[1]
    for source in ({"type": "base64", "media_type": "image/png", "data": data}, {"type": "url", "url": url}):
        message = claude.messages.create(model=_model(client), max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": text}]}])
        assert message.content[0].text == answer


def test_bench_vision_times_a_cached_image_against_a_new_one(gemma3, tmp_path):
    """`pagoda bench vision` on the tiny model: the result's structure and exact cache counts (two
    rounds and a warm-up: each new image encoded, each repeat found), never its timings."""
    from pagoda.cli import main

    out = tmp_path / "vision.json"
    assert main(["bench", "vision", "--model", str(gemma3[0]), "--rounds", "2", "--text-words", "20",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "vision" and result["image_tokens"] == 4
    assert [len(result["rows"][k]["ttft_ms"]) for k in ("new_image", "cached_image")] == [2, 2]
    assert result["encoder_cache"] == {"queries": 6, "hits": 3}
    assert result["ratio"] == pytest.approx(result["rows"]["cached_image"]["ttft_ms_median"]
                                            / result["rows"]["new_image"]["ttft_ms_median"], abs=1e-3)


@pytest.mark.parametrize("size", [1, 2])
def test_qwen_vl_served_greedy_tokens_equal_transformers(qwen, size):
    """Through `pagoda up` and the openai SDK (the gateway expands each image's pad token without
    transformers' processor, which needs torchvision), in 7-token chunks that split images."""
    _served_matches(qwen[0], QWEN_CHATS, qwen[3], "--max-num-batched-tokens", "7", "--tensor-parallel-size", str(size))


def test_gemma3_served_at_tensor_parallel_size_1(gemma3):
    _served_matches(gemma3[0], CHATS, gemma3[3], "--max-num-batched-tokens", "14")


def _served_matches(directory, chats: dict, references: dict, *flags: str) -> None:
    """Each chat through a stack of `flags` equals its reference."""
    stack = Stack("--model", str(directory), "--num-gpu-blocks", "64", *flags).wait_ready()
    try:
        _assert_chats(openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0), chats, references)
    finally:
        assert stack.stop() == 0
