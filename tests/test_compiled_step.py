"""The compiled CPU decode step (`--compile`, worker/compiled_step.py).

A tiny Llama under int4 in bfloat16 (the default model's path: the packed GEMMs inside the graph)
serves requests that join and leave a running batch over hundreds of decode steps: its greedy
tokens equal the eager step's, warm-up compiles two graphs (batch 1, and one dynamic in the batch
for every other bucket), and nothing compiles after it; a recompile forced after it is counted
for /metrics. A restart loads the saved graphs and compiles nothing.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.protocol import SamplingParams
from pagoda.offline import LLM

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _workload(seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """64 prompts of 3-40 tokens, each generating 24-90 (EOS ignored): at most 6 run at once, so the
    decode batch grows and shrinks as requests finish and the next are admitted."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randrange(3, 41))]} for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(24, 91), ignore_eos=True) for _ in prompts]
    return prompts, params


def _tiny_llm(directory, compile: bool) -> LLM:
    return LLM(str(directory), skip_tokenizer_init=True, device="cpu", dtype="bfloat16", quantization="int4",
               max_num_seqs=6, compile=compile)


def test_the_compiled_step_gives_the_eager_tokens_and_never_recompiles(tiny, tmp_path, monkeypatch):
    from common.models import cache_root

    for shared in ("cpu_kernels", "inductor"):  # built by earlier tests; the traced graphs are not
        (cache_root() / shared).mkdir(parents=True, exist_ok=True)
        (tmp_path / shared).symlink_to(cache_root() / shared, target_is_directory=True)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    from kernels import cpu_ops

    directory, _ = tiny
    prompts, params = _workload()
    outputs = {}
    for compile in (False, True):
        llm = _tiny_llm(directory, compile)
        try:
            runner = llm.executor.runner.decode_runner
            calls = []
            forward = runner._forward
            runner._forward = lambda size: calls.append(size) or forward(size)
            before = torch.ops.pagoda_cpu.layer_attention_counts() if cpu_ops.available() else None
            results = llm.generate(prompts, params, use_tqdm=False)
            outputs[compile] = [r.outputs[0].token_ids for r in results]
            served, handed_back = (a - b for a, b in zip(torch.ops.pagoda_cpu.layer_attention_counts(), before))
            compiled = runner.compiled
            if compile:
                counted = [llm.engine.scheduler.make_stats()["compiled_step_recompiles_total"]]
                counted += _count_a_forced_recompile(llm)
        finally:
            llm.close()
    assert len(calls) >= 500 and set(calls) == {1, 2, 4, 6}  # decode steps, by bucket
    # the graphs' attention in C++ once per layer and step (the tiny Llama's two), never in Python
    assert served >= 500 * 2 and handed_back == 0
    assert compiled is not None and (compiled.compiles, compiled.recompiles) == (3, 1)  # one forced after
    assert counted == [0, 1]  # /metrics' pagoda:compiled_step_recompiles_total, before and after it
    assert [len(o) for o in outputs[True]] == [p.max_tokens for p in params]
    assert outputs[True] == outputs[False]
    assert [p.name for p in (tmp_path / "compiled_step").iterdir()] == [compiled.path.name]
    # in new processes: the first traces and saves both graphs, the second loads them and compiles nothing
    first, second = (_run_alone(directory, prompts[:8], params[:8]) for _ in range(2))
    assert first == {"compiles": 2, "loaded": 0, "tokens": outputs[False][:8]}
    assert second == {"compiles": 0, "loaded": 2, "tokens": outputs[False][:8]}
    assert len(list((tmp_path / "compiled_step").iterdir())) == 2


_ALONE = """
import json, sys
from common.protocol import SamplingParams
from tests.test_compiled_step import _tiny_llm
directory, prompts, max_tokens = json.loads(sys.argv[1])
llm = _tiny_llm(directory, True)
compiled = llm.executor.runner.decode_runner.compiled
loaded = len(compiled._graphs) if compiled.compiles == 0 else 0
results = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                       use_tqdm=False)
print(json.dumps({"compiles": compiled.compiles, "loaded": loaded, "tokens": [r.outputs[0].token_ids for r in results]}))
"""


