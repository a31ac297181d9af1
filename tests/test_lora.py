"""Batched multi-LoRA serving. Random PEFT adapters (made by peft) of a tiny Qwen3 and of the
default model: each adapter's greedy tokens are transformers+PEFT's and its logprobs agree within
1e-4 in float32, offline in a mixed batch (8 adapters and the base, 3 slots), under swap
preemption, over a tensor-parallel group of 2, through `pagoda generate --lora` and through the
served API; the slots, the prefix cache's keys by adapter, the checks before an adapter is served,
the runtime load and unload endpoints and the SGMV kernels."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.lora import LoRAAdapterError, lora_int_id, parse_lora_modules, read_adapter, target_shapes
from common.protocol import LoRARequest, SamplingParams
from scheduler.lora_slots import LoRASlots
from pagoda.bench.stack import parse_samples
from tests import families
from tests.stack import Stack, wait_for
from tests.lora_adapters import ALL, TOLERANCE, build_tiny, make_adapter
from tests.lora_adapters import check_outputs as _check
from tests.lora_adapters import mixed_batch as _mixed_batch
from tests.triton_env import count_compiled_for_sm90, tolerance

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory)


def test_the_references_differ_by_adapter(tiny):
    """Each adapter changes its prompt's output: the parity below is not the base's by accident."""
    _, _, _, references, base_reference = tiny
    assert all(r.token_ids[0] != base_reference.token_ids[i] for i, r in enumerate(references))


# ----------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def llm(tiny):
    from pagoda.offline import LLM

    return LLM(str(tiny[0]), enable_lora=True, max_loras=3, max_lora_rank=16, dtype="float32")


def test_a_mixed_batch_of_8_adapters_and_the_base_matches_transformers_and_peft(llm, tiny):
    """16 requests at once, 8 adapters over 3 slots: each adapter is loaded once (the order allows
    no fewer), no slot is reloaded while a request reads it, and every output is its reference."""
    plans = _record_plans(llm)
    outputs = _mixed_batch(llm, tiny)
    _check(outputs, tiny)
    slots = llm.scheduler.lora_slots
    assert (slots.num_loads, slots.num_evictions) == (8, 5)
    slots.check_integrity()
    assert not slots.pins  # every request done: nothing pinned
    # within each plan and the plan in flight before it, a slot serves one adapter
    held: dict[int, tuple] = {}  # slot -> adapter key loaded there, as the workers see it
    in_use: dict[int, int] = {}  # seq_id -> its slot
    for plan in plans:
        for seq_id in plan.finished_seq_ids + plan.preempted_seq_ids:
            in_use.pop(seq_id, None)
        for slot, lora in plan.lora_loads:
            assert slot not in in_use.values(), f"slot {slot} reloaded while a sequence reads it"
            held[slot] = lora.key
        for new in plan.new_seqs:
            in_use[new.seq_id] = new.lora_slot
    assert llm.executor.runner.lora.slots == [held.get(s) for s in range(3)]


def _record_plans(llm) -> list:
    plans, schedule = [], llm.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    llm.scheduler.schedule = recording
    return plans


def test_swap_preemption_with_adapters_resident_keeps_every_output(llm, tiny):
    # (the tiny Qwen3's windowed and global layers: KV cache groups, a block of half the layers)
    llm.reset(num_gpu_blocks=23, preemption_mode="swap")
    try:
        outputs = _mixed_batch(llm, tiny)
        assert llm.scheduler.num_swap_preemptions > 0
        _check(outputs, tiny)
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == 22 and not bm.block_tables  # no block leaked (cached ones count as free)
    finally:
        llm.reset()


def test_the_prefix_cache_never_crosses_adapters(llm, tiny):
    """One 70-token prompt four times: adapter a0 (nothing cached), a1 (a0's blocks are not a1's),
    the base (nor the base's), a0 again (its own 64 tokens)."""
    _, prompts, adapters, _, _ = tiny
    prompt = prompts[-1]
    params = SamplingParams(temperature=0, max_tokens=1)
    cached = [llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
              for lora in (adapters[0], adapters[1], None, adapters[0])]
    assert cached == [0, 0, 0, 64]


def test_the_memory_snapshot_names_each_sequences_adapter(llm, tiny):
    """The memory page's data: a sequence with an adapter carries its name, one without has no key."""
    from common.memory_snapshot import check_snapshot, snapshot_json
    from scheduler.memory_view import build_snapshot

    _, prompts, adapters, _, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.engine.add_request("with-a3", prompts[3], params, adapters[3])
    llm.engine.add_request("plain", prompts[4], params)
    llm.engine.step()
    snapshot = snapshot_json(build_snapshot(llm.scheduler))
    assert check_snapshot(snapshot) == []
    assert {seq["request_id"]: seq.get("lora") for seq in snapshot["sequences"]} == {"with-a3": "a3", "plain": None}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_an_adapter_is_refused_before_anything_runs(llm, tiny, tmp_path):
    _, prompts, _, _, _ = tiny
    high = make_adapter(tiny[0], tmp_path / "r32", seed=1, rank=32, targets=["q_proj"])
    del high
    with pytest.raises(LoRAAdapterError, match="LoRA rank 32 is greater than --max-lora-rank 16"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("r32", 9, str(tmp_path / "r32")))
    assert not llm.scheduler.has_unfinished_requests()


def test_a_tensor_parallel_group_of_2_serves_the_mixed_batch(tiny):
    """A shards as its layer's input (o_proj, down_proj), B as its layer's output (qkv, gate_up)."""
    from pagoda.offline import LLM
    from worker.parallel import get_tp_group, set_tp_group

    saved = get_tp_group()  # rank 0 runs here: the process's group until it is given back
    group = LLM(str(tiny[0]), enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32", tensor_parallel_size=2)
    try:
        _check(_mixed_batch(group, tiny), tiny)
    finally:
        group.close()
        set_tp_group(saved)


# ----------------------------------------------------------------------------- the default model, through the CLI


@pytest.mark.slow
def test_pagoda_generate_with_lora_matches_transformers_and_peft_on_the_default_model(tmp_path):
    from common.models import resolve_model
    from tests.prompts import PARITY_PROMPTS
    from worker.loader import hf_directory

    base_dir = hf_directory(resolve_model("default"))
    model = make_adapter(base_dir, tmp_path / "sql", seed=7, rank=16, targets=ALL, scale_b=0.05)
    from common.tokenizer import load_tokenizer
    from gateway.tokenizer import PromptEncoder

    prompts = [PARITY_PROMPTS[0], PARITY_PROMPTS[1]]
    encoder = PromptEncoder(load_tokenizer(resolve_model("default")))  # as `pagoda generate` encodes them
    ids = [encoder.encode_chat(p["messages"]) if "messages" in p else encoder.encode_text(p["prompt"]) for p in prompts]
    reference = families.reference(model, ids, max_tokens=24)
    with model.disable_adapter():
        base = families.reference(model, ids[:1], max_tokens=24)
    assert reference.token_ids[0] != base.token_ids[0]  # the adapter changes the output
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--json", "--temperature", "0", "--max-tokens", "24",
         "--ignore-eos", "--logprobs", "0", "--prompts-file", str(prompts_file), "--device", "cpu", "--dtype",
         "float32", "--quantization", "none", "--lora", f"sql={tmp_path / 'sql'}"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["token_ids"] for r in results] == reference.token_ids
    for result, logprobs in zip(results, reference.logprobs, strict=True):
        assert [entry[0] for entry in result["logprobs"]] == pytest.approx(logprobs, abs=TOLERANCE)


# ----------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def stack(tiny, redis_url):
    directory, _, adapters, _, _ = tiny
    modules = [f"{lora.lora_name}={lora.lora_path}" for lora in adapters[:2]]
    stack = Stack("--model", str(directory), "--redis-url", redis_url, "--dtype", "float32", "--enable-lora",
                  "--max-loras", "1", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                  "--lora-modules", *modules).wait_ready()
    yield stack
    assert stack.stop() == 0


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_served_api_lists_the_adapters_and_serves_each_as_transformers_and_peft(stack, tiny):
    directory, prompts, adapters, references, base_reference = tiny
    client = _client(stack)
    cards = client.models.list().data
    assert [(m.id, getattr(m, "parent", None), getattr(m, "root", None)) for m in cards] == [
        (directory.name, None, None), ("a0", directory.name, adapters[0].lora_path),
        ("a1", directory.name, adapters[1].lora_path)]
    # one slot: a0's and a1's requests at once take turns (a1's waits for a0's to finish)
    texts = [families.prompt_text(prompts[i]) for i in range(2)]
    answers = _complete_all(client, [("a0", texts[0]), ("a1", texts[1]), (directory.name, texts[0])])
    expected = [references[0], references[1]]
    for answer, reference in zip(answers[:2], expected):
        assert answer.model in ("a0", "a1")
        assert answer.choices[0].logprobs.tokens == families.token_strings(reference.token_ids[0])
        assert answer.choices[0].logprobs.token_logprobs == pytest.approx(reference.logprobs[0], abs=TOLERANCE)
    assert answers[2].choices[0].logprobs.tokens == families.token_strings(base_reference.token_ids[0])
    def info() -> list[dict]:
        return [labels for name, labels, _ in parse_samples(httpx.get(stack.url + "/metrics").text)
                if name == "pagoda:lora_requests_info"]

    idle = [{"model_name": directory.name, "engine": "0", "running_lora_adapters": "", "waiting_lora_adapters": "",
             "max_lora": "1"}]
    # the schedulers' statuses reach /metrics twice a second: the one after both requests ran
    wait_for(lambda: stack.metrics().get("pagoda:lora_loads_total") == 2 and info() == idle, 10,
             "two adapter loads and no adapter running in /metrics")
    assert stack.metrics()["pagoda:lora_evictions_total"] == 1


def _complete_all(client, requests):
    import concurrent.futures

    def one(model_prompt):
        model, prompt = model_prompt
        return client.completions.create(model=model, prompt=prompt, max_tokens=families.MAX_TOKENS, temperature=0,
                                         logprobs=0)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_an_unknown_adapter_is_a_404_model_not_found(stack, tiny):
    odd = httpx.post(stack.url + "/v1/completions", json={"model": ["a0"], "prompt": "w5", "max_tokens": 1})
    assert (odd.status_code, odd.json()["error"]["code"]) == (404, "model_not_found")
    response = httpx.post(stack.url + "/v1/completions", json={"model": "nope", "prompt": "w5", "max_tokens": 1})
    assert response.status_code == 404
    assert response.json() == {"error": {
        "message": f"the model 'nope' does not exist; this server serves '{tiny[0].name}' and the LoRA adapters "
                   "['a0', 'a1']",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_adapters_load_and_unload_at_runtime_while_requests_run(stack, tiny, tmp_path):
    directory, prompts, adapters, references, _ = tiny
    client = _client(stack)
    stream = client.completions.create(model="a0", prompt=families.prompt_text(prompts[0]), max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # a0 runs
    load = httpx.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters[2].lora_path})
    assert (load.status_code, load.text) == (200, "Success: LoRA adapter 'a2' added successfully.")
    again = httpx.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters[2].lora_path})
    assert again.status_code == 400 and again.json()["error"]["message"] == "The lora adapter 'a2' has already been loaded."
    high = make_adapter(directory, tmp_path / "r32", seed=3, rank=32, targets=["q_proj"])
    del high
    refused = httpx.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "r32", "lora_path": str(tmp_path / "r32")})
    assert refused.status_code == 400 and "LoRA rank 32 is greater than --max-lora-rank 16" in refused.json()["error"]["message"]
    (answer,) = _complete_all(client, [("a2", families.prompt_text(prompts[2]))])  # waits for a0's one slot
    assert answer.choices[0].logprobs.tokens == families.token_strings(references[2].token_ids[0])
    assert sum(1 for _ in stream) > 0  # a0's stream went on to its end
    unload = httpx.post(stack.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    gone = httpx.post(stack.url + "/v1/completions", json={"model": "a2", "prompt": "w5", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = httpx.post(stack.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The lora adapter 'a2' cannot be found."
    assert [m.id for m in client.models.list().data] == [directory.name, "a0", "a1"]


def test_an_adapter_the_workers_cannot_load_fails_its_own_requests_alone(stack, tiny, tmp_path):
    """Its files gone after the gateway checked them: its request ends in an error naming it, while
    a stream of another adapter runs on to its end and the stack serves on."""
    import shutil

    directory, prompts, adapters, references, _ = tiny
    shutil.copytree(adapters[3].lora_path, tmp_path / "gone")
    load = httpx.post(stack.url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "gone")})
    assert load.status_code == 200
    (tmp_path / "gone" / "adapter_model.safetensors").unlink()
    client = _client(stack)
    stream = client.completions.create(model="a0", prompt=families.prompt_text(prompts[0]), max_tokens=100,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    failed = httpx.post(stack.url + "/v1/completions", json={"model": "gone", "prompt": "w5 w6", "max_tokens": 4},
                        timeout=60)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "engine_error" and "LoRA adapter 'gone' could not be loaded" in error["message"]
    assert sum(len(chunk.choices[0].text) > 0 for chunk in stream) > 0  # a0's stream ran on
    (answer,) = _complete_all(client, [("a1", families.prompt_text(prompts[1]))])
    assert answer.choices[0].logprobs.tokens == families.token_strings(references[1].token_ids[0])
    assert httpx.post(stack.url + "/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200


def test_an_adapter_retrained_in_place_gets_a_new_id(tiny, tmp_path):
    """Unloaded, written again at the same path and loaded: a new id, so no slot, host cache or
    cached prefix block serves the old weights."""
    import shutil

    from common.models import resolve_model
    from gateway.lora import LoRARegistry

    directory, _, adapters, _, _ = tiny
    shutil.copytree(adapters[0].lora_path, tmp_path / "sql")
    registry = LoRARegistry(resolve_model(str(directory)), directory.name, 16)
    first = registry.add("sql", str(tmp_path / "sql"))
    registry.remove("sql")
    shutil.copy(Path(adapters[4].lora_path) / "adapter_model.safetensors", tmp_path / "sql")
    shutil.copy(Path(adapters[4].lora_path) / "adapter_config.json", tmp_path / "sql")
    second = registry.add("sql", str(tmp_path / "sql"))
    assert (first.lora_name, first.lora_path) == (second.lora_name, second.lora_path)
    assert first.lora_int_id != second.lora_int_id


# ----------------------------------------------------------------------------- checks before serving


@pytest.mark.parametrize("case", ["rank", "bin", "dora", "shapes", "embedding", "missing_b", "garbage", "expert"])
def test_an_adapter_that_cannot_be_served_is_refused_with_what_is_wrong(tiny, tmp_path, case):
    directory = tiny[0]
    path = tmp_path / "adapter"
    make_adapter(directory, path, seed=5, rank=8, targets=["q_proj", "v_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    shapes = target_shapes(_hf_config(directory))
    if case == "rank":
        expected = "LoRA rank 8 is greater than --max-lora-rank 4"
        with pytest.raises(LoRAAdapterError, match=expected):
            read_adapter(path, 4, shapes)
        return
    if case == "bin":
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
        expected = "no adapter_model.safetensors \\(adapter_model.bin is not loaded: it would be unpickled\\)"
    elif case == "dora":
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        expected = "DoRA is not supported"
    elif case == "garbage":
        (path / "adapter_model.safetensors").write_bytes(b"abc")
        expected = "not a readable PEFT adapter \\(error: unpack requires a buffer of 8 bytes\\)"
    elif case == "shapes":
        shapes = {**shapes, "q_proj": (64, 128)}
        expected = "maps 64 -> 64 features, the base model's q_proj maps 64 -> 128: an adapter of another model\\?"
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "adapter_model.safetensors")
        if case == "embedding":
            tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(8, 512)
            expected = "module 'model.embed_tokens' cannot be adapted"
        elif case == "expert":
            tensors["base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight"] = torch.zeros(8, 64)
            expected = "is a MoE expert: LoRA on experts is not supported"
        else:
            del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
            expected = "module 'model.layers.0.self_attn.q_proj' has lora_B missing"
        save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match=expected):
        read_adapter(path, 16, shapes)


def _hf_config(directory):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def test_lora_modules_take_name_path_and_vllms_json():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'])
    assert [(m.name, m.path, m.base_model_name) for m in modules] == [("sql", "/a/sql", None), ("chat", "/a/chat", "base")]
    with pytest.raises(LoRAAdapterError, match="names an adapter twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(LoRAAdapterError, match="expected NAME=PATH or JSON"):
        parse_lora_modules(["just-a-path"])
    assert lora_int_id("sql") == lora_int_id("sql") and 1 <= lora_int_id("sql") < 2**31


def test_kv_events_of_an_adapters_blocks_carry_its_lora_id():
    """vLLM's BlockStored.lora_id: a salted chain starts from no parent (its first key is the salt's)."""
    from common.kv_events import AllBlocksCleared, BlockStored
    from scheduler.block_manager import BlockManager, block_key, lora_salt

    bm = BlockManager(10, 4, enable_prefix_caching=True)
    bm.record_kv_events()
    tokens = list(range(10, 19))
    salt = lora_salt(7, "/a")
    bm.allocate(1, 9, tokens, salt=salt)
    bm.register_computed(1, tokens, 8)
    first = block_key(salt, tuple(tokens[:4]))
    second = block_key(first, tuple(tokens[4:8]))
    assert bm.take_kv_events() == [AllBlocksCleared(), BlockStored([first, second], None, tokens[:8], 4, 7)]
    assert bm.kv_snapshot() == [AllBlocksCleared(), BlockStored([first], None, tokens[:4], 4, 7),
                                BlockStored([second], first, tokens[4:8], 4, 7)]
    assert bm.cached_prefix_tokens(tokens, 9) == 0 and bm.cached_prefix_tokens(tokens, 9, salt) == 8
    assert bm.cached_prefix_tokens(tokens, 9, lora_salt(7, "/b")) == 0  # another path: another adapter


# ----------------------------------------------------------------------------- the slots


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60), st.integers(1, 4))
def test_the_slots_never_hand_a_pinned_slot_to_another_adapter(ops, max_loras):
    """Random acquires and releases of 6 adapters over 1-4 slots, against a model of the pins."""
    slots = LoRASlots(max_loras)
    loras = [LoRARequest(f"l{i}", i + 1, f"/l{i}") for i in range(6)]
    pins: dict[int, int] = {}
    loaded: dict[int, int] = {}  # slot -> adapter index, as the workers hold them
    for acquire, i in ops:
        if acquire:
            result = slots.acquire(loras[i])
            pinned_slots = {s for s, j in loaded.items() if pins.get(j)}
            if result is None:
                assert len(pinned_slots) == max_loras and not pins.get(i)
                continue
            slot, load = result
            assert load == (loaded.get(slot) != i)
            assert slot not in pinned_slots or loaded[slot] == i  # never another adapter's pinned slot
            loaded[slot] = i
            pins[i] = pins.get(i, 0) + 1
        elif pins.get(i):
            slots.release(loras[i])
            pins[i] -= 1
        slots.check_integrity()
        assert slots.running_names() == sorted(f"l{j}" for j, n in pins.items() if n)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [9, 300], ids=["decode-tiles", "prefill-tiles"])
def test_the_sgmv_kernels_match_the_reference_in_the_interpreter(dtype, rows):
    """Rows of 3 slots and none, shuffled: the grouping by slot, tiles of 16 rows (decode) and 64
    (prefill, a slot's rows over several tiles), the shrink's K split over programs, rank tiles."""
    import kernels
    from kernels import triton_lora
    from kernels.triton_lora import LoRAMeta

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    a = (torch.randn(3, 136, 200, generator=gen) * 0.1).to(dtype)  # 136 rank rows: 3 programs of 64
    b = (torch.randn(3, 200, 80, generator=gen) * 0.1).to(dtype)  # rank 80: 2 rounds of the expand's loop
    idx = torch.randint(-1, 3, (rows,), generator=gen)
    idx[:4] = torch.tensor([0, -1, 2, 2])
    meta = LoRAMeta.of(idx, 3)
    assert meta.counts.tolist() == [int((idx == s).sum()) for s in range(3)]
    assert sorted(idx[meta.order].tolist()) == idx[meta.order].tolist()
    want = kernels.lora_shrink(x, a, idx, impl="torch")
    got = kernels.lora_shrink(x, a, idx, meta=meta, impl="triton")
    torch.testing.assert_close(got, want, **tolerance(dtype))
    split = triton_lora.lora_shrink(x, a, idx, meta, split_k=3)  # K in 3 programs' partial sums
    torch.testing.assert_close(split, want, **tolerance(dtype))
    none = (idx == -1).nonzero().squeeze(1)
    assert torch.equal(got[none], torch.zeros(len(none), 136))  # no adapter: zeros
    y = torch.randn(rows, 260, generator=gen).to(dtype)
    want_y, got_y = y.clone(), y.clone()
    kernels.lora_expand(want[:, 8:88], b, idx, want_y, 40, impl="torch")
    kernels.lora_expand(want[:, 8:88], b, idx, got_y, 40, meta=meta, impl="triton")
    torch.testing.assert_close(got_y, want_y, **tolerance(dtype))
    assert torch.equal(got_y[none], y[none]) and torch.equal(got_y[:, :40], y[:, :40])  # untouched
    assert torch.equal(got_y[:, 240:], y[:, 240:])


@pytest.mark.parametrize("idx", [[3, -1, 0, 3, 3, 1, -1, 0, 2, 2, 3], [-1] + [2] * 20 + [0] * 16 + [-1] * 3,
                                 [1, -1, 2, 1] + [2] * 18 + [3, 0, 0]],
                         ids=["decode-mixed", "prefill-runs", "mixed-step"])
def test_the_cpu_path_applies_every_part_as_the_shrink_and_expand_do(idx):
    """kernels.lora.lora_apply (a layer's parts at once, B block-diagonal; rows grouped by slot, or
    run by run, in bfloat16) against the per-op reference (float32 in between); rows of no adapter
    untouched."""
    from kernels import lora

    gen = torch.Generator().manual_seed(1)
    idx = torch.tensor(idx)
    x = torch.randn(len(idx), 40, generator=gen).to(torch.bfloat16)
    a = torch.randn(4, 3 * 16, 40, generator=gen) * 0.1  # 3 parts of rank 16
    b_cat = torch.zeros(4, 3 * 16, 40)
    bs = []
    for p, (target, n) in enumerate([(0, 24), (24, 8), (32, 8)]):
        b_cat[:, p * 16:(p + 1) * 16, target:target + n] = torch.randn(4, 16, n, generator=gen) * 0.1
        bs.append(b_cat[:, p * 16:(p + 1) * 16, target:target + n].transpose(1, 2))
    y = torch.randn(len(idx), 40, generator=gen).to(torch.bfloat16)
    want, got = y.clone(), y.clone()
    t = lora.lora_shrink(x, a, idx)
    for p, (b, target) in enumerate(zip(bs, (0, 24, 32))):
        lora.lora_expand(t[:, p * 16:(p + 1) * 16], b, idx, want, target)
    segments = lora.Segments.of(idx)
    assert [len(segments.runs), segments.rows is not None] == {11: [0, True], 40: [2, False], 25: [1, True]}[len(idx)]
    lora.lora_apply(x, a.to(torch.bfloat16), b_cat.to(torch.bfloat16), segments, got)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
    untouched = idx < 0
    assert torch.equal(got[untouched], y[untouched])


def _compile_lora_for_sm90() -> list[str]:
    """The shrink and expand compiled for sm_90 (Triton's own ptxas), bf16 and fp16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_lora as tl_

    meta = {"order_ptr": "*i64", "counts_ptr": "*i32", "starts_ptr": "*i32"}
    done = []
    for dtype in ("bf16", "fp16"):
        for fn, types, consts in [
            (tl_._lora_shrink_kernel, {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "out_ptr": "*fp32", **meta},
             {"BLOCK_M": 16, "BLOCK_R": tl_.MAX_BLOCK_R, "BLOCK_K": tl_.SHRINK_BLOCK_K, "PRECISION": "tf32"}),
            (tl_._lora_expand_kernel, {"t_ptr": "*fp32", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", **meta},
             {"BLOCK_M": 64, "BLOCK_N": tl_.EXPAND_BLOCK_N, "BLOCK_R": tl_.MAX_BLOCK_R, "PRECISION": "tf32"}),
        ]:
            sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
            triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 2})
            done.append(f"{fn.__name__} {dtype}")
    return done


def test_the_sgmv_kernels_compile_for_hopper_without_a_gpu():
    assert count_compiled_for_sm90("tests.test_lora", "_compile_lora_for_sm90") == 4
