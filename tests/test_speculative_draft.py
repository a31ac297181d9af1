"""Speculative method draft_model: a smaller model proposes the drafts on the worker, over its own
paged KV pool with the target's block ids (worker/drafter.py); the target verifies them.

Tiny random Llamas as target and drafts (a close draft: the target's weights perturbed, which
agrees often but not always; a foreign one of other shapes, which rarely agrees; the target
itself, which agrees wherever its KV is right), then the default model in float32 drafted by its
int4 self. Every
output must be the tokens of decoding without drafts; a draft's acceptance shows that its KV
pool followed the target's through swaps, recomputes and the prefix cache.
"""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.protocol import SamplingParams, StructuredOutput
from tests.conftest import TINY_LLAMA
from tests.test_speculative import COPY_PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], list(range(30, 70))]


def draft_config(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def drafts(tiny, tmp_path_factory) -> dict[str, str]:
    """Draft checkpoints for the tiny target: "self" (the target), "close" (its weights plus noise)
    and "foreign" (random, one layer, other head shapes, a context of 256 positions)."""
    from transformers import AutoConfig, LlamaForCausalLM

    directory, model = tiny
    torch.manual_seed(1)
    close = copy.deepcopy(model)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.abs().mean())
    config = AutoConfig.from_pretrained(TINY_LLAMA)
    config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 1, 2, 1, 32
    config.max_position_embeddings = 256  # a shorter context than the target's 1024
    foreign = LlamaForCausalLM(config).eval()
    paths = {"self": str(directory)}
    for name, m in (("close", close), ("foreign", foreign)):
        path = tmp_path_factory.mktemp(f"tiny-draft-{name}")
        m.save_pretrained(path)
        paths[name] = str(path)
    return paths


def _generate(llm, prompts, params, speculative_config=None, **config):
    llm.reset(speculative_config=speculative_config, **config)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked
    return [[(s.token_ids, s.finish_reason) for s in out.outputs] for out in outputs]


def test_the_flag_needs_the_drafts_checkpoint():
    config = EngineConfig(speculative_config=json.dumps(draft_config("default", 3)))
    assert config.speculative.drafts_on_worker and config.speculative.model == "default"
    with pytest.raises(ConfigError, match='needs "model"'):
        EngineConfig(speculative_config='{"method": "draft_model"}')


def test_a_draft_of_another_vocabulary_is_refused(tiny):
    from pagoda.offline import LLM

    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True, speculative_config=draft_config("default"))


@pytest.mark.parametrize("name", ["close", "foreign"])
def test_tiny_drafts_change_no_token_of_greedy_seeded_or_stopped_outputs(tiny, drafts, name):
    from pagoda.offline import LLM

    llm = LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True, num_gpu_blocks=200,
              speculative_config=draft_config(drafts[name]))
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = _generate(llm, PROMPTS, greedy)
    stop = plain[0][0][0][20]
    cases = [greedy, SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    for params in cases:
        expected = _generate(llm, PROMPTS, params)
        assert _generate(llm, PROMPTS, params, draft_config(drafts[name])) == expected
    spec = llm.scheduler.speculator
    assert spec.num_draft_tokens > 0
    assert llm.config.max_model_len == (1024 if name == "close" else 256)  # the shorter context of the two
    if name == "close":  # agrees often, not always: both paths of the verification ran
        assert 0.3 * spec.num_draft_tokens < spec.num_accepted_tokens < spec.num_draft_tokens


def _check_draft_kv_mirrors_target(llm) -> int:
    """With the target as its own draft, every computed position of every running sequence holds
    the same K and V in both pools (the draft computed them in other shapes: allclose). Returns
    the positions checked."""
    runner, scheduler = llm.executor.runner, llm.scheduler
    bm, bs = scheduler.block_manager, scheduler.block_manager.block_size
    checked = 0
    for seq in scheduler._seqs.values():
        if seq.status.name != "RUNNING" or seq.num_computed_tokens == 0:
            continue
        table = bm.block_table(seq.seq_id)
        positions = torch.arange(seq.num_computed_tokens)
        blocks = torch.tensor(table)[positions // bs]
        for target, draft in zip(runner.pools[0].caches, runner.pools[1].caches):
            torch.testing.assert_close(draft[blocks, :, positions % bs], target[blocks, :, positions % bs],
                                       atol=1e-4, rtol=1e-4)
        checked += len(positions)
    return checked


def _run_checking_the_pools(llm, prompts, params) -> int:
    engine, checked = llm.engine, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        checked += _check_draft_kv_mirrors_target(llm)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return checked


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_draft_pool_follows_the_target_pool_through_preemption_and_the_prefix_cache(tiny, drafts, mode):
    """The target as its own draft: at every step, wherever a running sequence's KV is computed,
    the draft pool holds the same KV under the same block ids, through swaps (the draft's layers
    swap with the target's), recomputes, copies on write (n = 2) and prefix-cache hits (the prompts
    again: their blocks cached); and the outputs are those without drafts."""
    from pagoda.offline import LLM

    llm = LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True, num_gpu_blocks=200,
              speculative_config=draft_config(drafts["self"]))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(40 + i, 90 + i)) for i in range(4)]
    expected = _generate(llm, prompts, params)
    assert _generate(llm, prompts, params, draft_config(drafts["self"]), preemption_mode=mode,
                     num_gpu_blocks=20) == expected
    assert llm.scheduler.num_preemptions > 0
    llm.reset(speculative_config=draft_config(drafts["self"]), preemption_mode=mode, num_gpu_blocks=20)
    assert _run_checking_the_pools(llm, prompts, params) > 1000
    assert llm.scheduler.num_preemptions > 0
    spec = llm.scheduler.speculator
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens > 0  # greedy: its own argmax
    two = SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=20, ignore_eos=True)
    assert _run_checking_the_pools(llm, prompts[:2] * 2, two) > 0  # copies on write, then cache hits
    assert llm.scheduler.prefix_cache_hits >= 48


