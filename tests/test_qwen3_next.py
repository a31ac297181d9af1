"""Qwen3-Next (worker/models/qwen3_next.py): a tiny random model of 3 Gated DeltaNet layers and one
gated full-attention layer, each with a MoE and its shared expert, equal to transformers in float32
(greedy tokens exactly, logprobs within 1e-4) through `pagoda generate`, with chunked prefill,
preempted in a small pool by recompute (a sequence's recurrent state lives in the worker's slot,
worker/recurrent_state.py) and preempted by swap (the state waits in host memory), n > 1 samples
and beams (each child from its parent's state); in a tensor-parallel group of two; and the served
API in a group of two (slow)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from common.protocol import SamplingParams
from pagoda import cli
from tests import families

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIG = dict(families.BASE, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """(directory, prompts, transformers' greedy tokens and logprobs)."""
    import transformers

    directory = tmp_path_factory.mktemp("qwen3-next")
    config = transformers.Qwen3NextConfig(**CONFIG)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(directory)
    for file in families.TOKENIZER.iterdir():
        if file.name != "README.md":
            shutil.copy(file, directory)
    prompts = families.prompts()
    return directory, prompts, families.reference(model, prompts)


def matches(reference, token_ids, logprobs) -> None:
    assert token_ids == reference.token_ids
    for mine, theirs in zip(logprobs, reference.logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_generate_matches_transformers(qwen3_next, tmp_path, capsys):
    directory, prompts, reference = qwen3_next
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompts)
    argv = ["generate", "--model", str(directory), "--prompts-file", str(prompts_file), "--json", "--temperature", "0",
            "--max-tokens", str(families.MAX_TOKENS), "--logprobs", "0", "--device", "cpu", "--dtype", "float32",
            "--block-size", "8"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_and_preemption_carry_the_state(qwen3_next, mode):
    """16-token chunks carry each sequence's state from chunk to chunk; in 24 blocks of 8 the batch
    preempts: a swapped sequence's state waits in host memory and comes back with it, a recomputed
    one starts again from zeros (or from a prefix-cache hit's saved state); no block leaks. The same
    prompts again, every token is still transformers'."""
    from pagoda.offline import LLM

    directory, prompts, reference = qwen3_next
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=24, num_cpu_blocks=32,
              preemption_mode=mode, max_num_batched_tokens=16)
    s = llm.scheduler
    assert s.recurrent_state and s.block_manager.enable_prefix_caching and s.state_checkpoints is not None
    params = SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0)
    for _ in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        matches(reference, [list(o.token_ids) for o in outputs], [[t[0] for t in o.logprobs] for o in outputs])
        assert (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions) > 0
        assert s.num_preemptions == (s.num_swap_preemptions if mode == "swap" else s.num_recompute_preemptions)
        s.block_manager.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks
    recurrent = llm.executor.runner.recurrent
    assert recurrent.num_slots >= 8 and recurrent.kept == {}  # a slot per held sequence; nothing left behind


def test_prefix_cache_hits_start_from_the_state_saved_at_their_end(qwen3_next):
    """Each step saves the state at every block boundary it passes, keyed by that block: a repeated
    prompt hits every full block but its last token's, one sharing the first 60 tokens hits the 56
    of its whole blocks, each starting from the state saved there; tokens and logprobs are
    transformers'. With 4 checkpoint slots (--max-num-seqs 4) only the latest 4 blocks' states stay:
    the repeated prompt still hits, the shared one's hit shrinks to nothing (its block's state is
    gone), and it computes everything, still exactly."""
    import transformers

    from pagoda.offline import LLM

    directory, _, _ = qwen3_next
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    first, other = (torch.randint(4, 512, (100,), generator=gen).tolist() for _ in range(2))
    shared = first[:60] + other[60:]
    reference = families.reference(model, [first, shared])
    params = SamplingParams(temperature=0, max_tokens=families.MAX_TOKENS, logprobs=0)
    for max_num_seqs, hits in ((128, (0, 96, 56)), (4, (0, 96, 0))):
        llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, max_num_seqs=max_num_seqs)
        assert llm.scheduler.state_checkpoints.capacity == max_num_seqs
        for prompt, hit, theirs in zip((first, first, shared), hits, (0, 0, 1)):
            llm.scheduler.prefix_cache_hits = 0
            [out] = llm.generate([prompt], params, use_tqdm=False)
            assert llm.scheduler.prefix_cache_hits == hit
            assert list(out.token_ids) == reference.token_ids[theirs]
            assert [t[0] for t in out.logprobs] == pytest.approx(reference.logprobs[theirs], abs=1e-4)
        llm.close()


