"""`pagoda bench memory` through the real path: the Scheduler, every allocator and the trace executor."""
import json
import random
from pathlib import Path

import pytest

from common.config import ALLOCATORS
from common.protocol import CachedSequence, NewSequence, ProtocolError, SamplingParams, StepPlan
from pagoda.bench.memory import TOKEN_ID, Request, TraceExecutor, bench_memory, measure_sharing, replay
from pagoda.bench.workloads import RequestPair, sample_sharegpt
from pagoda.cli import main

NUM_BLOCKS = 300  # 299 usable: two 2048-token regions (128 blocks each) at a time for orca-max


@pytest.fixture(scope="module")
def requests():
    return [Request(p.prompt_len, p.output_len) for p in sample_sharegpt(50, seed=0, source="trace")]


def test_every_request_runs_its_recorded_length_and_every_block_comes_back(requests):
    exact_kv_tokens = sum(r.prompt_len + r.output_len - 1 for r in requests)  # the last token is never fed back
    for allocator in ALLOCATORS:
        metrics, scheduler, output_lens = replay(allocator, requests, NUM_BLOCKS, check_every=1)
        assert output_lens == {f"r{i}": r.output_len for i, r in enumerate(requests)}, allocator
        bm = scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks == NUM_BLOCKS - 1 and not bm.block_tables, allocator
        bm.check_integrity()
        if metrics["preemptions"] == 0:
            assert metrics["scheduled_tokens"] == exact_kv_tokens, allocator
        else:  # recompute after preemption: more tokens, never fewer
            assert metrics["scheduled_tokens"] > exact_kv_tokens, allocator
    assert replay("orca-max", requests, NUM_BLOCKS)[0]["max_resident_seqs"] == 2


def test_paged_beats_every_baseline_and_values_are_shares(requests):
    result = bench_memory(requests, NUM_BLOCKS)
    allocators = result["allocators"]
    assert list(allocators) == list(ALLOCATORS)
    paged = allocators["paged"]
    for name, r in allocators.items():
        assert 0.0 <= r["kv_utilization"] <= 1.0
        for key in ("breakdown", "breakdown_while_queued"):
            shares = {k: v for k, v in r[key].items() if k != "steps"}
            assert all(0.0 <= v <= 1.0 for v in shares.values()), (name, key)
            assert sum(shares.values()) == pytest.approx(1.0)
        assert 1 <= r["max_batch"] <= 256 and 0 < r["mean_batch"] <= r["max_batch"]
        if name != "paged":
            assert paged["kv_utilization"] > r["kv_utilization"], name
            assert paged["mean_batch"] > r["mean_batch"], name
            assert r["preemptions"] == 0, name  # regions are reserved up front
            assert r["breakdown"]["reservation"] > 0
            assert result["ratios"][name]["kv_utilization"] == pytest.approx(paged["kv_utilization"] / r["kv_utilization"])
    assert paged["breakdown"]["reservation"] == 0.0
    # the only waste paged has inside its blocks is the spare room of each sequence's last block
    assert paged["kv_utilization"] > 0.9
    # ordered as the paper's figure 2: max < pow2 < oracle < paged
    assert (allocators["orca-max"]["kv_utilization"] < allocators["orca-pow2"]["kv_utilization"]
            < allocators["orca-oracle"]["kv_utilization"] < paged["kv_utilization"])


def test_cli_writes_the_result_file(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--num-prompts", "12", "--num-blocks", str(NUM_BLOCKS), "--source", "trace",
                 "--sharing-prompts", "0",
                 "--allocators", "paged,orca-oracle", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["allocators"]) == {"paged", "orca-oracle"}
    for r in result["allocators"].values():
        assert {"kv_utilization", "mean_batch", "max_batch"} <= r.keys()
    assert result["workload"]["num_prompts"] == 12 and result["workload"]["source"] == "trace"
    assert result["config"]["num_blocks"] == NUM_BLOCKS
    assert {"command", "commit", "date", "device"} <= result.keys()
    assert result["command"].startswith("pagoda bench memory --num-prompts 12 --num-blocks 300 ")
    assert "sharing" not in result
    assert "paged" in capsys.readouterr().out  # the table


