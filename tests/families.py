"""Tiny random models of every architecture in the registry, each with its family's features on.

A family's model is built by transformers from its own config class (seeded), saved with the
512-word tokenizer of tests/data/tiny-tokenizer (id i is the word `w<i>`), and run by transformers'
`generate` for the reference: greedy tokens and each token's logprob, in float32.

Features switched on (the windows are shorter than every prompt; the prompts pass Phi-3's
original context, so LongRoPE runs on its long factors; head_dim is not hidden / heads where the
family's real checkpoints have it so):
    qwen3        per-head q/k RMSNorm; sliding window on the upper layers (max_window_layers)
    gemma2       head_dim 32, (1 + w) norms around attention and MLP, GeGLU, query_pre_attn_scalar, attention
                 and final logit soft-capping, local and global layers, tied embeddings
    gemma3_text  the same plus q/k norms and two RoPE bases (linear scaling on the global one)
    phi3         fused qkv_proj and gate_up_proj in the checkpoint, LongRoPE, partial rotary,
                 a sliding window on every layer, one KV head (replicated over a group of 2)
    mixtral      4 experts, top-2, renormalized; a sliding window on every layer
    qwen3_moe    8 experts, top-2, norm_topk_prob, a dense first layer (mlp_only_layers), q/k norms,
                 head_dim 32, attention biases (q, k, v and o)
    qwen2_moe    4 experts, top-2, not renormalized, a gated shared expert, q/k/v biases
    mistral      a sliding window on every layer (the windowed-only model)
    gpt_oss      sliding and full layers alternating, attention sinks, q/k/v/o biases, YaRN; 4 experts,
                 top-2, a router bias, expert biases and the clamped SwiGLU (its limit low enough to
                 clamp); the sinks and biases drawn after init, which zeroes the biases
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "tiny-tokenizer"
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, initializer_range=0.05)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=24, max_window_layers=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=20.0,
        final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=24, final_logit_softcapping=5.0, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}},
        tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=1, sliding_window=48, partial_rotary_factor=0.75, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [1.5 + 0.3 * i for i in range(6)]})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[0], attention_bias=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        norm_topk_prob=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=24, swiglu_limit=0.3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})),
}
PROMPT_LENGTHS = [33, 35, 40, 47, 52, 60, 64, 70]  # every one past each window and Phi-3's original context
MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0-3 of the tiny tokenizer


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def token_strings(ids: list[int]) -> list[str]:
    """Each token's text alone, as the API's logprobs name it."""
    return [SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else f"w{i}" for i in ids]


@dataclass
class Reference:
    """transformers' greedy output for each prompt: token ids and each one's logprob."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


def build(name: str, directory: Path):
    """Save family `name`'s tiny model (seed 0) and the tokenizer in `directory`; returns the model."""
    import transformers

    config_class, model_class, features = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**BASE, **features})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    if name in AFTER_INIT:
        AFTER_INIT[name](model)
    model.save_pretrained(directory)
    for file in TOKENIZER.iterdir():
        if file.name != "README.md":
            shutil.copy(file, directory)
    return model


def _gpt_oss_after_init(model) -> None:
    """Sinks of either sign and size, and biases (transformers' init zeroes them)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=gen) * 2)
            elif name.endswith(("_proj_bias", "router.bias")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


AFTER_INIT = {"gpt_oss": _gpt_oss_after_init}


def reference(model, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> Reference:
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            new = out.sequences[0, len(ids):].tolist()
            tokens.append(new)
            logprobs.append([torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)])
    return Reference(tokens, logprobs)


def write_prompts(path: Path, prompt_ids: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": prompt_text(ids)}) + "\n" for ids in prompt_ids))
    return path