def test_checkpoint_slots_are_given_once_a_plan_and_never_while_a_restore_waits():
    """The workers write a plan's saves in their own order (wave by wave): a slot given twice in
    one plan could end up holding either state; and a slot an admitted sequence will start from
    must keep its state until that sequence is sent. A save with no slot left is skipped (a hit
    then stops short of that block); a failed group's saves leave the plan with it."""
    from common.protocol import StepPlan
    from scheduler.failures import withdraw
    from scheduler.state_cache import StateCheckpoints

    c = StateCheckpoints(2)
    assert (c.save(10), c.save(11), c.save(12)) == (0, 1, None)  # both slots given in this plan
    assert c.usable([10, 11, 12]) == 2 and c.usable([12]) == 0
    c.new_plan()
    c.restore(7, 10)  # sequence 7 will start from block 10's state, in slot 0
    assert c.save(12) == 1  # the least recently used slot not being restored from: block 11's
    assert c.usable([10, 11]) == 1 and c.usable([10, 11, 12]) == 3
    c.new_plan()
    assert c.save(13) == 1 and c.save(14) is None  # slot 0 waits for sequence 7, slot 1 is this plan's
    assert c.sent(7) == 0 and c.sent(7) == -1
    c.new_plan()
    assert c.save(14) == 0  # sent: free to reuse
    c.forget(14)
    assert c.usable([10, 14]) == 0 and c.save(15) == 0  # a block handed out again lost its slot
    plan = StepPlan(1, 0, state_saves=[[1, 8, 0], [2, 16, 1]])
    withdraw(plan, {1}, set())
    assert plan.state_saves == [[2, 16, 1]]


