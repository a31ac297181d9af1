"""The real worker path (Executor, ModelRunner, model, loader) on a tiny random Llama, fast.

transformers' own LlamaForCausalLM, saved as safetensors, is the reference: our loader maps its
weights into fused projections and our engine must reproduce its greedy generate exactly, through
batching, chunked prefill and preemption.
"""
import random

import pytest
import torch

from common.config import EngineConfig
from common.protocol import CachedSequence, NewSequence, ProtocolError, SamplingParams, StepPlan
from tests.conftest import ROOT

TINY = ROOT / "tests" / "data" / "tiny-llama.json"


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY)
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100)]


@pytest.fixture(scope="module")
def expected(hf_model_dir, prompts):
    _, model = hf_model_dir
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be generated and does not stop
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("config", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_gpu_blocks": 24, "block_size": 8},  # preemption by recompute
    {"max_num_seqs": 2},
])
def test_greedy_matches_transformers(hf_model_dir, prompts, expected, config):
    from pagoda.offline import LLM

    llm = LLM(str(hf_model_dir[0]), skip_tokenizer_init=True, device="cpu", **config)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    if "num_gpu_blocks" in config:
        assert llm.scheduler.num_preemptions > 0
    bm = llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_worker_rejects_a_plan_for_an_unknown_sequence():
    from worker.executor import Executor

    executor = Executor(EngineConfig(model=f"dummy:{TINY}", num_gpu_blocks=8, device="cpu"))
    with pytest.raises(ProtocolError, match="does not hold"):
        executor.execute(StepPlan(1, 0, cached_seqs=[CachedSequence(5, [1], 0, 1, 7)]))


def test_dummy_weights_are_deterministic():
    from pagoda.offline import LLM

    outs = [
        LLM(f"dummy:{TINY}", device="cpu", num_gpu_blocks=16).generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )[0].token_ids
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_offline_outputs_name_the_prompt_tokens_found_in_the_prefix_cache():
    """LLM.generate's num_cached_tokens (vLLM's RequestOutput field): whole blocks of 16 before the last
    prompt token's, and the same tokens as when nothing was cached."""
    from pagoda.offline import LLM

    llm = LLM(f"dummy:{TINY}", device="cpu", num_gpu_blocks=16, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = list(range(5, 45))  # 40 tokens: blocks 0-1 full, the last token in block 2
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert again.token_ids == first.token_ids

def test_worker_draws_as_many_samples_as_the_plan_asks():
    """The number of samples comes from the plan (the scheduler's rule), not from the worker's
    reading of best_of: the same best_of=3 sequence draws 3 tokens or 1 as the plan says."""
    from worker.executor import Executor

    executor = Executor(EngineConfig(model=f"dummy:{TINY}", num_gpu_blocks=8, device="cpu"))
    params = SamplingParams(temperature=1.0, seed=7, best_of=3, max_tokens=4)
    for seq_id, num_samples in [(0, 3), (1, 1)]:
        new = NewSequence(seq_id, [5, 6, 7], [], [1 + seq_id], 0, 3, params, num_samples)
        result = executor.execute(StepPlan(1 + seq_id, 0, new_seqs=[new]))
        assert [s.seq_id for s in result.sampled] == [seq_id] * num_samples
    chunk = executor.execute(StepPlan(3, 0, new_seqs=[NewSequence(2, [5, 6, 7], [], [3], 0, 2, params, 3)]))
    assert chunk.sampled == []  # the prompt's last token is not computed yet: nothing drawn


def test_dummy_weights_are_drawn_in_the_target_dtype_and_seeded(monkeypatch):
    """Drawn where they live, in their dtype (an 8B model drawn in float32 on the host and then moved
    took minutes before a GPU run): every normal_ fills a bfloat16 tensor; the same seed gives the
    same weights, another seed others."""
    import torch

    from common.models import resolve_model
    from worker.loader import load_model

    filled = []
    real = torch.Tensor.normal_

    def spy(self, *args, **kwargs):
        filled.append(self.dtype)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", spy)
    source = resolve_model(f"dummy:{TINY}")
    first, _ = load_model(source, torch.bfloat16, torch.device("cpu"), None, seed=3)
    assert filled and set(filled) == {torch.bfloat16}
    again, _ = load_model(source, torch.bfloat16, torch.device("cpu"), None, seed=3)
    other, _ = load_model(source, torch.bfloat16, torch.device("cpu"), None, seed=4)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
        assert "norm" in name or not torch.equal(a, c), name


def test_the_cpu_prefix_cache_copies_an_evicted_prefix_back_and_generates_the_same_tokens():
    """--cpu-prefix-cache: a 40-token prompt's 2 cached blocks, evicted from a 5-block device pool by
    a longer prompt, move to the swap pool; the prompt again finds them there (32 cached tokens),
    copied back through the workers' swap path, and generates the tokens it generated the first
    time, which are those of a pool with no tier (recomputed)."""
    from pagoda.offline import LLM

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt, other = list(range(5, 45)), list(range(100, 172))  # 3 blocks and 5 blocks with their 3 tokens
    outputs = {}
    for tier in (True, False):
        llm = LLM(f"dummy:{TINY}", device="cpu", num_gpu_blocks=6, num_cpu_blocks=8, cpu_prefix_cache=tier,
                  skip_tokenizer_init=True)
        bm = llm.scheduler.block_manager
        assert bm.enable_cpu_tier == tier
        runs = [llm.generate([p], params, use_tqdm=False)[0] for p in (prompt, other, prompt)]
        outputs[tier] = [(run.token_ids, run.num_cached_tokens) for run in runs]
        assert (bm.num_cpu_tier_stores >= 2, bm.num_cpu_tier_hits) == ((True, 2) if tier else (False, 0))
        bm.check_integrity()
        llm.close()
    assert [cached for _, cached in outputs[True]] == [0, 0, 32]
    assert [cached for _, cached in outputs[False]] == [0, 0, 0]
    assert [tokens for tokens, _ in outputs[True]] == [tokens for tokens, _ in outputs[False]]
    assert outputs[True][2][0] == outputs[True][0][0]