def test_tensor_parallel_2_with_a_draft_model_matches_one_rank(tiny, drafts):
    from pagoda.offline import LLM

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True)
    expected = [o.token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    two = LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
              speculative_config=draft_config(drafts["close"]))
    try:
        assert [o.token_ids for o in two.generate(PROMPTS, params, use_tqdm=False)] == expected
        assert two.scheduler.speculator.num_accepted_tokens > 0
    finally:
        two.close()


INT4_SELF = {**draft_config("default"), "quantization": "int4"}


@pytest.fixture(scope="module")
def default_drafting_itself():
    """The default model in float32, its int4 self as the draft (bfloat16 on the CPU: a pool of
    another dtype beside the target's)."""
    from pagoda.offline import LLM

    llm = LLM("default", quantization="none", num_gpu_blocks=200, speculative_config=INT4_SELF)  # dtype auto
    assert (llm.executor.runner.dtype, llm.executor.runner.drafter.dtype) == (torch.float32, torch.bfloat16)
    return llm


def test_the_speculative_quantization_key_is_the_drafts_own():
    assert EngineConfig(speculative_config=INT4_SELF).speculative.quantization == "int4"
    with pytest.raises(ConfigError, match="speculative quantization must be one of"):
        EngineConfig(speculative_config={**INT4_SELF, "quantization": "int3"})
    with pytest.raises(ConfigError, match='"quantization" key is the draft model'):
        EngineConfig(speculative_config={"method": "eagle", "model": "x", "quantization": "int4"})


def test_the_default_model_drafted_by_its_int4_self_changes_no_token(default_drafting_itself):
    llm = default_drafting_itself
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = _generate(llm, COPY_PROMPTS[:2], params)
    assert _generate(llm, COPY_PROMPTS[:2], params, INT4_SELF) == expected
    spec = llm.scheduler.speculator
    assert spec.num_accepted_tokens >= 0.8 * spec.num_draft_tokens > 0
    assert llm.engine.num_steps < 24


def test_a_draft_models_drafts_are_checked_against_the_grammar(default_drafting_itself):
    llm = default_drafting_itself
    pattern = r'```python\n[a-z_():,.="\n ]+'
    params = SamplingParams(temperature=0, max_tokens=24, structured_output=StructuredOutput("regex", pattern))
    expected = _generate(llm, COPY_PROMPTS[:1], params)
    llm.reset(speculative_config=INT4_SELF)
    (out,) = llm.generate(COPY_PROMPTS[:1], params, use_tqdm=False)
    assert [(s.token_ids, s.finish_reason) for s in out.outputs] == expected[0]
    assert llm.scheduler.speculator.num_accepted_tokens > 5
    assert re.fullmatch(pattern, out.outputs[0].text)



# ----------------------------------------------------------------------------- EAGLE


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> str:
    from transformers import AutoConfig

    return _write_eagle_head(tmp_path_factory.mktemp("tiny-eagle"), AutoConfig.from_pretrained(TINY_LLAMA), False, 5)


