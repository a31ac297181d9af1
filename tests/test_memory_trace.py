"""The offline engine's memory trace: `LLM(memory_trace=...)` and `pagoda generate --memory-trace`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.memory_snapshot import check_snapshot
from common.protocol import SamplingParams
from scheduler.memory_trace import read_trace

TINY = Path(__file__).parent / "data" / "tiny-llama.json"
PROMPT = list(range(3, 43))  # 40 tokens: blocks 1 and 2 full, block 3 holding 8 of 16 slots
N4 = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4, ignore_eos=True)


def tiny_llm(trace: Path, **kwargs):
    from pagoda.offline import LLM

    return LLM(f"dummy:{TINY}", device="cpu", num_gpu_blocks=32, memory_trace=str(trace), **kwargs)


def held(snapshot: dict) -> dict[int, int]:
    return {block: count for block, count in enumerate(snapshot["ref_counts"]) if count}


def strings(value) -> set[str]:
    """Every string value in a JSON value (keys left out)."""
    if isinstance(value, str):
        return {value}
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return set().union(*map(strings, items))


def test_n4_shares_the_prompt_blocks_at_4_then_copies_the_last_on_write_and_ends_with_nothing_held(tmp_path):
    llm = tiny_llm(tmp_path / "trace.jsonl")
    [out] = llm.generate([PROMPT], N4, use_tqdm=False)
    llm.close()
    assert [len(sample.token_ids) for sample in out.outputs] == [4] * 4
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [check_snapshot(s) for s in trace] == [[]] * len(trace)
    assert {(s["engine"], s["scheduler_id"], s["num_gpu_blocks"], s["block_size"]) for s in trace} == {
        ("0", "offline", 32, 16)}
    steps = [s["step"] for s in trace]
    assert steps == sorted(set(steps))  # one line per step that changed the memory, in order
    # the first step written: the prompt prefilled and forked into 4 samples sharing its 3 blocks
    first = trace[0]
    assert held(first) == {1: 4, 2: 4, 3: 4}
    assert [(q["seq_id"], q["num_slots"], q["block_table"]) for q in first["sequences"]] == [
        (seq_id, 40, [1, 2, 3]) for seq_id in range(4)]
    assert {q["request_id"] for q in first["sequences"]} == {"offline-0"}
    assert [(e["kind"], e["seq_id"], e["blocks"]) for e in first["events"]] == [
        ("fork", seq_id, [1, 2, 3]) for seq_id in (1, 2, 3)]
    # the next: each sample's first token goes into the shared last block, copied for three of them
    second = trace[1]
    assert held(second) == {1: 4, 2: 4, 3: 1, 4: 1, 5: 1, 6: 1}
    assert [(e["id"], e["kind"], e["seq_id"], e["blocks"]) for e in second["events"][3:]] == [
        (4, "cow", 0, [3, 4]), (5, "cow", 1, [3, 5]), (6, "cow", 2, [3, 6])]
    last = trace[-1]
    assert held(last) == {} and last["sequences"] == [] and last["stats"]["num_running"] == 0
    assert sorted(last["cached"]) == [1, 2]  # the prompt's full blocks stay in the prefix cache


def test_an_interval_writes_the_first_change_and_the_idle_end_only(tmp_path):
    llm = tiny_llm(tmp_path / "trace.jsonl", memory_trace_interval=3600.0)
    llm.generate([PROMPT], N4, use_tqdm=False)
    llm.generate([PROMPT[:20]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    trace = read_trace(tmp_path / "trace.jsonl")
    # per generate: its first step and the step that left the engine idle
    assert len(trace) == 3
    assert held(trace[0]) == {1: 4, 2: 4, 3: 4}
    assert held(trace[1]) == {} and held(trace[2]) == {}
    assert [e["kind"] for e in trace[1]["events"]] == ["fork"] * 3 + ["cow"] * 3  # none lost in between
    assert trace[2]["events"][-1]["kind"] == "prefix_hit"  # the second prompt's first block was cached


def test_a_negative_interval_is_refused(tmp_path):
    with pytest.raises(ValueError, match="memory trace interval -1"):
        tiny_llm(tmp_path / "trace.jsonl", memory_trace_interval=-1)


@pytest.mark.slow
def test_pagoda_generate_writes_a_trace_with_the_samples_sharing_their_prompt(tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    prompt = "Tell me a story about a lighthouse keeper who finds a message in a bottle on the shore one morning."
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--prompt", prompt, "--n", "4", "--temperature", "1",
         "--seed", "0", "--max-tokens", "4", "--ignore-eos", "--num-gpu-blocks", "64", "--device", "cpu", "--json",
         "--memory-trace", str(trace_file)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["outputs"]) == 4
    trace = read_trace(trace_file)
    assert strings(trace) <= {"0", "offline", "offline-0", "running", "gpu", "fork", "cow"}  # token counts, no text
    assert [check_snapshot(s) for s in trace] == [[]] * len(trace)
    first = trace[0]
    tables = [q["block_table"] for q in first["sequences"]]
    assert len(tables) == 4 and tables[0] and all(t == tables[0] for t in tables)
    assert held(first) == dict.fromkeys(tables[0], 4)
    events = [e for e in trace[-1]["events"] if e["kind"] in ("fork", "cow")]
    assert [e["kind"] for e in events] == ["fork"] * 3 + ["cow"] * 3
    assert held(trace[-1]) == {} and trace[-1]["sequences"] == []


def test_an_abort_that_frees_the_blocks_is_written(tmp_path):
    llm = tiny_llm(tmp_path / "trace.jsonl")
    llm.engine.add_request("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.abort_request("a")
    llm.close()
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [held(s) for s in trace] == [{1: 1, 2: 1, 3: 1}, {}]
    assert [q["request_id"] for q in trace[0]["sequences"]] == ["a"] and trace[1]["sequences"] == []
