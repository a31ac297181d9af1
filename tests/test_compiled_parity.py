"""Every family's greedy tokens and logprobs with the compiled CPU decode step (`--compile`) equal
transformers', at full precision (float32).

Opt-in: each family traces and compiles its two graphs (about 20-40 s each on 2 cores), more than
the suite's budget holds, so this runs with PAGODA_COMPILED_PARITY=1 and skips visibly otherwise:

    PAGODA_COMPILED_PARITY=1 TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_compiled_parity.py

A family the compiled step cannot take whole (the CPU MoE loop reads its routing on the host) runs
eagerly after a warning; the test asserts which ones do, so a family that starts or stops compiling
is noticed.
"""
from __future__ import annotations

import os

import pytest

from tests import families
from tests.families import FAMILIES
from tests.test_models import assert_matches, generate_json

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("PAGODA_COMPILED_PARITY") != "1",
                                 reason="opt-in: PAGODA_COMPILED_PARITY=1 (compiles every family, minutes)")]
EAGER = "--compile: the decode step runs eagerly"
RUNS_EAGERLY = {"mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"}  # MoE: routing read on the host


@pytest.fixture
def own_compiled_cache(tmp_path, monkeypatch):
    """The traced graphs in a cache of their own; the C++ kernels and Inductor's code shared."""
    from common.models import cache_root

    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("cpu_kernels", "inductor"):
        (cache_root() / shared).mkdir(parents=True, exist_ok=True)
        (cache / shared).symlink_to(cache_root() / shared, target_is_directory=True)
    monkeypatch.setenv("PAGODA_CACHE", str(cache))


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_the_compiled_step_matches_transformers(family, tmp_path, capsys, caplog, monkeypatch, own_compiled_cache):
    monkeypatch.setitem(FAMILIES, "llama", ("LlamaConfig", "LlamaForCausalLM", {}))  # the default model's family
    prompt_ids = families.prompts()
    model = families.build(family, tmp_path / family)
    reference = families.reference(model, prompt_ids)
    prompts_file = families.write_prompts(tmp_path / "prompts.jsonl", prompt_ids)
    results, _ = generate_json(capsys, tmp_path / family, prompts_file, "--compile")
    assert_matches(reference, [r["token_ids"] for r in results], [[t[0] for t in r["logprobs"]] for r in results])
    assert (EAGER in caplog.text) == (family in RUNS_EAGERLY), caplog.text[-2000:]
