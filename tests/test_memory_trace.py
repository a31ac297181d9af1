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
    llm = tiny_llm(tmp_path / "trace.jsonl", memory_trace_interval=0)  # every step that changed the memory
    [out] = llm.generate([PROMPT], N4, use_tqdm=False)
    llm.close()
    assert [len(sample.token_ids) for sample in out.outputs] == [4] * 4
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [check_snapshot(s) for s in trace] == [[]] * len(trace)
    assert {(s["engine"], s["scheduler_id"], s["num_gpu_blocks"], s["block_size"]) for s in trace} == {
        ("0", "offline", 32, 16)}
    steps = [s["step"] for s in trace]
    assert steps == sorted(set(steps))  # one line per step that changed the memory, in order
    assert [s["version"] for s in trace] == list(range(1, len(trace) + 1))
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
    assert [(e["id"], e["kind"], e["seq_id"], e["blocks"], e["num_blocks"]) for e in second["events"][3:]] == [
        (4, "cow", 0, [3, 4], 2), (5, "cow", 1, [3, 5], 2), (6, "cow", 2, [3, 6], 2)]
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


def test_the_trace_is_written_at_most_every_quarter_second_by_default(tmp_path, monkeypatch):
    """As the scheduler process publishes (scheduler/server.MEMORY_INTERVAL_S), from LLM and the CLI."""
    from pagoda import offline
    from pagoda.cli import main
    from scheduler.server import MEMORY_INTERVAL_S

    llm = tiny_llm(tmp_path / "trace.jsonl")
    llm.close()
    assert llm.memory_trace.interval_s == MEMORY_INTERVAL_S == 0.25
    given = {}

    class Given(Exception):
        pass

    def llm_of(**kwargs):
        given.update(kwargs)
        raise Given  # enough: what the CLI passes on is known

    monkeypatch.setattr(offline, "LLM", llm_of)
    with pytest.raises(Given):
        main(["generate", "--prompt", "hi", "--memory-trace", str(tmp_path / "cli.jsonl")])
    assert (given["memory_trace"], given["memory_trace_interval"]) == (str(tmp_path / "cli.jsonl"), 0.25)


def test_event_ids_and_versions_go_on_across_a_reset(tmp_path):
    """LLM.reset() builds a new Scheduler: it takes over the event log, so the page loses no event."""
    llm = tiny_llm(tmp_path / "trace.jsonl", memory_trace_interval=0)
    llm.generate([PROMPT], N4, use_tqdm=False)
    before = read_trace(tmp_path / "trace.jsonl")[-1]["events"]
    llm.reset(num_gpu_blocks=16)
    llm.generate([PROMPT], N4, use_tqdm=False)
    llm.close()
    trace = read_trace(tmp_path / "trace.jsonl")
    assert [s["version"] for s in trace] == list(range(1, len(trace) + 1))
    after = [e for e in trace[-1]["events"] if e["id"] > before[-1]["id"]]
    assert [e["id"] for e in before] == list(range(1, 7))  # 3 forks, 3 copies
    assert [(e["id"], e["kind"]) for e in after] == [(7, "fork"), (8, "fork"), (9, "fork"), (10, "cow"), (11, "cow"),
                                                      (12, "cow")]
    assert trace[-1]["events"][:6] == before  # the events before the reset are still there


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
