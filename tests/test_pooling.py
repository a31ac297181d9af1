"""Pooling models (docs/pooling.md): embeddings and cross-encoder scores against sentence-transformers,
offline (`LLM.embed`, `LLM.score`) and through the served routes with the real clients (openai,
langchain), chunked, batched, prefix-cached and at tensor-parallel size 2; and the 4xx answers."""
from __future__ import annotations

import base64
import json
import math
import shutil
import struct

import httpx
import openai
import pytest

from common.config import GatewayConfig
from common.models import resolve_model
from common.pooling import PoolerConfig, cosine, pooler_config
from common.protocol import PoolingParams
from common.redis_server import free_port
from tests.families import TOKENIZER
from tests.pooling_models import TEXTS, cross_encoder, embedder, encoder_cross_encoder, encoder_embedder
from tests.stack import Stack, serve_app, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUERY = "w5 w6 w7"
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, reference vectors of TEXTS)."""
    root = tmp_path_factory.mktemp("pooling")
    out = {}
    for name, pooling in (("last", "lasttoken"), ("mean", "mean"), ("cls", "cls")):
        st = embedder(root / name, pooling)
        out[name] = root / name, st.encode(TEXTS, convert_to_tensor=True).tolist()
    ce = cross_encoder(root / "reranker")
    out["reranker"] = root / "reranker", ce.predict([(QUERY, t) for t in TEXTS]).tolist()
    return out


def _llm(directory, **kwargs):
    from pagoda.offline import LLM

    return LLM(str(directory), device="cpu", dtype="float32", **kwargs)


@pytest.mark.parametrize("family, pooling, size", [("bert", "mean", 1), ("xlm-roberta", "cls", 1), ("bert", "cls", 2)])
def test_encoder_embeddings_equal_sentence_transformers_whole_in_one_step(tmp_path, family, pooling, size):
    st = encoder_embedder(tmp_path / family, family, pooling)
    reference = st.encode(TEXTS, convert_to_tensor=True).tolist()
    # a budget of 16 would chunk TEXTS[1] and [3]: an encoder's engine raises it to the context
    llm = _llm(tmp_path / family, max_num_batched_tokens=16, tensor_parallel_size=size)
    try:
        config = llm.scheduler.config
        assert (config.enable_chunked_prefill, config.max_num_batched_tokens) == (False, llm.config.max_model_len)
        for out, ref in zip(llm.embed(TEXTS, use_tqdm=False), reference):
            assert cosine(out.embedding, ref) >= MIN_COSINE
    finally:
        llm.close()
    if size == 1:
        (tmp_path / family / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
        with pytest.raises(ValueError, match="an encoder pools its inputs' mean or CLS"):
            pooler_config(resolve_model(str(tmp_path / family)))


@pytest.mark.parametrize("name", ["last", "mean", "cls"])
def test_embeddings_equal_sentence_transformers_chunked_batched_and_alone(models, name):
    directory, reference = models[name]
    llm = _llm(directory, max_num_batched_tokens=16)  # TEXTS[3] (38 tokens) in three chunks
    batched = llm.embed(TEXTS, use_tqdm=False)
    assert [out.prompt_token_ids for out in batched] == [llm.encode(t) for t in TEXTS]
    for out, ref in zip(batched, reference):
        assert len(out.embedding) == 64
        assert cosine(out.embedding, ref) >= MIN_COSINE
        assert math.isclose(math.fsum(v * v for v in out.embedding), 1.0, rel_tol=1e-5)  # Normalize
    for text, out in zip(TEXTS, batched):
        alone = llm.embed(text, use_tqdm=False)[0].embedding
        assert max(abs(a - b) for a, b in zip(alone, out.embedding)) < 1e-6
    assert not llm.scheduler.block_manager.num_slots  # every request's blocks freed


def test_last_token_pooling_reads_the_prefix_cache_and_whole_prompt_pooling_does_not(models):
    long = TEXTS[3]  # 38 tokens: two full blocks
    last = _llm(models["last"][0])
    first = last.generate([last.encode(long)], _pooling(last), use_tqdm=False)[0]
    again = last.generate([last.encode(long)], _pooling(last), use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert _floats(first.pooled) == pytest.approx(_floats(again.pooled), abs=1e-6)  # its last row, of 38 or 6 rows
    mean = _llm(models["mean"][0])
    runs = [mean.generate([mean.encode(long)], _pooling(mean), use_tqdm=False)[0] for _ in range(2)]
    assert [r.num_cached_tokens for r in runs] == [0, 0]
    assert cosine(_floats(runs[1].pooled), models["mean"][1][3]) >= MIN_COSINE


def _pooling(llm):
    from common.protocol import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=0, pooling=llm.executor.runner.pooler_config.params())


def _floats(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def test_a_request_that_asks_no_normalization_gets_the_raw_pool(models):
    from common.protocol import PoolingParams, SamplingParams

    llm = _llm(models["mean"][0])
    raw = llm.generate([llm.encode(TEXTS[1])], SamplingParams(temperature=0.0, max_tokens=0, pooling=PoolingParams(
        "embed", "mean", normalize=False)), use_tqdm=False)[0]
    values = _floats(raw.pooled)
    norm = math.sqrt(math.fsum(v * v for v in values))
    assert not math.isclose(norm, 1.0, rel_tol=1e-3)
    assert [v / norm for v in values] == pytest.approx(models["mean"][1][1], abs=1e-5)
    with pytest.raises(ValueError, match="a pooling model"):
        llm.generate(["w5"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_causal_checkpoint_served_with_runner_pooling_embeds_its_last_token(tmp_path):
    """Qwen3-Embedding's path: a *ForCausalLM checkpoint (its LM head left unread), last-token
    pooling, normalized; the reference is transformers' final hidden state."""
    import torch

    from tests import families

    model = families.build("qwen3", tmp_path)
    llm = _llm(tmp_path, runner="pooling")
    assert llm.executor.runner.pooler_config.params() == PoolingParams("embed", "last", True)
    ids = families.prompts()[:3]
    with torch.inference_mode():
        reference = [torch.nn.functional.normalize(
            model.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1).tolist() for p in ids]
    for out, ref in zip(llm.embed(ids, use_tqdm=False), reference):
        assert cosine(out.embedding, ref) >= MIN_COSINE


