"""`pagoda bench long-context` through the CLI, small: the Gemma-3-shaped dummy model's KV cache
groups against the uniform allocator in one KV budget, and the JSON's fields. Never timings."""
import json

from pagoda.cli import main


def test_the_groups_and_the_uniform_allocator_serve_the_same_requests_in_one_budget(tmp_path, monkeypatch, capsys):
    """64-token prompts (inside the 1,024-token window: the groups save nothing on the windows here)
    in 1 MiB: a block of the groups' is 2 layers (the 2 global layers' count), the uniform
    allocator's all 12."""
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "result.json"
    assert main(["bench", "long-context", "--prompt-tokens", "64", "--output-tokens", "4", "--requests", "3",
                 "--kv-cache-gib", str(1 / 1024), "--max-num-batched-tokens", "64", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    groups, uniform = result["rows"]
    assert (groups["allocator"], uniform["allocator"]) == ("kv-cache-groups", "uniform")
    assert groups["kv_groups"] == [0] + [1024] * 5 and uniform["kv_groups"] == []
    assert (groups["layers_per_block"], uniform["layers_per_block"]) == (2, 12)
    assert uniform["kv_bytes_per_block"] == 6 * groups["kv_bytes_per_block"] == 6 * 2 * 2 * 16 * 64 * 4
    assert (groups["num_gpu_blocks"], uniform["num_gpu_blocks"]) == (64, 10)  # of 16,384 and 98,304 bytes
    # inside the window every group holds the whole sequence: 30 of the groups' 64 blocks (6 groups of
    # 5), 5 of the uniform allocator's 10: 2 at once either way
    assert (groups["max_running"], groups["preemptions"]) == (2, 0) and uniform["max_running"] == 2
    assert groups["output_tokens"] == uniform["output_tokens"] == 12
    assert result["concurrency_ratio"] == round(groups["max_running"] / uniform["max_running"], 3)
    assert result["checkpoint"].startswith("dummy:") and result["command"].startswith("pagoda bench long-context")
