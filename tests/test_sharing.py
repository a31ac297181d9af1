"""Memory sharing through the real worker path: copy-on-write forks (best_of, beam search),
prefix caching and swap-or-recompute preemption, checked against transformers.

The first half runs on a tiny random Llama (fast); the second on SmolLM2 (slow), the default
model, where beam search must equal transformers' `generate(num_beams=k)` and greedy output must
not change under forced preemption in any mode.
"""
import random

import pytest
import torch

from common.protocol import SamplingParams, decode, encode, sample_seed
from tests.prompts import LONG_TEXT, PARITY_PROMPTS

MODES = ["swap", "recompute", "auto"]


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    from pagoda.offline import LLM

    return LLM(str(tiny[0]), skip_tokenizer_init=True, device="cpu", block_size=8, num_gpu_blocks=512,
               num_cpu_blocks=256)


def reconfigure(llm, **changes) -> None:
    """A fresh scheduler over the same loaded worker: a smaller pool, another mode, no cache."""
    llm.reset(**changes)


def random_prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def hf_beams(model, prompt: list[int], width: int, max_new_tokens: int, **kwargs) -> list[list[int]]:
    """transformers' beam search: the `width` returned sequences, best first, without padding."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, num_beams=width,
            num_return_sequences=width, return_dict_in_generate=True, output_logits=True, **kwargs,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist() for i in range(width)]


def assert_all_free(llm) -> None:
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks


# ----------------------------------------------------------------------------- tiny Llama: beam search


@pytest.mark.parametrize("width, length_penalty, early_stopping", [
    (2, 1.0, False), (4, 1.0, False), (3, 0.5, True), (4, 2.0, "never"),
])
def test_beam_search_equals_transformers_on_a_tiny_llama(tiny, tiny_llm, width, length_penalty, early_stopping):
    directory, model = tiny
    reconfigure(tiny_llm)
    prompts = random_prompts(width, (3, 17, 40))
    params = SamplingParams(temperature=0, max_tokens=12, beam_width=width, n=width, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = hf_beams(model, prompt, width, 12, length_penalty=length_penalty, early_stopping=early_stopping,
                            eos_token_id=2, pad_token_id=0)
        assert [sample.token_ids for sample in out.outputs] == expected
    assert_all_free(tiny_llm)


def test_beams_share_blocks_copy_on_write(tiny_llm):
    reconfigure(tiny_llm)
    scheduler = tiny_llm.scheduler
    scheduler.add_request("beam", random_prompts(1, (21,))[0], SamplingParams(temperature=0, max_tokens=10, beam_width=4))
    shared_steps = copies = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        copies += len(plan.blocks_to_copy)
        scheduler.update(tiny_llm.executor.execute(decode(encode(plan))))
        logical, physical = scheduler.block_manager.sharing_stats()
        shared_steps += physical < logical
        scheduler.block_manager.check_integrity()
    assert shared_steps >= 8  # the 21-token prompt's two full blocks stay shared by every beam
    assert copies > 0  # forked beams wrote into their shared partial block only after copying it
    assert_all_free(tiny_llm)


# ----------------------------------------------------------------------------- tiny Llama: n and best_of


def test_parallel_samples_fork_from_the_prompt_and_are_reproducible(tiny_llm):
    reconfigure(tiny_llm)
    prompt = random_prompts(2, (30,))[0]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3, ignore_eos=True)
    [grouped] = tiny_llm.generate([prompt], params, use_tqdm=False)
    assert len(grouped.outputs) == 3
    # sample i is what a lone request seeded with sample_seed(7, i) draws
    for i, sample in enumerate(grouped.outputs):
        alone = SamplingParams(temperature=1.0, max_tokens=8, seed=sample_seed(7, i), ignore_eos=True)
        assert tiny_llm.generate([prompt], alone, use_tqdm=False)[0].token_ids == sample.token_ids
    assert len({tuple(s.token_ids) for s in grouped.outputs}) == 3
    assert_all_free(tiny_llm)


def test_best_of_returns_the_n_most_likely_of_its_samples(tiny_llm):
    reconfigure(tiny_llm)
    prompt = random_prompts(3, (12,))[0]
    every = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=3, n=5, ignore_eos=True),
                              use_tqdm=False)[0].outputs
    best = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=3, n=2, best_of=5,
                                                      ignore_eos=True), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda s: s.cumulative_logprob, reverse=True)
    assert [s.token_ids for s in best] == [s.token_ids for s in ranked[:2]]
    assert_all_free(tiny_llm)


# ----------------------------------------------------------------------------- tiny Llama: preemption


@pytest.mark.parametrize("mode", MODES)
def test_greedy_and_beams_are_unchanged_by_forced_preemption(tiny, tiny_llm, mode):
    prompts = random_prompts(4, (5, 17, 33, 64, 100, 9))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    beams = SamplingParams(temperature=0, max_tokens=10, beam_width=2, n=2)
    reconfigure(tiny_llm)
    expected = [o.token_ids for o in tiny_llm.generate(prompts, greedy, use_tqdm=False)]
    expected_beams = [[s.token_ids for s in o.outputs] for o in tiny_llm.generate(prompts[:3], beams, use_tqdm=False)]
    reconfigure(tiny_llm, num_gpu_blocks=40, num_cpu_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    assert [o.token_ids for o in tiny_llm.generate(prompts, greedy, use_tqdm=False)] == expected
    s = tiny_llm.scheduler
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swap_preemptions == s.num_preemptions
    elif mode == "recompute":
        assert s.num_recompute_preemptions == s.num_preemptions
    else:  # on CPU copying KV is far cheaper than recomputing it: the cost model swaps
        assert s.costs.swap_seconds(1) < s.costs.recompute_seconds(1)
        assert s.num_swap_preemptions == s.num_preemptions
    assert_all_free(tiny_llm)
    reconfigure(tiny_llm, num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    got = [[s.token_ids for s in o.outputs] for o in tiny_llm.generate(prompts[:3], beams, use_tqdm=False)]
    assert got == expected_beams
    assert tiny_llm.scheduler.num_preemptions > 0
    assert_all_free(tiny_llm)


def test_a_full_swap_pool_falls_back_to_recompute(tiny_llm):
    prompts = random_prompts(5, (40, 40, 40, 40))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reconfigure(tiny_llm)
    expected = [o.token_ids for o in tiny_llm.generate(prompts, greedy, use_tqdm=False)]
    reconfigure(tiny_llm, num_gpu_blocks=20, num_cpu_blocks=2, preemption_mode="swap", enable_prefix_caching=False)
    assert [o.token_ids for o in tiny_llm.generate(prompts, greedy, use_tqdm=False)] == expected
    assert tiny_llm.scheduler.num_recompute_preemptions > 0
    assert_all_free(tiny_llm)


def test_a_group_that_could_never_fit_again_after_a_recompute_is_rejected(tiny_llm):
    reconfigure(tiny_llm, num_gpu_blocks=40)  # 39 blocks of 8
    with pytest.raises(ValueError, match="more than the server.s whole pool"):
        tiny_llm.generate([[5] * 100], SamplingParams(best_of=4, max_tokens=20), use_tqdm=False)  # 4 x 15 blocks
    reconfigure(tiny_llm, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="more than one step holds"):
        tiny_llm.generate([[5] * 3], SamplingParams(n=6, max_tokens=2), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- tiny Llama: prefix caching


def test_a_shared_prefix_is_computed_once(tiny_llm):
    prefix = random_prompts(6, (70,))[0]  # 8 full blocks of 8 and 6 tokens
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    reconfigure(tiny_llm, enable_prefix_caching=False)
    uncached = [tiny_llm.generate([p], params, use_tqdm=False)[0].token_ids for p in (first, second)]
    reconfigure(tiny_llm)
    assert tiny_llm.generate([first], params, use_tqdm=False)[0].token_ids == uncached[0]
    s, engine = tiny_llm.scheduler, tiny_llm.engine
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (73, 0)
    before = engine.num_scheduled_tokens
    assert tiny_llm.generate([second], params, use_tqdm=False)[0].token_ids == uncached[1]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (73 + 72, 64)  # 8 blocks of the 70-token prefix
    assert engine.num_scheduled_tokens - before == (72 - 64) + 4  # its new tokens, then 4 decode steps
    assert_all_free(tiny_llm)


# ----------------------------------------------------------------------------- SmolLM2 (slow)

BEAM_PROMPTS = [PARITY_PROMPTS[i] for i in (0, 1, 3, 5)]  # two end in EOS under beam search, two run long
BEAM_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    from pagoda.offline import LLM

    return LLM("default", device="cpu", dtype="float32", num_cpu_blocks=512)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    from transformers import AutoModelForCausalLM

    from worker.loader import hf_directory

    return AutoModelForCausalLM.from_pretrained(hf_directory(smollm2.executor.runner.source), dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers_on_smollm2(smollm2, smollm2_hf, width):
    reconfigure(smollm2)
    prompts = [smollm2.encode(p) for p in BEAM_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=BEAM_TOKENS, beam_width=width, n=width)
    outputs = smollm2.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert [s.token_ids for s in out.outputs] == hf_beams(smollm2_hf, prompt, width, BEAM_TOKENS)
    assert any(out.outputs[0].finish_reason == "stop" for out in outputs)
    assert any(out.outputs[0].finish_reason == "length" for out in outputs)


@pytest.fixture(scope="module")
def unpreempted(smollm2) -> list[list[int]]:
    """The parity prompts' 32 greedy tokens with a pool that never preempts (once for every mode)."""
    reconfigure(smollm2, enable_prefix_caching=False)
    prompts = [smollm2.encode(p) for p in PARITY_PROMPTS]
    return [o.token_ids for o in smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_smollm2_greedy_is_unchanged_by_forced_preemption(smollm2, unpreempted, mode):
    prompts = [smollm2.encode(p) for p in PARITY_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = unpreempted
    reconfigure(smollm2, num_gpu_blocks=56, preemption_mode=mode, enable_prefix_caching=False)
    assert [o.token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)] == expected
    s = smollm2.scheduler
    assert s.num_preemptions > 0
    assert (s.num_swap_preemptions if mode != "recompute" else s.num_recompute_preemptions) == s.num_preemptions


@pytest.mark.slow
def test_smollm2_second_request_with_a_long_shared_prefix_computes_only_its_new_tokens(smollm2):
    system = {"role": "system", "content": "Answer using this text.\n\n" + LONG_TEXT}
    chats = [{"messages": [system, {"role": "user", "content": q}]}
             for q in ("Who was Gutenberg?", "What did printing change for scholars?")]
    first, second = (smollm2.encode(c) for c in chats)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 250
    params = SamplingParams(temperature=0, max_tokens=16)
    reconfigure(smollm2, enable_prefix_caching=False)
    uncached = [o.token_ids for o in smollm2.generate([first, second], params, use_tqdm=False)]
    reconfigure(smollm2)
    assert smollm2.generate([first], params, use_tqdm=False)[0].token_ids == uncached[0]
    s, engine = smollm2.scheduler, smollm2.engine
    before = engine.num_scheduled_tokens
    out = smollm2.generate([second], params, use_tqdm=False)[0]
    assert out.token_ids == uncached[1]
    hit = shared // 16 * 16
    assert s.prefix_cache_hits == hit
    assert engine.num_scheduled_tokens - before == len(second) - hit + len(out.token_ids) - 1
