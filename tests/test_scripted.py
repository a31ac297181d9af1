"""The scripted models of tests/scripted.py: transformers and Pagoda's engine both write each script
token for token, the thinking switch of the default template continues a script at `</think>`,
and a script that would branch is refused."""
from __future__ import annotations

import pytest
import torch

import scripted
from common.protocol import SamplingParams
from pagoda.offline import LLM

SCRIPTS = {
    "weather": ["<think>", "I should call", " a tool.", "</think>", "<tool_call>",
                '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"],
    "hello": ["<think>\n", "Greet them.", "</th", "ink>", "\n\nHello", " there!"],
    "plain": ["Plain", " answer."],
}
SPECIAL = ("<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return scripted.build(tmp_path_factory.mktemp("scripted"), SCRIPTS, special=SPECIAL)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


def chat(tokenizer, cue: str, **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": f"What about {cue}"}], add_generation_prompt=True,
                                       tokenize=True, **kwargs)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def greedy(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        return model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()


@pytest.mark.parametrize("cue", SCRIPTS)
def test_transformers_writes_each_script_then_eos(hf, cue):
    tokenizer, model = hf
    out = greedy(model, chat(tokenizer, cue))
    assert out[-1] == tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(out[:-1]) == SCRIPTS[cue]
    assert tokenizer.decode(out, skip_special_tokens=False) == scripted.text(SCRIPTS, cue) + "</s>"


def test_special_pieces_are_skipped_and_plain_ones_kept(hf):
    tokenizer, model = hf
    out = greedy(model, chat(tokenizer, "weather"))
    assert tokenizer.decode(out, skip_special_tokens=True) == (
        '<think>I should call a tool.</think>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')


def test_thinking_off_prefills_an_empty_think_block_that_continues_at_its_close(hf):
    tokenizer, model = hf
    ids = chat(tokenizer, "weather", enable_thinking=False)
    assert tokenizer.convert_ids_to_tokens(ids)[-2:] == ["<think>", "</think>"]
    assert tokenizer.convert_ids_to_tokens(greedy(model, ids)[:-1]) == SCRIPTS["weather"][4:]


def test_pagodas_engine_writes_what_transformers_does(hf, model_dir):
    tokenizer, model = hf
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_gpu_blocks=64)
    prompts = [{"messages": [{"role": "user", "content": f"What about {cue}"}]} for cue in SCRIPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    for cue, out in zip(SCRIPTS, outs):
        assert out.token_ids == greedy(model, chat(tokenizer, cue))
        assert out.finish_reason == "stop"


def test_a_token_followed_by_two_pieces_is_refused():
    with pytest.raises(ValueError, match="'</think>' is followed by both 'A' and 'B'"):
        scripted.successors({"x": ["<think>", "</think>", "A"], "y": ["</think>", "B"]})