def _causal_attention(x: torch.Tensor, weights: dict, prefix: str, config, rotary) -> torch.Tensor:
    """A Llama attention block's output over positions 0..n-1 of x, dense (transformers' rotary)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n, nh, nkv, hd = x.shape[0], config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qs, ks, vs = ((x @ weights[f"{prefix}.{p}_proj.weight"].T).view(n, heads, hd).transpose(0, 1)[None]
                  for p, heads in (("q", nh), ("k", nkv), ("v", nkv)))
    cos, sin = rotary(vs, torch.arange(n)[None])
    qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
    attn = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    return attn[0].transpose(0, 1).reshape(n, nh * hd) @ weights[f"{prefix}.o_proj.weight"].T


def _eagle_reference(target, weights: dict, config, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1's k greedy drafts after `tokens`, dense: the head's input at position p is
    (embedding of token p + 1, the target's last hidden state at p), causal over p = 0..L-1, then
    each draft with the head's own output before it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.no_grad():
        hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
        rotary = LlamaRotaryEmbedding(config)

        def rms(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

        def head(inputs):  # inputs: [(token, hidden)] at positions 0..n-1 -> outputs [n, h]
            x = torch.cat([embed[[t for t, _ in inputs]], torch.stack([g for _, g in inputs])], -1) @ weights["fc.weight"].T
            x = x + _causal_attention(x, weights, "layers.0.self_attn", config, rotary)
            m = rms(x, weights["layers.0.post_attention_layernorm.weight"])
            m = torch.nn.functional.silu(m @ weights["layers.0.mlp.gate_proj.weight"].T) * (
                m @ weights["layers.0.mlp.up_proj.weight"].T)
            return x + m @ weights["layers.0.mlp.down_proj.weight"].T

        inputs = [(tokens[p + 1], hidden[p]) for p in range(len(tokens) - 1)]
        drafts = []
        for _ in range(k):
            out = head(inputs)[-1]
            drafts.append(int((out @ lm_head.T).argmax()))
            inputs.append((drafts[-1], out))
        return drafts


def test_an_eagle_head_drafts_what_dense_eagle_drafts_and_changes_no_token(tiny, eagle_head):
    """Every step's drafts are those of EAGLE-1 computed densely from the sequence's tokens and
    the target's hidden states: the head's paged KV, its catch-up over the positions the target
    kept, and its drafting passes are right. The outputs are those without drafts."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagoda.offline import LLM

    target = tiny[1]
    spec = {"method": "eagle", "model": eagle_head, "num_speculative_tokens": 3}
    llm = LLM(str(tiny[0]), dtype="float32", skip_tokenizer_init=True, num_gpu_blocks=200, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:2]
    expected = _generate(llm, prompts, params)
    seen = _recording(llm.executor.runner.drafter)
    assert _generate(llm, prompts, params, spec) == expected
    assert len(seen) >= 6 and llm.scheduler.speculator.num_draft_tokens > 0
    weights, config = load_file(f"{eagle_head}/model.safetensors"), AutoConfig.from_pretrained(eagle_head)
    for tokens, drafts in seen:
        assert drafts == _eagle_reference(target, weights, config, tokens, len(drafts)), tokens