def test_unknown_allocator_is_an_error(capsys):
    assert main(["bench", "memory", "--num-prompts", "2", "--source", "trace", "--allocators", "buddy"]) == 2


TINY = Path(__file__).parent / "data" / "tiny-llama.json"


@pytest.fixture(scope="module")
def tiny_llm():
    from pagoda.offline import LLM

    return LLM(f"dummy:{TINY}", device="cpu", num_gpu_blocks=256)


def pairs_of(prompts: list[list[int]], output_len: int) -> list[RequestPair]:
    return [RequestPair(i, len(p), output_len, tuple(p)) for i, p in enumerate(prompts)]


def test_sharing_counts_a_forked_prompt_once(tiny_llm):
    # one 32-token prompt (2 full blocks), n=2, 2 tokens: after step 1 both samples hold the
    # prompt's 2 blocks (4 logical, 2 physical); after step 2 both ended and hold nothing
    prefix_pairs = pairs_of([[7] * 4] * 8, 1)
    pairs = prefix_pairs + pairs_of([list(range(3, 35))], 2)
    result = measure_sharing(tiny_llm, pairs, max_tokens=2, cases=("parallel-2",))
    r = result["parallel-2"]
    assert (r["logical_block_steps"], r["physical_block_steps"], r["steps"]) == (4, 2, 2)
    assert r["saved_fraction"] == 0.5


def test_sharing_savings_grow_with_the_number_of_samples_and_beams(tiny_llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in [20] * 8 + [40, 70, 25]]
    result = measure_sharing(tiny_llm, pairs_of(prompts, 12), max_tokens=12)
    saved = {case: r["saved_fraction"] for case, r in result.items()}
    assert set(saved) == {"parallel-2", "parallel-4", "parallel-6", "beam-2", "beam-4", "beam-6", "prefix"}
    assert 0 < saved["parallel-2"] < saved["parallel-4"] < saved["parallel-6"] < 1
    assert 0 < saved["beam-2"] < saved["beam-6"] < 1
    assert 0 < saved["prefix"] < 1
    bm = tiny_llm.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_trace_executor_samples_a_non_eos_token_when_a_sequence_is_due_and_checks_the_plan():
    ex = TraceExecutor(block_size=4)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    r = ex.execute(StepPlan(1, 0, new_seqs=[NewSequence(0, [5] * 6, [], [1], 0, 4, params)]))
    assert r.sampled == []  # 4 of 6 prompt tokens (a chunk)
    with pytest.raises(ProtocolError):  # slots 4..5 need a second block
        TraceExecutor(4).execute(StepPlan(1, 0, new_seqs=[NewSequence(0, [5] * 6, [], [1], 0, 6, params)]))
    r = ex.execute(StepPlan(2, 0, cached_seqs=[CachedSequence(0, [2], 1, 2, 5)]))
    assert [(s.seq_id, s.token_id) for s in r.sampled] == [(0, TOKEN_ID)]
    r = ex.execute(StepPlan(3, 0, cached_seqs=[CachedSequence(0, [], 2, 1, TOKEN_ID)]))
    assert len(r.sampled) == 1 and ex.seqs[0].num_tokens == 7 and ex.last_batch == 1
    with pytest.raises(ProtocolError):  # two tokens scheduled, one exists
        ex.execute(StepPlan(4, 0, cached_seqs=[CachedSequence(0, [], 2, 2, TOKEN_ID)]))
    with pytest.raises(ProtocolError):  # a sequence it never held
        TraceExecutor(4).execute(StepPlan(1, 0, cached_seqs=[CachedSequence(9, [], 0, 1, 5)]))
    with pytest.raises(ProtocolError):  # one block in two tables
        TraceExecutor(4).execute(StepPlan(1, 0, new_seqs=[
            NewSequence(0, [5], [], [1], 0, 1, params), NewSequence(1, [5], [], [1], 0, 1, params)]))
