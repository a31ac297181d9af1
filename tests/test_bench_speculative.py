"""`pagoda bench speculative` (pagoda/bench/speculative.py), its pure parts: the shipped edit prompts,
the speculative counters read from /metrics text, the client's chunk parsing, and the result's
arithmetic (speedup, acceptance, differing outputs). No stack is launched."""
from __future__ import annotations

import argparse
import json

import pytest

from pagoda.bench import speculative
from pagoda.bench.client import Stream
from pagoda.bench.speculative import Request


def test_the_edit_set_is_twenty_chats_each_with_text_to_copy():
    chats = speculative.load_edit_prompts()
    assert len(chats) == 20
    assert speculative.EDIT_PROMPTS.stat().st_size < 60_000
    contents = []
    for messages in chats:
        assert [m["role"] for m in messages] == ["user"]
        content = messages[0]["content"]
        instruction, _, _ = content.partition("\n\n")
        body = speculative.text_to_copy(content)
        assert instruction and body and body in content and instruction not in body
        if "```" in content:  # a code file of 15 to 40 lines
            assert 15 <= len(body.rstrip("\n").split("\n")) <= 40, instruction
        else:  # a passage of 100 to 200 words
            assert 100 <= len(body.split()) <= 200, instruction
        contents.append(content)
    assert len(set(contents)) == 20
    assert sum("```" in c for c in contents) >= 8 and sum("```" not in c for c in contents) >= 5  # both kinds
    assert any("```javascript" in c for c in contents) and any("```python" in c for c in contents)


def test_workloads_make_chat_or_token_id_requests():
    args = argparse.Namespace(workload="edit", num_prompts=3, prompts=None)
    requests, warm_up = speculative.workload(args)
    assert len(requests) == 3 and all(r.path == "/v1/chat/completions" for r in requests)
    assert warm_up not in requests
    body = requests[0].body(32, ignore_eos=False)
    assert body["temperature"] == 0 and body["max_tokens"] == 32 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body
    assert body["messages"][0]["role"] == "user"
    tokens = Request(prompt=(1, 2, 3)).body(8, ignore_eos=True)
    assert Request(prompt=(1, 2, 3)).path == "/v1/completions"
    assert tokens["prompt"] == [1, 2, 3] and tokens["ignore_eos"] is True and "messages" not in tokens
    batch, _ = speculative.workload(argparse.Namespace(workload="edit", num_prompts=32, prompts=None))
    assert len(batch) == 32 and batch[20:] == batch[:12]  # past the set: the set again, in order


METRICS = """\
# HELP pagoda:spec_decode_num_drafts_total Speculative verifications that had drafts (--speculative-config).
# TYPE pagoda:spec_decode_num_drafts_total counter
pagoda:spec_decode_num_drafts_total{engine="0",model_name="default"} 30.0
pagoda:spec_decode_num_drafts_total{engine="1",model_name="default"} 10.0
# TYPE pagoda:spec_decode_num_draft_tokens_total counter
pagoda:spec_decode_num_draft_tokens_total{engine="0",model_name="default"} 120.0
pagoda:spec_decode_num_draft_tokens_total{engine="1",model_name="default"} 40.0
# TYPE pagoda:spec_decode_num_accepted_tokens_total counter
pagoda:spec_decode_num_accepted_tokens_total{engine="0",model_name="default"} 75.0
pagoda:spec_decode_num_accepted_tokens_total{engine="1",model_name="default"} 25.0
# TYPE pagoda:spec_decode_num_accepted_tokens_per_pos_total counter
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="default",position="0"} 28.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="default",position="1"} 22.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="default",position="0"} 10.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="default",position="3"} 10.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="default",position="2"} 15.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="default",position="1"} 8.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="default",position="2"} 5.0
pagoda:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="default",position="3"} 2.0
pagoda:num_requests_running{engine="0",model_name="default"} 0.0
"""


def test_counters_are_read_from_metrics_text_and_summed_over_engines():
    counters = speculative.spec_counters(METRICS)
    assert counters == {"drafts": 40.0, "draft_tokens": 160.0, "accepted_tokens": 100.0,
                        "accepted_per_position": [38.0, 30.0, 20.0, 12.0]}
    # a stack without speculation: no such series
    assert speculative.spec_counters('pagoda:num_requests_running{engine="0"} 0.0\n') == {
        "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}


def test_acceptance_is_what_the_counters_gained():
    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 20.0, "accepted_per_position": [8.0, 6.0, 4.0, 2.0]}
    after = speculative.spec_counters(METRICS)
    gained = speculative.spec_metrics(before, after)
    assert gained["num_drafts"] == 30 and gained["num_draft_tokens"] == 120 and gained["num_accepted_tokens"] == 80
    assert gained["acceptance_rate"] == pytest.approx(80 / 120, abs=1e-4)
    assert gained["mean_accepted_per_draft"] == pytest.approx(80 / 30, abs=1e-4)
    assert gained["accepted_per_position"] == [30, 24, 16, 10]
    assert sum(gained["accepted_per_position"]) == gained["num_accepted_tokens"]
    assert gained["acceptance_rate_per_position"] == [1.0, 0.8, pytest.approx(16 / 30, abs=1e-4),
                                                      pytest.approx(1 / 3, abs=1e-4)]
    nothing = speculative.spec_metrics(after, after)
    assert nothing["num_drafts"] == 0 and nothing["acceptance_rate"] is None
    assert nothing["mean_accepted_per_draft"] is None