def test_more_saves_than_slots_in_one_step_stay_exact(qwen3_next):
    """Two prompts prefilled in one step pass 7 block boundaries with 2 checkpoint slots: 5 saves
    are skipped, and a later prompt sharing the second's first 16 tokens computes what no kept
    state covers; its tokens are transformers'."""
    import transformers

    from pagoda.offline import LLM

    directory, _, _ = qwen3_next
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    first, second = torch.randint(4, 512, (41,), generator=gen).tolist(), torch.randint(4, 512, (17,), generator=gen).tolist()
    third = second[:16] + torch.randint(4, 512, (5,), generator=gen).tolist()
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, max_num_seqs=2)
    llm.generate([first, second], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    [out] = llm.generate([third], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert list(out.token_ids) == families.reference(model, [third], 8).token_ids[0]


def test_a_lone_decoding_sequence_saves_the_blocks_its_output_fills(qwen3_next):
    """The decode fast path saves too: a follow-up prompt holding a 20-token prompt and its 30
    outputs hits every full block but its last token's, and its next token is transformers'."""
    import transformers

    from pagoda.offline import LLM

    directory, _, _ = qwen3_next
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(4, 512, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    follow = prompt + list(out.token_ids) + [7, 8, 9, 10, 11]
    llm.scheduler.prefix_cache_hits = 0
    [again] = llm.generate([follow], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.scheduler.prefix_cache_hits == 48
    assert list(again.token_ids) == families.reference(model, [follow], 1).token_ids[0]


def test_parallel_samples_fork_the_state(qwen3_next):
    """n = 3 seeded samples fork from the prompt's sequence after its first draw: each child starts
    from its parent's state, and draws what a lone request seeded as that sample draws."""
    from pagoda.offline import LLM
    from common.protocol import sample_seed

    directory, prompts, _ = qwen3_next
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3, ignore_eos=True)
    [grouped] = llm.generate(prompts[:1], params, use_tqdm=False)
    assert len({tuple(s.token_ids) for s in grouped.outputs}) == 3
    for i, sample in enumerate(grouped.outputs):
        alone = SamplingParams(temperature=1.0, max_tokens=8, seed=sample_seed(7, i), ignore_eos=True)
        assert llm.generate(prompts[:1], alone, use_tqdm=False)[0].token_ids == sample.token_ids


def test_forked_children_sent_late_start_from_their_parents_state(qwen3_next):
    """Greedy samples (n of 1 to 3) of six prompts in 8-token steps: a child forked after its
    prompt's first draw often waits steps for the budget before it is first sent, and the workers
    keep its parent's state for it until then. Every sample is transformers' greedy continuation."""
    import random

    import transformers

    from pagoda.offline import LLM

    directory, _, _ = qwen3_next
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rnd = random.Random(37)
    prompts = [list(range(100 + 50 * i, 100 + 50 * i + rnd.randint(3, 30))) for i in range(6)]
    counts = [rnd.choice([1, 2, 3]) for _ in prompts]
    reference = families.reference(model, prompts, 8)
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=8, max_num_seqs=32)
    params = [SamplingParams(temperature=0, n=n, max_tokens=8, ignore_eos=True) for n in counts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outputs] == [
        [t] * n for t, n in zip(reference.token_ids, counts)]
    assert llm.executor.runner.recurrent.kept == {}


def test_a_request_aborted_while_swapped_out_leaves_no_state_behind(qwen3_next):
    from pagoda.offline import LLM

    directory, _, _ = qwen3_next
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=8, num_cpu_blocks=64,
              preemption_mode="swap")
    engine, recurrent = llm.engine, llm.executor.runner.recurrent
    for i in range(3):
        engine.add_request(f"r{i}", list(range(100 + 50 * i, 112 + 50 * i)),
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not engine.scheduler.swapped:
        engine.step()
    assert recurrent.kept  # the swapped-out sequences' states, in host memory
    for group in list(engine.scheduler.swapped):
        engine.abort_request(group.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the plan that tells the workers
    assert recurrent.kept == {}


def test_beam_search_equals_transformers(qwen3_next):
    """Beams fork and are freed every step, each child from its parent's state."""
    import transformers

    from pagoda.offline import LLM

    directory, prompts, _ = qwen3_next
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, beam_width=2, n=2)
    for prompt, out in zip(prompts[:2], llm.generate(prompts[:2], params, use_tqdm=False)):
        with torch.inference_mode():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, num_beams=2,
                                num_return_sequences=2, return_dict_in_generate=True, output_logits=True,
                                eos_token_id=2, pad_token_id=0)
        lengths = (hf.beam_indices != -1).sum(dim=1).tolist()
        expected = [hf.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist() for i in range(2)]
        assert [sample.token_ids for sample in out.outputs] == expected
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_group_of_two_matches_transformers_swapping(qwen3_next, tmp_path, capsys, monkeypatch):
    """Each rank holds its key heads (with their value heads) of every linear-attention layer, their
    state, and their share of the attention heads and experts; swapped in a small pool."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    directory, prompts, reference = qwen3_next
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompts)
    argv = ["generate", "--model", str(directory), "--prompts-file", str(prompts_file), "--json", "--temperature", "0",
            "--max-tokens", str(families.MAX_TOKENS), "--logprobs", "0", "--device", "cpu", "--dtype", "float32",
            "--block-size", "8", "--tensor-parallel-size", "2", "--num-gpu-blocks", "24", "--preemption-mode", "swap",
            "--max-num-batched-tokens", "16"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    results = [json.loads(line) for line in captured.out.splitlines()]
    matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])
    assert re.search(r"[1-9]\d* preemptions \([1-9]\d* swap, 0 recompute\)", captured.err), captured.err


@pytest.mark.slow
def test_served_api_matches_transformers(qwen3_next, redis_url):
    import openai

    from tests.stack import Stack

    directory, prompts, reference = qwen3_next
    stack = Stack("--model", str(directory), "--redis-url", redis_url, "--tensor-parallel-size", "2", "--block-size",
                  "8", "--num-gpu-blocks", "24", "--preemption-mode", "recompute", "--dtype", "float32").wait_ready()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model=directory.name, prompt=[families.prompt_text(p) for p in prompts],
                                             max_tokens=families.MAX_TOKENS, temperature=0, logprobs=0)
        choices = sorted(response.choices, key=lambda c: c.index)
        assert [c.logprobs.tokens for c in choices] == [families.token_strings(ids) for ids in reference.token_ids]
        for choice, theirs in zip(choices, reference.logprobs, strict=True):
            assert choice.logprobs.token_logprobs == pytest.approx(theirs, abs=1e-4)
    finally:
        assert stack.stop() == 0