def _run_alone(directory, prompts, params) -> dict:
    """The model compiled in a process of its own, as `pagoda up` starts it: its layers' ids (which
    name each layer to a graph's attention op) are those of every restart, not this process's."""
    import json
    import subprocess
    import sys

    args = json.dumps([str(directory), prompts, [p.max_tokens for p in params]])
    done = subprocess.run([sys.executable, "-c", _ALONE, args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_saved_graphs_are_named_by_the_model_they_were_traced_from(tiny):
    """Another layer id in the attention op, another shape or dtype, another tensor-parallel size,
    the C++ operators loaded or not: another file; another port of the tensor-parallel group's
    store: the same one."""
    from kernels import cpu_ops
    from worker.compiled_step import artifact_key

    directory, _ = tiny
    llm = _tiny_llm(directory, False)
    try:
        model = llm.executor.runner.model
        key = artifact_key(model)
        assert artifact_key(model) == key
        attention = next(m for m in model.modules() if type(m).__name__ == "Attention")
        attention.layer_id += 1000
        assert artifact_key(model) != key
        attention.layer_id -= 1000
        norm = next(m for m in model.modules() if hasattr(m, "weight") and m.weight.ndim == 1)
        weight = norm.weight
        norm.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
        assert artifact_key(model) != key
        norm.weight = weight
        assert artifact_key(model) == key
        group = next(m.tp for m in model.modules() if getattr(m, "tp", None) is not None)
        group.port += 1  # where this process's group listens: picked at each start
        assert artifact_key(model) == key
        group.world_size += 1
        assert artifact_key(model) != key
        group.world_size -= 1
        assert artifact_key(model) == key
        with pytest.MonkeyPatch.context() as patch:  # a graph traced with the C++ operators calls them
            patch.setattr(cpu_ops, "_available", False)
            assert artifact_key(model) != key
    finally:
        llm.close()


def _count_a_forced_recompile(llm: LLM) -> list[int]:
    """The compiled graphs dropped (as a failed guard would): the next decode step compiles again, and
    the scheduler counts it from that step's result."""
    llm.executor.runner.decode_runner.compiled._graphs.clear()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    return [llm.engine.scheduler.make_stats()["compiled_step_recompiles_total"]]


def test_a_model_that_does_not_compile_runs_eagerly_after_a_warning(tmp_path, caplog):
    """The CPU MoE loop reads its routing on the host, which torch.compile cannot take in one graph."""
    import json
    import logging

    config = json.loads((ROOT / "tests" / "data" / "tiny-llama.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                  num_experts_per_tok=2)
    (tmp_path / "mixtral.json").write_text(json.dumps(config))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = []
    for compile in (False, True):
        with caplog.at_level(logging.WARNING, logger="worker.cuda_graph"):
            llm = LLM(f"dummy:{tmp_path / 'mixtral.json'}", skip_tokenizer_init=True, device="cpu", max_num_seqs=4,
                      compile=compile, seed=0)
        try:
            tokens.append(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
            assert llm.executor.runner.decode_runner.compiled is None
        finally:
            llm.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5
    assert [r.message.split(":")[0] for r in caplog.records] == ["--compile"]
    assert "this model did not compile" in caplog.records[0].message


class _Toy(__import__("torch").nn.Module):
    """A model as the compiled step calls it, `model(input_ids, positions)`, with no attention."""

    def __init__(self) -> None:
        import torch

        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids, positions):
        return self.embed(input_ids) * (positions[:, None] + 1)


def test_a_torn_saved_file_is_replaced_and_its_graphs_compiled_again(tmp_path, monkeypatch, caplog):
    import logging

    import torch

    import worker.compiled_step
    from worker.compiled_step import CompiledModel

    monkeypatch.setattr(worker.compiled_step, "cache_root", lambda: tmp_path)
    toy = _Toy().eval()
    ids, positions = torch.arange(4), torch.arange(4)
    want = toy(ids, positions)

    def run(compiled):
        with torch.inference_mode():
            compiled.warm_up(lambda size: compiled(ids[:size], positions[:size]), [1, 2, 4])
            return compiled(ids, positions)

    first = CompiledModel(toy)
    first.path.parent.mkdir(parents=True)
    first.path.write_bytes(b"\x92\x01")  # a file cut short
    with caplog.at_level(logging.WARNING, logger="worker.compiled_step"):
        assert torch.equal(run(first), want)
    assert "could not use the compiled CPU decode step saved in" in caplog.text
    assert (first.compiles, first.recompiles) == (2, 0)

    again = CompiledModel(toy)  # the file the first wrote: both graphs load
    assert again.path == first.path
    assert torch.equal(run(again), want)
    assert (again.compiles, sorted(again._graphs)) == (0, [False, True])


def test_the_graphs_attention_runs_in_cpp_and_hands_a_step_it_does_not_take_to_python():
    """`pagoda_cpu::layer_attention` (the op a compiled graph calls) writes K and V into the layer's
    registered cache and attends, as the layer's own `attend` does; a step whose metadata says it is
    not simple (KV cache groups, image spans) and a layer with no cache registered go to the Python
    operator, with the same result."""
    from kernels import cpu_ops
    from worker.context import AttentionContext, attention_context
    from worker.models.layers import Attention

    assert cpu_ops.available()
    torch.manual_seed(0)
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    q, k, v = (torch.randn(3, n, 16, dtype=torch.bfloat16) for n in (4, 2, 2))
    ctx = AttentionContext(slot_mapping=torch.tensor([5, 17, 18]),
                           block_tables=torch.tensor([[0, 0], [1, 2]], dtype=torch.int32),
                           seq_lens=torch.tensor([6, 19], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))
    first = torch.randn(4, 2, 16, 2, 16, dtype=torch.bfloat16)  # [num_blocks, 2, block_size, kv heads, head dim]

    def run(how: str):
        attn.kv_cache = first.clone()
        if how == "unregistered":
            cpu_ops.unregister_layer(attn.layer_id)
        with attention_context(ctx):
            if how == "eager":
                return attn.attend(q, k, v), attn.kv_cache
            cpu_ops.set_step(cpu_ops.step_metadata(ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
                                                   ctx.kernel_cache), simple=how != "not simple")
            try:
                return torch.ops.pagoda_cpu.layer_attention(q, k, v, attn.layer_id), attn.kv_cache
            finally:
                cpu_ops.clear_step()

    want, cache = run("eager")
    for how, counted in (("simple", [1, 0]), ("not simple", [0, 1]), ("unregistered", [0, 1])):
        before = torch.ops.pagoda_cpu.layer_attention_counts()
        out, written = run(how)
        assert torch.equal(out, want) and torch.equal(written, cache), how
        assert [a - b for a, b in zip(torch.ops.pagoda_cpu.layer_attention_counts(), before)] == counted, how
    attn.kv_cache = None  # unregisters: the C++ side holds no reference to the cache


@pytest.mark.parametrize("compile, env, device, ranks, lora, compiled, warned", [
    (None, None, "cpu", 1, None, True, False),  # the default: on for one CPU rank
    (None, "0", "cpu", 1, None, False, False),  # PAGODA_COMPILE=0 (this suite's default)
    (False, None, "cpu", 1, None, False, False),  # --no-compile
    (True, "0", "cpu", 1, None, True, False),  # --compile, whatever the environment
    (None, None, "cuda", 1, None, False, False),  # CUDA graphs instead, quietly
    (True, None, "cuda", 1, None, False, True),  # asked for: says why not
    (None, None, "cpu", 2, None, False, False),  # tensor parallelism
    (True, None, "cpu", 1, object(), False, True),  # LoRA
])
def test_the_decode_step_compiles_by_default_on_one_cpu_rank(compile, env, device, ranks, lora, compiled, warned,
                                                               monkeypatch, caplog):
    from types import SimpleNamespace

    from common.config import EngineConfig
    from worker.model_runner import ModelRunner

    if env is None:
        monkeypatch.delenv("PAGODA_COMPILE", raising=False)
    else:
        monkeypatch.setenv("PAGODA_COMPILE", env)
    runner = SimpleNamespace(config=EngineConfig(compile=compile), device=torch.device(device), world_size=ranks,
                             lora=lora)
    with caplog.at_level("WARNING", logger="worker.model_runner"):
        assert ModelRunner._compilable(runner) is compiled
    assert ("--compile: the decode step runs eagerly" in caplog.text) is warned


@pytest.mark.parametrize("explicit", [True, False])
def test_a_model_that_does_not_compile_runs_eagerly_warning_only_where_compile_was_asked(explicit, caplog):
    """The CPU MoE loop cannot be traced whole: under `--compile` a warning says so; under the
    default a line at info (no warning on every start of such a model)."""
    from types import SimpleNamespace

    from worker.cuda_graph import DecodeRunner

    def forward(size):
        raise RuntimeError("data-dependent routing read on the host")

    runner = SimpleNamespace(model=torch.nn.Linear(4, 4), buckets=[1, 2], _forward=forward, compiled=None)
    with caplog.at_level("INFO", logger="worker.cuda_graph"):
        DecodeRunner.compile(runner, explicit=explicit)
    assert runner.compiled is None
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in warnings] == (
        ["--compile: the decode step runs eagerly, this model did not compile: data-dependent routing read on "
         "the host"] if explicit else [])
    assert "runs eagerly" in caplog.text