def test_eagle_heads_are_refused_with_tensor_parallelism(eagle_head):
    for method in ("eagle", "eagle3"):
        with pytest.raises(ConfigError, match=f"{method} with --tensor-parallel-size > 1 is not built"):
            EngineConfig(tensor_parallel_size=2, speculative_config={"method": method, "model": eagle_head})


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    """(directory, model) of a random 8-layer tiny Llama: EAGLE-3 reads its layers 2, 4 and 5."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(TINY_LLAMA)
    config.num_hidden_layers = 8
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama-8")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory) -> str:
    from transformers import AutoConfig

    return _write_eagle_head(tmp_path_factory.mktemp("tiny-eagle3"), AutoConfig.from_pretrained(TINY_LLAMA), True, 6)


def _eagle3_reference(target, weights: dict, config, tokens: list[int], k: int) -> list[int]:
    """EAGLE-3's k greedy drafts after `tokens`, dense: at position p, (embedding of token p + 1,
    fc(the residual stream entering target layers 2, 4, 5 at p)); each draft then with the head's
    output before its final norm."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    w = {name.replace("midlayer.", ""): t for name, t in weights.items()}
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[2][0], states[4][0], states[5][0]], -1) @ w["fc.weight"].T
        embed, rotary = target.model.embed_tokens.weight, LlamaRotaryEmbedding(config)

        def rms(x, name):
            return w[f"{name}.weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

        def head(inputs):  # [(token, hidden)] at positions 0..n-1 -> (normed, prenorm) [n, h]
            e, hidden = embed[[t for t, _ in inputs]], torch.stack([g for _, g in inputs])
            x = torch.cat([rms(e, "input_layernorm"), rms(hidden, "hidden_norm")], -1)
            residual = hidden + _causal_attention(x, w, "self_attn", config, rotary)
            m = rms(residual, "post_attention_layernorm")
            m = torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
            prenorm = residual + m @ w["mlp.down_proj.weight"].T
            return rms(prenorm, "norm"), prenorm

        inputs = [(tokens[p + 1], fused[p]) for p in range(len(tokens) - 1)]
        drafts = []
        for _ in range(k):
            normed, prenorm = head(inputs)
            draft = int((normed[-1] @ w["lm_head.weight"].T).argmax())
            drafts.append(draft + int(w["d2t"][draft]))
            inputs.append((drafts[-1], prenorm[-1]))
        return drafts


def test_an_eagle3_head_drafts_what_dense_eagle3_drafts_and_changes_no_token(deep_tiny, eagle3_head):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from pagoda.offline import LLM

    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    llm = LLM(deep_tiny[0], dtype="float32", skip_tokenizer_init=True, num_gpu_blocks=200, speculative_config=spec)
    assert llm.executor.runner.drafter.aux_layers == (2, 4, 5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _generate(llm, PROMPTS[:2], params)
    seen = _recording(llm.executor.runner.drafter)
    assert _generate(llm, PROMPTS[:2], params, spec) == expected
    assert len(seen) >= 6
    weights, config = load_file(f"{eagle3_head}/model.safetensors"), AutoConfig.from_pretrained(eagle3_head)
    for tokens, drafts in seen:
        assert drafts == _eagle3_reference(deep_tiny[1], weights, config, tokens, len(drafts)), tokens


def _recording(drafter) -> list[tuple[list[int], list[int]]]:
    """Record each drafting row's tokens and drafts as the drafter proposes them."""
    seen, propose = [], drafter.propose

    def recorded(step, rows, starts, ks, scheduled):
        drafts, o = propose(step, rows, starts, ks, scheduled).tolist(), 0
        for r, k in zip(rows, ks):
            seen.append((list(scheduled[r].held.token_ids), drafts[o:o + k]))
            o += k
        return torch.tensor(drafts, dtype=torch.int64)

    drafter.propose = recorded
    return seen


def _write_eagle_head(path, config, eagle3: bool, seed: int) -> str:
    """A random EAGLE-1 or EAGLE-3 head for targets of `config`'s shape, in the checkpoint layout
    vLLM loads. EAGLE-1: fc over [embedding, hidden], one layer without input_layernorm (the
    target's embeddings and LM head). EAGLE-3: `midlayer.*` with q/k/v over 2 x hidden, fc over 3 x
    hidden, its own norm and LM head over a draft vocabulary of 200, d2t and t2d."""
    from safetensors.torch import save_file

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    config.architectures = ["Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"]
    h, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv, qkv_in = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, h * (1 + eagle3)
    layer = "midlayer" if eagle3 else "layers.0"
    shapes = {"fc.weight": (h, (3 if eagle3 else 2) * h), f"{layer}.self_attn.q_proj.weight": (q, qkv_in),
              f"{layer}.self_attn.k_proj.weight": (kv, qkv_in), f"{layer}.self_attn.v_proj.weight": (kv, qkv_in),
              f"{layer}.self_attn.o_proj.weight": (h, q), f"{layer}.mlp.gate_proj.weight": (inter, h),
              f"{layer}.mlp.up_proj.weight": (inter, h), f"{layer}.mlp.down_proj.weight": (h, inter)}
    norms = [f"{layer}.post_attention_layernorm"]
    if eagle3:
        config.draft_vocab_size = 200
        shapes["lm_head.weight"] = (200, h)
        norms += [f"{layer}.input_layernorm", f"{layer}.hidden_norm", "norm"]
    gen = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}
    for norm in norms:
        weights[f"{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    if eagle3:
        draft_to_target = torch.sort(torch.randperm(config.vocab_size, generator=gen)[:200]).values
        weights["d2t"] = draft_to_target - torch.arange(200)
        weights["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_to_target, True)
    config.save_pretrained(path)
    save_file(weights, str(path / "model.safetensors"))
    return str(path)
