"""Tensor parallelism on the CPU (gloo): a group of N ranks computes what one rank does.

The offline engine runs rank 0 in this process and ranks 1..N-1 as child processes, each with its
shard of the model (worker/model.py) loaded from its slices (worker/loader.py). Tiny random
models at sizes 2 and 4 (one with fewer KV heads than ranks, one with tied embeddings, a
vocabulary the size does not divide and QKV biases) must give size 1's tokens exactly, and its
logprobs to a float tolerance (the all-reduce sums in another order), through greedy decoding,
seeded n > 1, beam search, and swap and recompute preemption. The default model at size 3 is held
to transformers in tests/test_parity.py.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from common.protocol import SamplingParams
from pagoda import cli
from pagoda.offline import LLM
from tests.conftest import TINY_LLAMA
from worker.models import check_shardable
from worker.models.layers import AttentionShard, vocab_shard
from worker.parallel import TensorParallelGroup, get_tp_group, set_tp_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 8
# qwen2 (QKV biases), tied embeddings, a vocabulary of 509 (padded to 510 at size 2)
TIED_QWEN = {"model_type": "qwen2", "vocab_size": 509, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
             "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


# ----------------------------------------------------------------------------- the arithmetic

@pytest.mark.parametrize("heads, kv_heads, size, expected", [
    (9, 3, 3, [(3, 1, 0, 0), (3, 1, 3, 1), (3, 1, 6, 2)]),  # the default model at size 3
    (4, 2, 4, [(1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 2, 1), (1, 1, 3, 1)]),  # each KV head on 2 ranks
    (32, 8, 2, [(16, 4, 0, 0), (16, 4, 16, 4)]),
    (8, 1, 4, [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 0), (2, 1, 6, 0)]),  # multi-query: one KV head everywhere
])
def test_attention_shards_split_heads_and_replicate_kv_heads(heads, kv_heads, size, expected):
    shards = [AttentionShard.of(heads, kv_heads, rank, size) for rank in range(size)]
    assert [(s.num_heads, s.num_kv_heads, s.head_start, s.kv_head_start) for s in shards] == expected
    group = heads // kv_heads  # query heads per KV head: each rank's queries read only its KV heads
    for s in shards:
        assert {h // group for h in range(s.head_start, s.head_start + s.num_heads)} <= set(
            range(s.kv_head_start, s.kv_head_start + s.num_kv_heads))


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (9, 3, 2, "--tensor-parallel-size 2 does not divide the attention heads (9)"),
    (8, 6, 4, "--tensor-parallel-size 4 does not divide the key-value heads (6)"),
    (6, 2, 3, "--tensor-parallel-size 3 neither divides the key-value heads (2) nor is a multiple of them"),
])
def test_indivisible_head_counts_are_refused(heads, kv_heads, size, message):
    with pytest.raises(ValueError) as info:
        AttentionShard.of(heads, kv_heads, 0, size)
    assert str(info.value) == message


def test_vocab_shards_pad_to_a_multiple_of_the_size():
    assert [vocab_shard(509, rank, 2) for rank in range(2)] == [(0, 255), (255, 255)]
    assert [vocab_shard(512, rank, 4) for rank in range(4)] == [(0, 128), (128, 128), (256, 128), (384, 128)]


def test_an_indivisible_size_is_refused_before_any_rank_starts(capsys):
    config = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128})
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3 does not divide the attention heads \(4\)$"):
        check_shardable(config, 3)
    argv = ["generate", "--model", f"dummy:{TINY_LLAMA}", "--device", "cpu", "--prompt", "x",
            "--tensor-parallel-size", "3"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(
        "pagoda: error: --tensor-parallel-size 3 does not divide the attention heads (4)")


# ----------------------------------------------------------------------------- sharded loading

class _RecordingSafeOpen:
    """safetensors' safe_open, recording which tensors are read whole and which by slice."""

    def __init__(self, real, whole: list, sliced: list) -> None:
        self.real, self.whole, self.sliced = real, whole, sliced

    def __call__(self, *args, **kwargs):
        recorder = self

        class Handle:
            def __enter__(self):
                self.f = recorder.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                recorder.whole.append(name)
                return self.f.get_tensor(name)

            def get_slice(self, name):
                recorder.sliced.append(name)
                return self.f.get_slice(name)

        return Handle()


