"""Every architecture of the registry equals transformers: greedy tokens exactly, each token's
logprob within 1e-4, in float32, on the tiny random models of tests/families.py (8 prompts, each
longer than the family's sliding window).

Per family: `pagoda generate` in one rank; the same engine with a pool too small for the batch,
preempting by swap and then by recompute with chunked prefill (but a model windowed on every layer gives blocks back as
it decodes: its own test preempts it with prompts shorter than its window); and the served API
(`pagoda up --tensor-parallel-size 2`, a small pool, recomputing) through the openai client.
`pagoda generate --tensor-parallel-size 2` (swapping) for a windowed family and a MoE one.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

import openai
import pytest
import torch

from common.protocol import SamplingParams
from pagoda import cli
from scheduler.kv_groups import HybridBlockManager
from tests import families
from tests.families import FAMILIES, MAX_TOKENS
from tests.stack import Stack, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOLERANCE = 1e-4
SMALL_POOL = 24  # blocks of 8 tokens: the 8 prompts need 55, so the batch preempts
# ... but for these: every layer windowed, the window a multiple of 8 and shorter than every prompt,
# so a decoding sequence gives a block back (scheduler/block_manager.remove_skipped_blocks) for each
# it takes and the small pool never preempts (the windowed test below preempts mistral's).
NEVER_PREEMPTED = ("mistral", "mixtral")
# Windowed and global layers: KV cache groups (scheduler/kv_groups.py), a block of half the layers, so
# the same bytes hold twice the blocks; the sliding group gives blocks back, and a prompt is admitted
# only once its blocks fit: 12 tokens never preempt. Decoding 40 (transformers' references made
# here), the batch preempts in 30 blocks of 8.
HYBRID = ("qwen3", "gemma2", "gemma3_text", "gpt_oss")
HYBRID_POOL, HYBRID_MAX_TOKENS = 30, 40


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return families.prompts()


@pytest.fixture(scope="module")
def built(tmp_path_factory, prompt_ids):
    """family -> (its directory, transformers' reference outputs)."""
    out = {}
    for name in FAMILIES:
        directory = tmp_path_factory.mktemp(name)
        model = families.build(name, directory)
        out[name] = directory, families.reference(model, prompt_ids)
    return out


def assert_matches(reference: families.Reference, token_ids: list[list[int]], logprobs: list[list[float]]) -> None:
    assert token_ids == reference.token_ids
    for mine, theirs in zip(logprobs, reference.logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=TOLERANCE)


def generate_json(capsys, directory, prompts_file, *flags: str) -> list[dict]:
    argv = ["generate", "--model", str(directory), "--prompts-file", str(prompts_file), "--json", "--temperature", "0",
            "--max-tokens", str(MAX_TOKENS), "--logprobs", "0", "--device", "cpu", "--dtype", "float32",
            "--block-size", "8", *flags]
    capsys.readouterr()
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    return [json.loads(line) for line in captured.out.splitlines()], captured.err


def test_the_registry_names_every_family_and_pagoda_models_prints_it(capsys):
    from worker.models import MODELS

    assert {info.model_type for info in MODELS} >= set(FAMILIES) | {"llama", "qwen2"}
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for info in MODELS:
        assert info.architecture in out and info.example in out


def test_the_readme_lists_the_registry():
    from worker.models import markdown_table

    readme = (families.ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README.md's model table differs from `pagoda models --markdown`"


def test_an_unsupported_architecture_fails_with_the_list(tmp_path, capsys):
    config = json.loads((families.ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForTokenClassification"]}))
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "w5", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pagoda: error: LlamaForTokenClassification is not supported. Pagoda runs: LlamaForCausalLM (llama);" in err
    assert "Qwen3MoeForCausalLM (qwen3_moe)" in err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_transformers(family, built, prompt_ids, tmp_path, capsys):
    directory, reference = built[family]
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompt_ids)
    results, _ = generate_json(capsys, directory, prompts_file)
    assert_matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preemption_by_swap_and_by_recompute_matches_transformers(family, built, prompt_ids):
    from pagoda.offline import LLM

    directory, reference = built[family]
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8,
              num_gpu_blocks=HYBRID_POOL if family in HYBRID else SMALL_POOL, num_cpu_blocks=64)
    assert isinstance(llm.scheduler.block_manager, HybridBlockManager) == (family in HYBRID)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    if family in HYBRID:  # EOS stops it, as transformers
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        reference = families.reference(model, prompt_ids, HYBRID_MAX_TOKENS)
        params = replace(params, max_tokens=HYBRID_MAX_TOKENS)
    for mode, budget in (("swap", 2048), ("recompute", 40)):  # recomputing, prompts prefill in chunks of 40 at most
        llm.reset(preemption_mode=mode, max_num_batched_tokens=budget)
        outputs = llm.generate(prompt_ids, params, use_tqdm=False)
        s = llm.scheduler
        if family in NEVER_PREEMPTED:
            assert s.num_preemptions == 0
        else:
            assert (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions) > 0
        assert_matches(reference, [o.token_ids for o in outputs], [[t[0] for t in o.logprobs] for o in outputs])
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


class LastPlan:
    """An executor that keeps the plan it ran last."""

    def __init__(self, executor) -> None:
        self.executor, self.plan = executor, None

    def execute(self, plan):
        self.plan = plan
        return self.executor.execute(plan)


def run_checking_the_window(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """Step the engine to the end; returns the outputs in prompt order and the most blocks a
    sequence decoding one token in the plan run last held after a step."""
    engine, bm = llm.engine, llm.scheduler.block_manager
    engine.executor = recorder = LastPlan(engine.executor)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
        bm.check_integrity()
        for s in recorder.plan.new_seqs + recorder.plan.cached_seqs:
            if s.num_scheduled_tokens == 1 and s.seq_id in bm.block_tables:
                most = max(most, sum(block != 0 for block in bm.block_table(s.seq_id)))
    engine.executor = recorder.executor
    assert bm.num_free_blocks == bm.num_total_blocks
    return [outputs[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize("family", NEVER_PREEMPTED)
def test_a_windowed_model_frees_the_blocks_behind_its_window_and_still_matches_transformers(family, built, prompt_ids):
    """mistral attends to its last 16 keys on every layer (mixtral to its last 24): its hello says
    so, and the scheduler gives back each sequence's blocks wholly behind its window (the worker's
    tables keep the null block there). Decoding, a sequence holds at most 16 / 8 + 1 = 3 blocks of
    8 (mixtral 4): two prompts decoding 4 windows each (mixtral: 64 tokens) run side by side in the
    pool of 24 blocks with no preemption (mistral: 26 without the window); twelve prompts shorter
    than the window, still growing, preempt each other, by swap (tables with null entries go out
    and back) and by recompute. With prefix caching the blocks a prompt leaves behind are
    registered first and stay cached: the same prompts again hit them. Every token is
    transformers'."""
    import transformers

    from pagoda.offline import LLM

    directory, _ = built[family]
    window = FAMILIES[family][2]["sliding_window"]
    max_tokens, bound = 64, window // 8 + 1
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    long, short = prompt_ids[:2], [torch.randint(4, 512, (n,), generator=gen).tolist() for n in range(3, 15)]
    references = {id(p): families.reference(model, p, max_tokens) for p in (long, short)}
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=SMALL_POOL,
              num_cpu_blocks=64)
    assert llm.scheduler.sliding_window == llm.scheduler.block_manager.sliding_window == window
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)  # EOS stops it, as transformers

    def check(prompts, outputs) -> None:
        assert_matches(references[id(prompts)], [list(o.token_ids) for o in outputs],
                       [[t[0] for t in o.logprobs] for o in outputs])

    for prompts, mode in ((long, "swap"), (short, "swap"), (short, "recompute")):
        llm.reset(preemption_mode=mode, enable_prefix_caching=False)
        outputs, most = run_checking_the_window(llm, prompts, params)
        s = llm.scheduler
        assert most == bound
        assert (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions) == (
            0 if prompts is long else s.num_preemptions) and (s.num_preemptions > 0) == (prompts is short)
        check(prompts, outputs)
    # 16 tokens each: nothing is evicted (the blocks a window leaves go first, oldest first)
    llm.reset(enable_prefix_caching=True)
    params, reference = replace(params, max_tokens=16), references[id(long)]
    references[id(long)] = families.Reference([t[:16] for t in reference.token_ids],
                                              [lp[:16] for lp in reference.logprobs])
    check(long, run_checking_the_window(llm, long, params)[0])
    assert llm.scheduler.prefix_cache_hits == 0
    outputs, _ = run_checking_the_window(llm, long, params)
    assert llm.scheduler.prefix_cache_hits == 32 + 32  # every full block of 33 and 35 tokens but the last token's
    check(long, outputs)


# Every family runs in a group of 2 through the served API below; `pagoda generate`'s group (the
# offline engine's rank processes) is the same for every family: a windowed one, a MoE one, and gpt-oss (KV
# cache groups, sinks, a MoE with biases)
@pytest.mark.parametrize("family", ["mistral", "qwen3_moe", "gpt_oss"])
def test_tensor_parallel_group_of_two_matches_transformers(family, built, prompt_ids, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    directory, reference = built[family]
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompt_ids)
    results, err = generate_json(capsys, directory, prompts_file, "--tensor-parallel-size", "2",
                                 "--num-gpu-blocks", str(SMALL_POOL), "--preemption-mode", "swap")
    assert_matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])
    # (a hybrid's groups admit a prompt once its blocks fit: 12 tokens need not preempt)
    swapped = (r"0 preemptions" if family in NEVER_PREEMPTED else r"\d+ preemptions \(\d+ swap, 0 recompute\)"
               if family in HYBRID else r"[1-9]\d* preemptions \([1-9]\d* swap, 0 recompute\)")
    assert re.search(r"steps, " + swapped, err), err


SERVED = [name for name in FAMILIES if name != "mistral"]  # mistral's path is llama's; its window has its own test


@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_served_api_matches_transformers(family, built, prompt_ids, redis_url):
    """`pagoda up --tensor-parallel-size 2` with a small pool preempting by recompute, the 8 prompts
    at once through the openai client: each choice's tokens are transformers' (their words), its
    token_logprobs too. (A hybrid's KV cache groups admit a prompt once its blocks fit: whether 12
    tokens preempt depends on when the requests arrive; the offline test preempts them.)"""
    directory, reference = built[family]
    preempts = family not in NEVER_PREEMPTED + HYBRID
    stack = Stack("--model", str(directory), "--redis-url", redis_url, "--tensor-parallel-size", "2",
                  "--block-size", "8", "--num-gpu-blocks", str(HYBRID_POOL if family in HYBRID else SMALL_POOL),
                  "--preemption-mode", "recompute", "--dtype", "float32").wait_ready()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [directory.name]
        response = client.completions.create(model=directory.name, prompt=[families.prompt_text(p) for p in prompt_ids],
                                             max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
        choices = sorted(response.choices, key=lambda c: c.index)
        assert [c.logprobs.tokens for c in choices] == [families.token_strings(ids) for ids in reference.token_ids]
        assert [c.text for c in choices] == [  # the special tokens (ids 0-3) are not in the text
            families.prompt_text([i for i in ids if i >= len(families.SPECIAL_TOKENS)]) for ids in reference.token_ids]
        for choice, theirs in zip(choices, reference.logprobs, strict=True):
            assert choice.logprobs.token_logprobs == pytest.approx(theirs, abs=TOLERANCE)
        if preempts:  # the schedulers' counters reach /metrics within a second or so
            wait_for(lambda: stack.metrics().get("pagoda:num_preemptions_total", 0) > 0, 10, "a preemption")
        metrics = stack.metrics()
        assert metrics.get("pagoda:num_swapped_out_blocks_total", 0) == 0
        if family not in HYBRID:
            assert (metrics.get("pagoda:num_preemptions_total", 0) > 0) == preempts
    finally:
        assert stack.stop() == 0


ROPE_SCALINGS = {  # family, rope parameters: each as transformers computes it
    "llama3": ("qwen3", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "linear": ("qwen3", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn": ("qwen3_moe", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 256}),
}


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_scalings_match_transformers(scaling, tmp_path, prompt_ids, monkeypatch):
    from pagoda.offline import LLM

    family, parameters = ROPE_SCALINGS[scaling]
    monkeypatch.setitem(FAMILIES, family, (*FAMILIES[family][:2], {**FAMILIES[family][2], "rope_parameters": parameters}))
    model = families.build(family, tmp_path)
    reference = families.reference(model, prompt_ids[:3])
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=8)
    outputs = llm.generate(prompt_ids[:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
    assert_matches(reference, [o.token_ids for o in outputs], [[t[0] for t in o.logprobs] for o in outputs])


def test_dynamic_ntk_within_the_context_is_the_plain_rotary(tmp_path):
    """transformers scales dynamic NTK's base only past max_position_embeddings, which Pagoda's
    context never passes: the cache equals the unscaled one."""
    from worker.models.layers import RotaryEmbedding
    from worker.models.llama import LlamaForCausalLM

    import transformers

    caches = []
    for parameters in ({"rope_type": "default", "rope_theta": 10000.0},
                       {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}):
        config = transformers.LlamaConfig(**{**families.BASE, "rope_parameters": parameters})
        rotary = RotaryEmbedding(16)
        rotary.init_cache(LlamaForCausalLM.rotary_class, config, 1024)
        caches.append((rotary.cos_cache, rotary.sin_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_gemma_norms_round_as_transformers_in_bfloat16():
    """(1 + weight) in float32 and one rounding, as Gemma3RMSNorm: bit for bit in bf16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from worker.models.layers import GemmaRMSNorm
    from worker.models.weights import InMemoryTensor

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(1152, generator=gen) * 0.3).to(torch.bfloat16)
    x, residual = (torch.randn(64, 1152, generator=gen).to(torch.bfloat16) for _ in range(2))
    theirs = Gemma3RMSNorm(1152, 1e-6).to(torch.bfloat16)
    theirs.weight.data.copy_(weight)
    ours = GemmaRMSNorm(1152, 1e-6).to(torch.bfloat16)
    ours.weight_loader(ours.weight, InMemoryTensor(weight))
    assert torch.equal(ours(x), theirs(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual) and torch.equal(normed, theirs(x + residual))


def test_a_quantized_checkpoint_and_a_context_past_the_models_are_refused(tmp_path, capsys):
    config = json.loads((families.ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    argv = ["generate", "--model", str(tmp_path), "--prompt", "w5", "--device", "cpu", "--quantization", "auto"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("pagoda: error: block-wise fp8 checkpoints (weight_block_size "
                                                    "[128, 128]) are not supported: per-tensor and per-channel scales are")
    argv = ["generate", "--model", f"dummy:{families.ROOT / 'tests' / 'data' / 'tiny-llama.json'}", "--prompt", "w5",
            "--device", "cpu", "--max-model-len", "1025"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(
        "pagoda: error: --max-model-len 1025 is longer than the model's context (1024 tokens)")


def test_a_window_as_long_as_the_context_is_no_window():
    from transformers import Phi3Config

    from worker.models.llama import layer_sliding_window

    assert layer_sliding_window(Phi3Config(**{**families.BASE, "sliding_window": 262144}), 0) is None
    assert layer_sliding_window(Phi3Config(**{**families.BASE, "sliding_window": 48}), 0) == 48


def test_an_unknown_rope_scaling_is_refused_by_name(tmp_path, capsys):
    config = json.loads((families.ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "mrope",
                                                                                 "mrope_section": [2, 3, 3]}}))
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "w5", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "pagoda: error: RoPE scaling 'mrope' is not supported (only default, linear, dynamic, llama3, yarn, longrope)")


def test_a_sharded_checkpoint_is_read_from_the_shards_its_index_names(tmp_path):
    from safetensors.torch import save_file

    from worker.models.weights import checkpoint_files

    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        save_file({"x": torch.zeros(1)}, str(tmp_path / name))
    assert [p.name for p in checkpoint_files(tmp_path)] == ["consolidated.safetensors", "model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    assert [p.name for p in checkpoint_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors"]


def test_a_multimodal_gemma3_checkpoint_is_served_for_text(tmp_path, prompt_ids):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): the language model of a checkpoint with
    a vision tower (the tower and projector unread) equals transformers' on text, at 1 and 2 ranks."""
    import transformers

    from pagoda.offline import LLM

    text = {**families.BASE, **FAMILIES["gemma3_text"][2]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=7, boi_token_index=5, eoi_token_index=6)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    reference = families.reference(model, prompt_ids[:3])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    for size in (1, 2):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=8, skip_tokenizer_init=True,
                  tensor_parallel_size=size)
        try:
            outputs = llm.generate(prompt_ids[:3], params, use_tqdm=False)
        finally:
            llm.close()
        assert_matches(reference, [o.token_ids for o in outputs], [[t[0] for t in o.logprobs] for o in outputs])
