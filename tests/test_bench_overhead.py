"""`pagoda bench overhead --parsers` on a scripted model: two gateways on one engine, the prompts
equal with tools or without, the same tokens streamed through both (exact chunk counts); the
ratios are reported, never judged here (timings are the benchmark's, not the test's)."""
import json

import scripted
from pagoda.cli import main

# the ChatML prompt ends in a word the tiny tokenizer does not know: <unk> picks the script
SCRIPTS = {"<unk>": ["The", " planets", " are", " Mercury,", " Venus,", " Earth", " and", " Mars."]}


def test_bench_overhead_parsers_streams_the_same_tokens_through_both_gateways(tmp_path):
    model = scripted.build(tmp_path / "model", SCRIPTS)
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--parsers", "--model", str(model), "--requests", "2",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:5] == ["benchmark", "command", "commit", "date", "device"]
    parsers = result["parsers"]
    assert parsers["parser_flags"] == "--reasoning-parser deepseek_r1 --tool-call-parser hermes"
    # 32 tokens: the script (8), EOS and <unk> (hidden), the script again, ...: 8 + 8 + 8 + 2 with text
    assert parsers["plain"]["chunks"] == parsers["parsers"]["chunks"] == 26
    assert set(parsers["ratio"]) == {"ttft_ms", "inter_token_ms"} and all(r > 0 for r in parsers["ratio"].values())