def _model_at(directory, rank: int, size: int, monkeypatch=None):
    from common.models import ModelSource
    from common.redis_server import free_port
    from worker.loader import load_model

    saved = get_tp_group()
    set_tp_group(TensorParallelGroup(rank, size, f"tcp://127.0.0.1:{free_port()}"))  # never formed: loading is local
    try:
        return load_model(ModelSource("hf", directory, "tiny"), torch.float32, torch.device("cpu"), 256)[0]
    finally:
        set_tp_group(saved)


def test_each_rank_reads_only_its_slices_and_holds_that_slice(tiny, monkeypatch):
    """Size 4 of tiny-llama (4 query heads, 2 KV heads): every sharded tensor is read by slice,
    only the norms whole; each rank's parameters are its rows or columns of size 1's."""
    import worker.models.weights

    directory = tiny[0]
    full = _model_at(directory, 0, 1)
    whole, sliced = [], []
    monkeypatch.setattr(worker.models.weights, "safe_open",
                        _RecordingSafeOpen(worker.models.weights.safe_open, whole, sliced))
    shards = [_model_at(directory, rank, 4) for rank in range(4)]
    assert whole and all("norm" in name for name in whole)
    assert len(sliced) == 4 * (2 + 7 * 2)  # embed and lm_head, 7 projections per layer, per rank

    q, kv, inter = 16, 16, 32  # rows per rank: 1 query head and 1 KV head of 16, 128 / 4
    fp = dict(full.named_parameters())
    for rank, shard in enumerate(shards):
        p = dict(shard.named_parameters())
        kv_head = rank // 2
        assert p["model.embed_tokens.weight"].shape == (128, 64)
        assert torch.equal(p["model.embed_tokens.weight"], fp["model.embed_tokens.weight"][rank * 128:(rank + 1) * 128])
        assert torch.equal(p["lm_head.weight"], fp["lm_head.weight"][rank * 128:(rank + 1) * 128])
        for i in range(2):
            name = f"model.layers.{i}."
            full_qkv = fp[name + "self_attn.qkv_proj.weight"].split([64, 32, 32])
            expected_qkv = torch.cat([full_qkv[0][rank * q:(rank + 1) * q], full_qkv[1][kv_head * kv:(kv_head + 1) * kv],
                                      full_qkv[2][kv_head * kv:(kv_head + 1) * kv]])
            assert p[name + "self_attn.qkv_proj.weight"].shape == (48, 64)
            assert torch.equal(p[name + "self_attn.qkv_proj.weight"], expected_qkv)
            assert torch.equal(p[name + "self_attn.o_proj.weight"],
                               fp[name + "self_attn.o_proj.weight"][:, rank * q:(rank + 1) * q])
            gate, up = fp[name + "mlp.gate_up_proj.weight"].split([128, 128])
            assert torch.equal(p[name + "mlp.gate_up_proj.weight"],
                               torch.cat([gate[rank * inter:(rank + 1) * inter], up[rank * inter:(rank + 1) * inter]]))
            assert torch.equal(p[name + "mlp.down_proj.weight"],
                               fp[name + "mlp.down_proj.weight"][:, rank * inter:(rank + 1) * inter])
            assert torch.equal(p[name + "input_layernorm.weight"], fp[name + "input_layernorm.weight"])