# the two tokens sit in different vocabulary shards at tensor-parallel size 2
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w10", "w300"]}


@pytest.mark.parametrize("size", [1, 2])
def test_a_causal_lm_scored_by_two_tokens_logits_as_qwen3_reranker_is_published(tmp_path, size):
    """--hf-overrides classifier_from_token: the score is the positive token's probability of the
    two, from the LM head at the pair's last position (transformers is the reference)."""
    import torch

    from tests import families

    model = families.build("qwen3", tmp_path)
    llm = _llm(tmp_path, hf_overrides=QWEN3_RERANKER, tensor_parallel_size=size)
    try:
        assert llm.executor.runner.pooler_config.params() == PoolingParams("classify", "last", False)
        query, documents = "w5 w6 w7", ["w8 w9", "w300 w301 w302", "w10"]
        scores = llm.score(query, documents, use_tqdm=False)
    finally:
        llm.close()
    with torch.inference_mode():
        expected = []
        for document in documents:
            ids = [int(w[1:]) for w in f"{query} {document}".split()]
            logits = model(torch.tensor([ids])).logits[0, -1]
            expected.append(torch.softmax(logits[[10, 300]], dim=-1)[1].item())
    assert scores == pytest.approx(expected, abs=1e-5)


def test_the_pooling_task_is_read_from_the_checkpoint(models, tmp_path):
    mean = pooler_config(resolve_model(str(models["mean"][0])))
    assert (mean.params(), mean.dimensions, mean.prompts) == (PoolingParams("embed", "mean", True), 64,
                                                             {"query": "", "document": ""})
    assert pooler_config(resolve_model(str(models["reranker"][0]))) == PoolerConfig(
        "classify", "last", False, dimensions=1, num_labels=1, labels=("LABEL_0",))
    assert pooler_config(resolve_model(str(models["reranker"][0])), runner="generate") is None
    assert pooler_config(resolve_model(str(models["mean"][0])), convert="classify").task == "classify"
    assert pooler_config(resolve_model(str(models["reranker"][0])), overrides=QWEN3_RERANKER).num_labels == 1
    with pytest.raises(ValueError, match="must name two tokens"):
        pooler_config(resolve_model(str(models["reranker"][0])), overrides={"classifier_from_token": ["yes"]})
    legacy = tmp_path / "legacy"
    shutil.copytree(models["cls"][0], legacy)
    (legacy / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert pooler_config(resolve_model(str(legacy))).pooling_type == "mean"
    modules = json.loads((legacy / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (legacy / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="also has Dense"):
        pooler_config(resolve_model(str(legacy)))


def test_an_engine_admits_only_the_requests_of_its_kind():
    """The gateway (from the status) and the scheduler (from its workers' hello) apply one rule."""
    from common.admission import AdmissionLimits, check_admissible
    from common.protocol import SamplingParams

    def limits(task: str) -> AdmissionLimits:
        return AdmissionLimits(64, 16, 1024, 8, 64, True, task)

    embed = SamplingParams(max_tokens=0, pooling=PoolingParams())
    assert check_admissible(4, embed, limits("embed")) is None
    assert check_admissible(4, SamplingParams(), limits("")) is None
    assert check_admissible(4, SamplingParams(), limits("embed")).message == \
        "the engine serves a pooling model (embed), and this request asks for generation"
    assert check_admissible(4, embed, limits("")).code == "wrong_model_kind"
    assert check_admissible(4, embed, limits("classify")) is not None


@pytest.mark.parametrize("family, size", [("bert", 1), ("xlm-roberta", 1), ("bert", 2)])
def test_encoder_cross_encoder_scores_equal_sentence_transformers(tmp_path, family, size):
    """BERT's pair has token types (1 after the first [SEP]); both heads run on the CLS token."""
    reference = encoder_cross_encoder(tmp_path, family).predict([(QUERY, t) for t in TEXTS]).tolist()
    llm = _llm(tmp_path, tensor_parallel_size=size)
    try:
        assert llm.executor.runner.pooler_config.params() == PoolingParams("classify", "cls", False)
        assert llm.score(QUERY, TEXTS, use_tqdm=False) == pytest.approx(reference, abs=1e-4)
    finally:
        llm.close()


def test_cross_encoder_scores_equal_sentence_transformers_in_order(models):
    directory, reference = models["reranker"]
    llm = _llm(directory)
    scores = llm.score(QUERY, TEXTS, use_tqdm=False)
    assert scores == pytest.approx(reference, abs=1e-4)
    assert sorted(range(len(TEXTS)), key=scores.__getitem__) == sorted(range(len(TEXTS)), key=reference.__getitem__)


def test_pagoda_embed_prints_vectors_and_scores(models, capsys):
    from pagoda import cli

    flags = ["--device", "cpu", "--dtype", "float32"]
    assert cli.main(["embed", "--model", str(models["cls"][0]), *flags, "--input", TEXTS[0], "--input", TEXTS[1]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert all(cosine(line["embedding"], ref) >= MIN_COSINE for line, ref in zip(lines, models["cls"][1]))
    assert cli.main(["embed", "--model", str(models["reranker"][0]), *flags, "--query", QUERY, "--input", TEXTS[2]]) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line == {"index": 0, "score": pytest.approx(models["reranker"][1][2], abs=1e-4)}
    assert cli.main(["embed", "--model", str(models["cls"][0]), *flags]) == 2
    assert "give at least one --input" in capsys.readouterr().err


def test_bench_embed_times_both_engines_on_the_same_texts(models, tmp_path):
    from pagoda import cli

    out = tmp_path / "embed.json"
    assert cli.main(["bench", "embed", "--model", str(models["last"][0]), "--num-texts", "6", "--min-len", "3",
                     "--max-len", "30", "--rounds", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["benchmark"], result["num_texts"], result["pooling"]) == ("embed", 6, "last")
    assert set(result["rows"]) == {"sentence_transformers", "pagoda"}
    assert result["min_cosine"] >= MIN_COSINE
    assert result["num_tokens"] > 0 and all(row["texts_per_s"] > 0 for row in result["rows"].values())


def test_embeddings_at_tensor_parallel_size_2(models):
    directory, reference = models["mean"]
    group = _llm(directory, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        for out, ref in zip(group.embed(TEXTS, use_tqdm=False), reference):
            assert cosine(out.embedding, ref) >= MIN_COSINE
    finally:
        group.close()


# ---------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def stack(models):
    stack = Stack("--model", str(models["last"][0]), "--num-gpu-blocks", "64", "--max-model-len", "64").wait_ready()
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def test_openai_embeddings_float_and_base64(stack, client, models):
    reference = models["last"][1]
    floats = client.embeddings.create(model=_model(stack), input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for d, ref in zip(floats.data, reference):
        assert cosine(d.embedding, ref) >= MIN_COSINE
    # the SDK asks for base64 and decodes it when no format is given
    decoded = client.embeddings.create(model=_model(stack), input=TEXTS)
    for d, f in zip(decoded.data, floats.data):
        assert d.embedding == pytest.approx(f.embedding, abs=1e-6)
    raw = httpx.post(stack.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert _floats(base64.b64decode(raw["data"][0]["embedding"])) == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(t.split()) for t in TEXTS)
    ids = client.embeddings.create(model=_model(stack), input=[[5, 9, 11]], dimensions=8)
    assert len(ids.data[0].embedding) == 8
    assert math.isclose(math.fsum(v * v for v in ids.data[0].embedding), 1.0, rel_tol=1e-5)
    assert cosine(ids.data[0].embedding, reference[0][:8]) >= MIN_COSINE
    wait_for(lambda: stack.metrics()["pagoda:kv_cache_usage_perc"] == 0, 5, "every KV block freed")


def test_langchain_embeds_documents_unchanged(stack, models):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=_model(stack), base_url=stack.url + "/v1", api_key="none",
                                  check_embedding_ctx_length=False)
    vectors = embeddings.embed_documents(TEXTS[:3])
    assert all(cosine(v, ref) >= MIN_COSINE for v, ref in zip(vectors, models["last"][1]))
    assert cosine(embeddings.embed_query(TEXTS[0]), models["last"][1][0]) >= MIN_COSINE


def test_an_embedder_scores_and_reranks_by_cosine(stack, models):
    reference = models["last"][1]
    query = [*map(float, _embed(stack, QUERY))]
    expected = [cosine(query, ref) for ref in reference]
    score = httpx.post(stack.url + "/score", json={"text_1": QUERY, "text_2": TEXTS}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    rerank = httpx.post(stack.url + "/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2}).json()
    best = sorted(range(len(TEXTS)), key=expected.__getitem__, reverse=True)[:2]
    assert [r["index"] for r in rerank["results"]] == best
    assert rerank["results"][0]["document"] == {"text": TEXTS[best[0]]}


@pytest.mark.parametrize("kind", ["bert-embedder", "bert-embedder-tp2", "bert-reranker", "qwen3-yes-no-reranker"])
def test_each_kind_of_pooling_model_served_through_the_api(tmp_path, kind):
    """An encoder embedder through the openai SDK (float and base64; also at tensor-parallel size 2),
    an encoder cross-encoder and Qwen3-Reranker as published (--hf-overrides) through /v1/rerank,
    /rerank and /score, each against its reference."""
    import torch

    from tests import families

    flags = ["--num-gpu-blocks", "64", "--max-model-len", "64"]
    if kind == "bert-embedder-tp2":
        flags += ["--tensor-parallel-size", "2"]
    if kind.startswith("bert-embedder"):
        reference = encoder_embedder(tmp_path / "m", "bert", "mean").encode(TEXTS, convert_to_tensor=True).tolist()
    elif kind == "bert-reranker":
        reference = encoder_cross_encoder(tmp_path / "m").predict([(QUERY, t) for t in TEXTS]).tolist()
    else:
        model = families.build("qwen3", tmp_path / "m")
        flags += ["--hf-overrides", json.dumps(QWEN3_RERANKER)]
        with torch.inference_mode():
            reference = [torch.softmax(model(torch.tensor([[int(w[1:]) for w in f"{QUERY} {t}".split()]])).logits[
                0, -1, [10, 300]], dim=-1)[1].item() for t in TEXTS]
    stack = Stack("--model", str(tmp_path / "m"), *flags).wait_ready()
    try:
        if kind.startswith("bert-embedder"):
            client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
            for encoding_format in ("float", "base64"):
                data = client.embeddings.create(model=_model(stack), input=TEXTS, encoding_format=encoding_format).data
                assert all(cosine(d.embedding if encoding_format == "float" else
                                  _floats(base64.b64decode(d.embedding)), ref) >= MIN_COSINE
                           for d, ref in zip(data, reference))
        else:
            order = sorted(range(len(TEXTS)), key=reference.__getitem__, reverse=True)
            for route in ("/v1/rerank", "/rerank"):
                answer = httpx.post(stack.url + route, json={"query": QUERY, "documents": TEXTS,
                                                             "return_documents": route == "/rerank"}).json()
                assert [r["index"] for r in answer["results"]] == order
                assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
                    [reference[i] for i in order], abs=1e-4)
                assert ("document" in answer["results"][0]) == (route == "/rerank")
            pairwise = httpx.post(stack.url + "/score", json={"text_1": [QUERY] * 2, "text_2": TEXTS[:2]}).json()
            assert [d["score"] for d in pairwise["data"]] == pytest.approx(reference[:2], abs=1e-4)
            refused = httpx.post(stack.url + "/v1/embeddings", json={"input": "w5"})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_embedding"
    finally:
        assert stack.stop() == 0


def _embed(stack, text: str) -> list[float]:
    return httpx.post(stack.url + "/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]


def _model(stack) -> str:
    return httpx.get(stack.url + "/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("body, status, param, says", [
    ({"input": ""}, 400, "input", "must not be empty"),
    ({"input": []}, 400, "input", "must not be empty"),
    ({"input": 5}, 400, "input", "must be a string, a list of strings"),
    ({"input": [[5, 600]]}, 400, "input", "outside the vocabulary"),
    ({"input": "w1 " * 80}, 400, "input", "context"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ({"input": "w5", "dimensions": 65}, 400, "dimensions", "at most the model's 64"),
    ({"input": "w5", "model": "other"}, 404, "model", "does not exist"),
])
def test_bad_embedding_requests_are_4xx(stack, body, status, param, says):
    response = httpx.post(stack.url + "/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_truncation_and_the_generation_routes_of_a_pooling_model(stack, models):
    body = {"input": "w1 " * 80, "truncate_prompt_tokens": 10}
    answer = httpx.post(stack.url + "/v1/embeddings", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 10
    assert cosine(answer["data"][0]["embedding"], _embed(stack, "w1 " * 10)) >= MIN_COSINE
    whole = httpx.post(stack.url + "/v1/embeddings", json={"input": "w1 " * 80, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 64  # --max-model-len
    response = httpx.post(stack.url + "/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_generative"


def test_a_generation_model_refuses_to_embed(tiny, tmp_path):
    from gateway.app import create_app

    shutil.copytree(tiny[0], tmp_path, dirs_exist_ok=True)
    for file in TOKENIZER.iterdir():
        shutil.copy(file, tmp_path)
    port = free_port()
    with serve_app(create_app(GatewayConfig(redis_url="redis://127.0.0.1:1/0", model=str(tmp_path))), port):
        response = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "model_not_pooling"
