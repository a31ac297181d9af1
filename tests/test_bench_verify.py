"""`pagoda bench verify` on the CPU with a tiny dummy model: the result's structure and that the two
steps it times are what they say (a verify step scores the decode step's position first)."""
import json
import random
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from pagoda.cli import main

TINY = Path(__file__).parent / "data" / "tiny-llama.json"


def test_result_rows_and_goal(tmp_path):
    out = tmp_path / "verify.json"
    assert main(["bench", "verify", "--model", f"dummy:{TINY}", "--device", "cpu", "--batch-sizes", "1,3",
                 "--num-speculative-tokens", "1,4", "--context-len", "20", "--iters", "2", "--warmup", "1",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:5] == ["benchmark", "command", "commit", "date", "device"]
    assert result["command"].startswith(f"pagoda bench verify --model dummy:{TINY} --device cpu ")
    assert (result["cuda_graphs"], result["iters"], result["warmup"]) == (False, 2, 1)
    assert [(r["batch_size"], r["context_len"]) for r in result["rows"]] == [(1, 20), (3, 20)]
    for row in result["rows"]:
        assert [(e["k"], e["query_tokens"], e["in_graphs"]) for e in row["verify"]] == [
            (1, row["batch_size"] * 2, False), (4, row["batch_size"] * 5, False)]
        for e in row["verify"]:
            assert e["ratio"] == pytest.approx(e["verify_ms"] / row["decode_ms"])
    k4 = result["rows"][0]["verify"][1]
    assert result["goal"]["ratio"] == k4["ratio"] and result["goal"]["met"] == (k4["ratio"] <= 1.3)


def test_the_verify_step_scores_the_decode_steps_position_then_each_draft():
    from pagoda.bench.verify import measure
    from pagoda.offline import LLM

    llm = LLM(f"dummy:{TINY}", skip_tokenizer_init=True, device="cpu", block_size=16, num_gpu_blocks=64,
              num_cpu_blocks=0, max_num_seqs=8)
    runner = llm.executor.runner
    logits = []
    forward = runner.forward
    runner.forward = lambda step: logits.append(forward(step)) or logits[-1]
    try:
        row = measure(runner, 3, [2], Namespace(context_len=20, iters=1, warmup=0), random.Random(0))
    finally:
        llm.close()
    decode, verify = logits  # one timed run each
    assert row["verify"][0]["query_tokens"] == 9 and verify.shape[0] == 9 and decode.shape[0] == 3
    torch.testing.assert_close(verify[0::3], decode, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(verify[1::3], decode, atol=1e-3)  # the drafts' positions: other logits