def test_ranks_starting_together_convert_a_gguf_file_once(tmp_path, monkeypatch):
    """The ranks of a group start at once on a cold cache: one converts, the others wait for it
    and read its result (the weights are published last, so a directory with them is whole)."""
    import threading
    import time

    from common.models import ModelSource
    from worker import loader

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    source = ModelSource("gguf", gguf, "model")
    conversions = []

    def convert(path, target):  # a slow conversion, published as the real one is
        conversions.append(path)
        time.sleep(0.3)
        work = tmp_path / f"work-{len(conversions)}"
        work.mkdir()
        (work / "model.safetensors").write_bytes(b"weights")
        (work / "config.json").write_text("{}")
        loader._publish(work, target)

    monkeypatch.setattr(loader, "convert_gguf", convert)
    found = []
    ranks = [threading.Thread(target=lambda: found.append(loader.hf_directory(source))) for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert conversions == [gguf]
    assert found == [source.converted_dir] * 3
    assert sorted(p.name for p in source.converted_dir.iterdir()) == ["config.json", "model.safetensors"]


def test_a_step_that_fails_on_rank_0_ends_the_group_with_a_clear_error(tmp_path, monkeypatch):
    """The other ranks then wait in a collective rank 0 never reached: nothing more is broadcast
    to them (a reset or a plan would be read as the awaited tensor), and close() ends them. (Before
    the module's `pair` groups: one process holds one default process group at a time.)"""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TIED_QWEN))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    group = LLM(f"dummy:{path}", tensor_parallel_size=2, skip_tokenizer_init=True, device="cpu",
                block_size=BLOCK_SIZE, num_gpu_blocks=64, num_cpu_blocks=0)
    try:
        monkeypatch.setattr(type(group.executor.sampler), "sample", lambda *_: (_ for _ in ()).throw(
            RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="^boom$"):
            group.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        message = ("a step failed on rank 0 of the tensor-parallel group, which cannot go on: "
                   "close this LLM and build a new one")
        with pytest.raises(RuntimeError) as info:
            group.reset()
        assert str(info.value) == message
        with pytest.raises(RuntimeError) as info:
            group.engine.step()  # the failed request is still held: the next step is refused too
        assert str(info.value) == message
    finally:
        group.close()
    assert [proc.is_alive() for proc, _ in group.ranks.procs] == [False]


# ----------------------------------------------------------------------------- a group vs one rank

CASES = {  # name -> (model config, tensor-parallel size)
    "tied-qwen2-padded-vocab-size2": (TIED_QWEN, 2),
    "llama-kv-heads-replicated-size4": (json.loads(TINY_LLAMA.read_text()), 4),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory, one_torch_thread):
    """(size-1 LLM, size-N LLM) of one dummy model; one group alive at a time (pytest finishes
    every test of a param before the next)."""
    config, size = CASES[request.param]
    path = tmp_path_factory.mktemp("tp") / "config.json"
    path.write_text(json.dumps(config))
    kwargs = dict(skip_tokenizer_init=True, device="cpu", block_size=BLOCK_SIZE, num_gpu_blocks=256, num_cpu_blocks=128)
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")  # per rank
    group = LLM(f"dummy:{path}", tensor_parallel_size=size, **kwargs)
    mp.undo()
    one = LLM(f"dummy:{path}", **kwargs)
    yield one, group
    group.close()
    assert [proc.exitcode for proc, _ in group.ranks.procs] == [0] * (size - 1)  # told to stop, they exited


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


WORKLOAD = [  # (prompt, params): greedy with logprobs, seeded n > 1, beam search, best_of
    *[(_prompt(i, n), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
      for i, n in enumerate((1, 5, 17, 33, 64))],
    (_prompt(10, 9), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)),
    (_prompt(11, 12), SamplingParams(n=2, beam_width=3, max_tokens=8, ignore_eos=True)),
    (_prompt(12, 6), SamplingParams(n=1, best_of=3, temperature=0.8, top_p=0.9, seed=3, max_tokens=10,
                                    ignore_eos=True)),
]


def _run(llm: LLM, **reset) -> tuple[list, tuple[int, int, int]]:
    llm.reset(**reset)
    outputs = llm.generate([p for p, _ in WORKLOAD], [s for _, s in WORKLOAD], use_tqdm=False)
    s = llm.scheduler
    bm = s.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks
    return outputs, (s.num_preemptions, s.num_swap_preemptions, s.num_recompute_preemptions)


def _assert_same(group_outputs, one_outputs) -> None:
    assert [[o.token_ids for o in out.outputs] for out in group_outputs] == \
        [[o.token_ids for o in out.outputs] for out in one_outputs]
    for g, o in zip(group_outputs, one_outputs):
        for gs, os_ in zip(g.outputs, o.outputs):
            assert gs.cumulative_logprob == pytest.approx(os_.cumulative_logprob, abs=1e-3)
            assert gs.finish_reason == os_.finish_reason
            if os_.logprobs is not None:  # per token: (its logprob, [[token id, logprob], ...] best first)
                assert [[t for t, _ in top] for _, top in gs.logprobs] == [[t for t, _ in top] for _, top in os_.logprobs]
                assert [lp for lp, _ in gs.logprobs] == pytest.approx([lp for lp, _ in os_.logprobs], abs=1e-4)


@pytest.mark.parametrize("reset, preempts", [
    ({}, None),
    ({"num_gpu_blocks": 24, "preemption_mode": "swap"}, "swap"),
    ({"num_gpu_blocks": 24, "preemption_mode": "recompute"}, "recompute"),
])
def test_a_group_generates_what_one_rank_does(pair, reset, preempts):
    one, group = pair
    expected, one_counts = _run(one, **reset)
    outputs, counts = _run(group, **reset)
    _assert_same(outputs, expected)
    assert counts == one_counts  # the same schedule
    if preempts == "swap":
        assert counts[1] > 0
    elif preempts == "recompute":
        assert counts[2] > 0
    else:
        assert counts[0] == 0


def test_a_group_pools_its_smallest_ranks_blocks_and_ranks_hold_their_kv_heads(pair):
    one, group = pair
    one.reset(), group.reset()
    assert group.num_blocks == (256, 128)  # every rank's: the same --num-gpu-blocks and --num-cpu-blocks
    assert group.scheduler.block_manager.num_total_blocks == one.scheduler.block_manager.num_total_blocks
    attn_one = one.executor.runner.model.attention_layers()[0]
    attn = group.executor.runner.model.attention_layers()[0]
    size = group.executor.world_size
    assert attn.num_heads == attn_one.num_heads // size
    assert attn.num_kv_heads == max(attn_one.num_kv_heads // size, 1)
    assert group.executor.runner.kv_caches[0].shape == (256, 2, BLOCK_SIZE, attn.num_kv_heads, 16)


# ----------------------------------------------------------------------------- CUDA (NCCL)

@pytest.mark.gpu
def test_auto_and_cuda_give_each_rank_its_own_gpu():
    from worker.model_runner import resolve_device

    count, current = torch.cuda.device_count(), torch.cuda.current_device()
    assert [resolve_device("auto", rank) for rank in range(3)] == [
        torch.device("cuda", (current + rank) % count) for rank in range(3)]
    assert resolve_device("cuda", 1) == resolve_device("auto", 1)
    assert resolve_device("cuda:0", 1) == torch.device("cuda", 0)


GPU_SCRIPT = """
import json, sys
from common.protocol import SamplingParams
from pagoda.offline import LLM
llm = LLM(sys.argv[1], skip_tokenizer_init=True, device="cuda", dtype="float32", tensor_parallel_size=int(sys.argv[2]))
outputs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
print(json.dumps([o.token_ids for o in outputs]))
llm.close()
"""


@pytest.mark.gpu
def test_a_group_on_two_gpus_generates_what_one_gpu_does():
    """NCCL: each rank on its own GPU (decode steps eager at size 2), the tokens of size 1."""
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")

    def generate(size: int) -> list:
        prompts = json.dumps([_prompt(0, 3), _prompt(1, 40)])
        proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT, f"dummy:{TINY_LLAMA}", str(size), prompts],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    assert generate(2) == generate(1)
