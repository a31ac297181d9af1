"""The LoRA tests' adapters: random PEFT adapters (made by peft) of the tiny Qwen3, and the
references transformers+PEFT give for them. Shared by tests/test_lora.py and the GPU module
tests/test_lora_gpu.py, so it imports no test-only package but peft."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.lora import lora_int_id
from common.protocol import LoRARequest, SamplingParams
from tests import families

TOLERANCE = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, targets, rsLoRA) of the 8 adapters: ranks 8 and 16, every target, some alone
ADAPTERS = [(8, ["q_proj", "v_proj"], False), (16, ALL, True), (8, ["o_proj", "down_proj"], False),
            (16, ["gate_proj", "up_proj"], False), (8, ALL, False), (16, ["k_proj"], True),
            (8, ["q_proj", "k_proj", "v_proj", "o_proj"], False), (16, ["down_proj", "up_proj", "v_proj"], False)]


def make_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int, targets: list[str], rslora: bool = False,
                 scale_b: float = 1.0):
    """A random PEFT adapter (A and B both random: init_lora_weights=False) saved by peft; returns
    the PeftModel, transformers+PEFT's reference."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora)
    model = peft.get_peft_model(base, config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale_b)
    model.save_pretrained(out_dir)
    return model.eval()


def build_tiny(tmp_path_factory):
    """The tiny Qwen3 with its tokenizer, 8 adapters, and transformers(+PEFT)'s greedy references:
    the base's for every prompt, adapter i's for prompt i."""
    directory = tmp_path_factory.mktemp("qwen3")
    base = families.build("qwen3", directory)
    prompts = families.prompts()
    adapters, references = [], []
    for i, (rank, targets, rslora) in enumerate(ADAPTERS):
        path = tmp_path_factory.mktemp(f"adapter{i}")
        model = make_adapter(directory, path, seed=100 + i, rank=rank, targets=targets, rslora=rslora)
        adapters.append(LoRARequest(f"a{i}", lora_int_id(f"a{i}"), str(path)))
        references.append(families.reference(model, [prompts[i]]))
    base_reference = families.reference(base, prompts)
    return directory, prompts, adapters, references, base_reference


def check_outputs(outputs, tiny, with_base: bool = True) -> None:
    """Outputs of [prompt i with adapter i for i < 8] (+ [prompt i on the base for i < 8]) against the references."""
    _, prompts, _, references, base_reference = tiny
    expected = [(r.token_ids[0], r.logprobs[0]) for r in references]
    if with_base:
        expected += list(zip(base_reference.token_ids, base_reference.logprobs))
    assert len(outputs) == len(expected)
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        assert out.token_ids == tokens
        assert [entry[0] for entry in out.logprobs] == pytest.approx(logprobs, abs=TOLERANCE)


def mixed_batch(llm, tiny):
    _, prompts, adapters, _, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0)
    return llm.generate(prompts + prompts, params, use_tqdm=False, lora_request=adapters + [None] * len(prompts))