def test_chunks_of_both_endpoints_are_read():
    chat, completion = Stream(), Stream()
    chat_chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    "usage": None},
                   {"choices": [{"index": 0, "delta": {"content": "def f("}, "finish_reason": None}], "usage": None},
                   {"choices": [{"index": 0, "delta": {"content": "x):"}, "finish_reason": "length"}], "usage": None},
                   {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}]
    for t, chunk in enumerate(chat_chunks):
        chat.read(chunk, 0.1 * t)
    assert chat.text == "def f(x):" and chat.output_len == 4 and chat.finish_reason == "length"
    assert chat.ttft == pytest.approx(0.1)  # the role chunk carries no text
    for t, chunk in enumerate([{"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]},
                               {"choices": [{"index": 0, "text": " there", "finish_reason": "stop"}]},
                               {"choices": [], "usage": {"completion_tokens": 2}}]):
        completion.read(chunk, 0.5 + t)
    assert completion.text == "Hello there" and completion.output_len == 2 and completion.ttft == 0.5
    failed = Stream()
    failed.status = 200
    failed.read({"error": {"message": "boom"}}, 0.0)
    assert "boom" in failed.failure


def stream(text: str, tokens: int, ttft: float, e2e: float, error: str | None = None) -> Stream:
    return Stream(status=200, texts={0: text}, usage={"completion_tokens": tokens}, times=[ttft] if ttft else [],
                  e2e=e2e, finish={0: "length"}, exception=error)


def test_run_metrics_speedup_and_output_comparison():
    baseline = [stream("abcdef", 11, 0.5, 1.5), stream("same", 21, 0.2, 2.2), stream("", 0, None, None, "HTTP 500")]
    fast = [stream("abcxef", 11, 0.5, 1.0), stream("same", 21, 0.2, 1.2), stream("ok", 3, 0.1, 0.3)]
    base = speculative.run_metrics(baseline, wall=4.0)
    assert base["completed"] == 2 and base["failed"] == 1 and base["errors"] == ["HTTP 500"]
    assert base["output_tokens"] == 32 and base["output_tokens_per_s"] == 8.0
    assert base["tpot_mean_s"] == pytest.approx((0.1 + 0.1) / 2)  # (e2e - ttft) / (tokens - 1), per request
    assert base["ttft_mean_s"] == pytest.approx(0.35) and base["finish_reasons"] == {"length": 2}
    spec = speculative.run_metrics(fast, wall=2.0)
    assert spec["output_tokens"] == 35 and spec["output_tokens_per_s"] == 17.5 and "errors" not in spec
    runs = {"baseline": base, "speculative": spec}
    assert speculative.speedup(runs) == pytest.approx(17.5 / 8.0, abs=1e-3)
    assert speculative.speedup({"baseline": {"output_tokens_per_s": 0.0}, "speculative": spec}) is None
    outputs = speculative.compare_outputs(baseline, fast)
    assert outputs["compared"] == 2 and outputs["identical"] == 1 and outputs["differ"] == 1  # the failed one skipped
    assert outputs["differences"][0]["prompt"] == 0 and outputs["differences"][0]["first_difference_at_char"] == 3
    prefix = speculative.compare_outputs([stream("abc", 3, 0.1, 0.2)], [stream("abcd", 4, 0.1, 0.2)])
    assert prefix["differences"][0]["first_difference_at_char"] == 3  # one text a prefix of the other
    result = {"workload": {"name": "edit", "num_prompts": 3}, "concurrency": 1, "runs": runs,
              "speedup": speculative.speedup(runs), "outputs": outputs}
    runs["speculative"]["spec_decode"] = speculative.spec_metrics(
        {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}, speculative.spec_counters(METRICS))
    line = speculative.summary_line(result)
    assert "speedup 2.188x" in line and "acceptance rate 0.625" in line and "identical 1/2" in line
    json.dumps(result)  # the result is JSON


def test_the_command_is_registered_and_repeatable():
    from pagoda import cli
    from pagoda.bench.common import command_words

    parser = argparse.ArgumentParser()
    cli._add_bench(parser)
    args = parser.parse_args(["speculative", "--num-prompts", "3", "--quantization", "none"])
    assert args.handler is speculative.run
    assert (args.workload, args.num_prompts, args.max_tokens, args.concurrency) == ("edit", 3, 128, 1)
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert speculative.stack_flags(args, speculative=False) == ["--model", "default", "--device", "auto",
                                                                "--quantization", "none"]
    assert speculative.stack_flags(args, speculative=True)[-2:] == ["--speculative-config", args.speculative_config]
    words = command_words("speculative", args)
    assert words.startswith("pagoda bench speculative --workload edit --num-prompts 3")
