"""The attention kernel's launch decisions (kernels/tuning.py): the tuned table and its lookup,
resident programs per SM and the split count, the variants start-up compiles, and the tuner's
choice. Pure functions with explicit numbers (H100 figures where a GPU's are needed), on CPU;
one test records the real launches under Triton's interpreter."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from kernels import tuning
from kernels.tuning import (
    AttentionShape, Launch, SMLimits, TileConfig, config_space, default_config, lookup_config, num_kv_splits,
    plan_launch, resident_programs_per_sm, variants_of, warmup_launches, warmup_variants,
)

H100 = SMLimits(num_sms=132, regs_per_sm=65536, shared_per_sm=228 * 1024, max_threads_per_sm=2048)
H100_NAME = "NVIDIA H100 80GB HBM3"


# ----------------------------------------------------------------------------- resident programs


@pytest.mark.parametrize("num_warps, regs, shared, expected", [
    (4, 128, 32 * 1024, 4),  # registers: 128 x 32 = 4,096 a warp, 16 warps of 64K, 4 programs
    (4, 64, 16 * 1024, 8),  # registers again: 32 warps; shared would allow 13
    (4, 32, 0, 16),  # threads: 2,048 / 128 (registers allow as many)
    (2, 32, 100 * 1024, 2),  # shared memory: 233,472 // (102,400 + 1,024 reserved)
    (8, 255, 0, 1),  # 255 x 32 rounds up to 8,192 a warp: 8 warps fill the file
    (4, 36, 0, 12),  # 36 x 32 = 1,152 rounds up to 1,280 a warp: 51 warps, 12 programs (14 unrounded)
    (1, 16, 0, 32),  # the block limit
])
def test_resident_programs_per_sm_takes_the_tightest_limit_on_an_h100(num_warps, regs, shared, expected):
    assert resident_programs_per_sm(num_warps, regs, shared, H100) == expected


def test_a_kernel_too_big_for_an_sm_still_counts_one_program():
    assert resident_programs_per_sm(4, 128, 240 * 1024, H100) == 1


@pytest.mark.parametrize("slots", [8, 132, 528, 1056])
def test_split_grid_fills_the_resident_slots_at_least_once_and_less_than_twice(slots):
    for programs in range(1, slots):
        splits = num_kv_splits(programs, 1 << 20, 64, slots)
        if splits < tuning.MAX_KV_SPLITS:
            assert slots <= programs * splits < 2 * slots, (programs, splits)
    assert num_kv_splits(slots, 1 << 20, 64, slots) == 1


# ----------------------------------------------------------------------------- config space and table


@pytest.mark.parametrize("group, head_dim", [(1, 64), (3, 64), (4, 128), (7, 80), (20, 64), (8, 256)])
@pytest.mark.parametrize("phase", tuning.PHASES)
def test_config_space_holds_the_default_and_only_runnable_tiles(group, head_dim, phase):
    space = config_space(group, head_dim, phase)
    assert default_config(group, head_dim, phase) in space
    assert len(set(space)) == len(space)
    for c in space:
        assert c.block_m >= max(16, tuning.next_power_of_2(group)) and c.block_q == c.block_m // group >= 1
        assert c.block_m & (c.block_m - 1) == 0 and c.block_n & (c.block_n - 1) == 0
    if phase == "decode":  # one token's group a tile: taller tiles would hold padding only
        assert {c.block_m for c in space} == {max(16, tuning.next_power_of_2(group))}


def test_default_config_is_the_kernels_old_heuristic():
    assert default_config(4, 128, "decode") == TileConfig(16, 4, 64, 4, 2)
    assert default_config(4, 128, "prefill") == TileConfig(64, 16, 64, 4, 2)
    assert default_config(20, 256, "decode") == TileConfig(32, 1, 32, 4, 2)
    assert tuning.phase_of(8, 8) == "decode" and tuning.phase_of(9, 8) == "prefill"


def test_lookup_uses_the_device_shape_and_phase_entry_and_falls_back_to_the_default():
    table = {
        tuning.table_key(H100_NAME, 128, 4, "decode"): {"block_m": 16, "block_n": 128, "num_warps": 8, "num_stages": 3},
        tuning.table_key(H100_NAME, 128, 4, "prefill"): {"block_m": 128, "block_n": 32, "num_warps": 8,
                                                        "num_stages": 1, "score": 1.0},
        tuning.table_key(H100_NAME, 64, 32, "decode"): {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2},
    }
    assert lookup_config(table, H100_NAME, 4, 128, "decode") == TileConfig(16, 4, 128, 8, 3)
    assert lookup_config(table, H100_NAME, 4, 128, "prefill") == TileConfig(128, 32, 32, 8, 1)
    assert lookup_config(table, "NVIDIA H200", 4, 128, "decode") == default_config(4, 128, "decode")
    assert lookup_config(table, H100_NAME, 3, 128, "decode") == default_config(3, 128, "decode")
    # a tile shorter than the group could not run: the default instead
    assert lookup_config(table, H100_NAME, 32, 64, "decode") == default_config(32, 64, "decode")


def test_the_shipped_table_parses_and_a_merge_replaces_only_its_own_keys(tmp_path):
    shipped = json.loads(tuning.TUNED_TABLE.read_text())
    assert tuning.parse_table(shipped) == tuning.load_table()
    old = {"version": 1, "entries": {"A|x": {"block_m": 16}, "B|y": {"block_m": 32}}}
    merged = tuning.merge_table(old, {"B|y": {"block_m": 64}, "C|z": {"block_m": 16}})
    assert merged == {"version": 1, "entries": {"A|x": {"block_m": 16}, "B|y": {"block_m": 64}, "C|z": {"block_m": 16}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(merged))
    assert tuning.load_table(path)["B|y"] == {"block_m": 64}
    with pytest.raises(ValueError, match="version 2"):
        tuning.parse_table({"version": 2, "entries": {}})


def test_the_tuner_picks_the_config_with_the_best_geometric_mean_and_drops_failures():
    from pagoda.bench.kernels import pick_best

    a, b, c, d = (TileConfig(16, 4, n, 4, 2) for n in (16, 32, 64, 128))
    times = {a: [1.0, 4.0], b: [2.0, 2.0], c: [1.5, 2.5], d: [0.5, None]}
    best, scores = pick_best(times, 2)
    # per-case bests 1.0 and 2.0 (d failed a case): a = (1 x 2) ** .5, b = (2 x 1) ** .5, c = (1.5 x 1.25) ** .5
    assert scores[a] == pytest.approx(2**0.5) and scores[b] == pytest.approx(2**0.5)
    assert scores[c] == pytest.approx(1.875**0.5) and d not in scores
    assert best == c
    times[b] = [1.0, 2.2]
    assert pick_best(times, 2)[0] == b
    with pytest.raises(RuntimeError, match="no tile config"):
        pick_best({d: [0.5, None]}, 2)


# ----------------------------------------------------------------------------- the variants start-up compiles


def _fake_device(table: dict):
    """A GPU whose tuned table is `table` and whose resident slots depend on the config (as
    registers and shared memory do): 132 SMs x 4 programs, x 2 for 2-warp tiles, / 2 for 8."""
    config_of = lambda phase: lookup_config(table, H100_NAME, shape.group, shape.head_dim, phase)  # noqa: E731
    slots_of = lambda c: 132 * {2: 8, 4: 4, 8: 2}[c.num_warps]  # noqa: E731
    return config_of, slots_of


shape = AttentionShape(num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype="bfloat16")
MASKED_SHAPES = [  # (shape, window): a Mistral-like windowed shape, a Gemma-2-like capped one with and without it
    (AttentionShape(8, 4, 128, 16, "bfloat16", sliding_window=True), 4096),
    (AttentionShape(8, 4, 128, 16, "bfloat16", sliding_window=True, logit_softcap=True), 100),
    (AttentionShape(8, 4, 128, 16, "bfloat16", logit_softcap=True), None),
]


@pytest.mark.parametrize("table", [
    {},
    {tuning.table_key(H100_NAME, 128, 4, "decode"): {"block_m": 16, "block_n": 32, "num_warps": 2, "num_stages": 4},
     tuning.table_key(H100_NAME, 128, 4, "prefill"): {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}},
])
@pytest.mark.parametrize("max_model_len", [256, 8192])
def test_warmup_covers_every_variant_the_launch_path_picks(table, max_model_len):
    config_of, slots_of = _fake_device(table)
    warm = warmup_variants(shape, max_model_len, config_of, slots_of)
    picked = set()
    for num_tokens, num_seqs, max_seqlen_k in tuning.launch_grid(256, 2048, max_model_len, shape.block_size):
        picked |= variants_of(shape, plan_launch(shape, num_tokens, num_seqs, max_seqlen_k, config_of, slots_of))
    assert picked <= warm, picked - warm
    # and it compiles nothing the launch path never picks
    assert warm == picked


@pytest.mark.parametrize("masked, window", MASKED_SHAPES)
@pytest.mark.parametrize("max_model_len", [256, 8192])
def test_warmup_covers_every_variant_the_launch_path_picks_under_a_window_or_a_cap(masked, window, max_model_len):
    config_of, slots_of = _fake_device({})
    warm = warmup_variants(masked, max_model_len, config_of, slots_of, sliding_window=window)
    picked = set()
    for num_tokens, num_seqs, max_seqlen_k in tuning.launch_grid(256, 2048, max_model_len, masked.block_size):
        picked |= variants_of(masked, plan_launch(masked, num_tokens, num_seqs, max_seqlen_k, config_of, slots_of,
                                                  sliding_window=window))
    assert picked == warm
    assert {key[-4:] for key in warm if key[0] == "attention"} == {(masked.sliding_window, masked.logit_softcap, "", False)}


def test_a_window_bounds_the_split_count_by_its_span():
    """A tile under a window W walks at most W + block_q + block_n - 2 keys: one decode of 8 KV
    heads on 528 slots splits 32 ways over 8,192 keys, but over a 512-key window's 578 keys
    (10 tiles of 64) only 5, and not at all under a 64-key window (130 keys, 3 tiles)."""
    config_of, slots_of = _fake_device({})
    decode = default_config(4, 128, "decode")
    assert tuning.window_keys(512, decode) == 512 + 4 + 64 - 2 and tuning.window_keys(None, decode) is None
    split = lambda window, context=8192: plan_launch(shape, 1, 1, context, config_of, slots_of,  # noqa: E731
                                                     sliding_window=window).kv_splits
    assert (split(None), split(4096), split(512), split(64)) == (32, 32, 5, 1)
    assert split(4096, context=1024) == split(None, context=1024) == 8  # a context shorter than the window
    assert warmup_launches(shape, 8192, config_of, slots_of, sliding_window=64) == [
        Launch(decode, 1), Launch(default_config(4, 128, "prefill"), 1)]


def test_warmup_launches_one_per_split_power_of_two_and_phase():
    config_of, slots_of = _fake_device({})
    launches = warmup_launches(shape, 8192, config_of, slots_of)
    decode, prefill = default_config(4, 128, "decode"), default_config(4, 128, "prefill")
    # one decode of 8 KV heads on 528 slots: 66 splits wanted, 32 at most
    assert launches == [Launch(decode, s) for s in (1, 2, 4, 8, 16, 32)] + [Launch(prefill, s) for s in (1, 2, 4, 8, 16, 32)]
    short = warmup_launches(shape, 200, config_of, slots_of)  # 13 blocks: 208 keys, 4 tiles, 2 splits at most
    assert short == [Launch(decode, 1), Launch(decode, 2), Launch(prefill, 1), Launch(prefill, 2)]
    # the attention key ends with (window?, soft-cap?, the cache's dtype if not the query's, sinks?);
    # the reduce has no masked variants
    assert variants_of(shape, Launch(decode, 5)) == {
        ("attention", "bfloat16", 4, 128, 16, 16, 4, 64, True, 4, 2, False, False, "", False),
        ("reduce", "bfloat16", 4, 128, 8)}
    assert variants_of(MASKED_SHAPES[1][0], Launch(decode, 1)) == {
        ("attention", "bfloat16", 4, 128, 16, 16, 4, 64, False, 4, 2, True, True, "", False)}


def test_kernels_warmup_compiles_nothing_off_cuda():
    import kernels

    kwargs = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                  device=torch.device("cpu"), max_model_len=512)
    assert kernels.warmup(**kwargs) == 0
    assert kernels.warmup(**kwargs, attention_variants=[(4096, 50.0), (None, 50.0), (4096, 50.0)]) == 0
    with pytest.raises(ValueError, match="names no variant"):
        kernels.warmup(**kwargs, attention_variants=[])
    with pytest.raises(ValueError, match="must be positive"):
        kernels.warmup(**kwargs, attention_variants=[(-1, None)])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="records launches of the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
def test_paged_attention_launches_the_variants_plan_launch_names(monkeypatch):
    """The enumeration above is of the launch path's own decisions: record what it launches."""
    from kernels import triton_attention as ta
    from tests.test_kernels_triton import _case, _expected_masked

    launched = set()

    def recording(kernel, name):
        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    if name == "attention":
                        launched.add((name, "float32", kw["GROUP"], kw["HEAD_DIM"], kw["BLOCK_SIZE"], kw["BLOCK_M"],
                                      kw["BLOCK_Q"], kw["BLOCK_N"], kw["SPLIT_KV"], kw["num_warps"], kw["num_stages"],
                                      kw["HAS_WINDOW"], kw["HAS_SOFTCAP"], "float8_e4m3fn" if kw["KV_FP8"] else "",
                                      kw["HAS_SINKS"]))
                    else:
                        launched.add((name, "float32", kw["GROUP"], kw["HEAD_DIM"], kw["SPLITS_P2"]))
                    return kernel[grid](*args, **kw)
                return launch
        return Recorder()

    monkeypatch.setattr(ta, "_attention_kernel", recording(ta._attention_kernel, "attention"))
    monkeypatch.setattr(ta, "_reduce_splits_kernel", recording(ta._reduce_splits_kernel, "reduce"))
    cpu = torch.device("cpu")
    for specs, window, softcap in (([(300, 1)], None, None), ([(40, 40), (3, 1)], None, None),
                                   ([(230, 1), (17, 1), (5, 1)], None, None), ([(300, 1)], 200, None),
                                   ([(300, 1)], 40, 30.0), ([(40, 40), (3, 1)], None, 30.0)):
        case = _case(specs, group=4, seed=1)
        launched.clear()
        out = ta.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q, 0.125,
                                 sliding_window=window, logit_softcap=softcap)
        torch.testing.assert_close(out, _expected_masked(case, 0.125, window, softcap), atol=2e-5, rtol=2e-5)
        s = AttentionShape(2, 4, 64, 16, "float32", window is not None, softcap is not None)
        plan = plan_launch(s, case.query.shape[0], len(specs), case.block_tables.shape[1] * 16, ta._config_of(s, cpu),
                           ta._slots_of(s, cpu), sliding_window=window)
        assert launched == variants_of(s, plan)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the GPU; TRITON_INTERPRET=1 is set")
def test_after_warmup_serving_launches_compile_nothing():
    """Llama-3.1-8B-shaped attention from views of a fused QKV projection, as the model runs it:
    decode and mixed batches of several sizes and contexts hit only variants warmup compiled,
    plain and under windows and soft-caps."""
    import kernels
    from kernels import triton_attention as ta
    from kernels import triton_cache as tc

    device, dtype, heads, kvh, hd, bs = torch.device("cuda"), torch.bfloat16, 32, 8, 128, 16
    masks = [(None, None), (1024, 50.0), (None, 50.0), (300, None)]  # every (window?, cap?) variant
    launches = kernels.warmup(num_heads=heads, num_kv_heads=kvh, head_dim=hd, block_size=bs, dtype=dtype,
                              device=device, max_model_len=4096, attention_variants=masks)
    assert launches > 8

    def compiled() -> int:
        fns = (ta._attention_kernel, ta._reduce_splits_kernel, tc._write_kv_kernel, tc._copy_blocks_kernel)
        return sum(len(caches[0]) for fn in fns for caches in fn.device_caches.values())

    before = compiled()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for num_seqs, q_len, context in [(1, 1, 16), (7, 1, 1000), (64, 1, 4096), (3, 40, 700), (1, 2048, 2048)]:
        num_blocks = num_seqs * -(-context // bs) + 1
        cache = torch.zeros((num_blocks, 2, bs, kvh, hd), dtype=dtype, device=device)
        tables = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).view(num_seqs, -1).int()
        qkv = torch.randn((num_seqs * q_len, (heads + 2 * kvh) * hd), dtype=dtype, device=device, generator=gen)
        q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)
        slots = torch.arange(num_seqs * q_len, device=device) % (num_blocks * bs)
        kernels.write_kv(k.view(-1, kvh, hd), v.view(-1, kvh, hd), cache, slots)
        for window, softcap in masks:
            kernels.paged_attention(q.view(-1, heads, hd), cache, tables,
                                    torch.full((num_seqs,), context, dtype=torch.int32, device=device),
                                    torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len, hd**-0.5,
                                    sliding_window=window, logit_softcap=softcap)
        kernels.copy_blocks([cache], [(1, 2)])
    torch.cuda.synchronize()
    assert compiled() == before


# ----------------------------------------------------------------------------- warmup compiles the serving binaries


def _warmup_specializations_match_serving() -> int:
    """For a model-shaped attention (32 query heads, 8 KV heads, head dim 128, bfloat16 stand-ins
    on CPU), record the kernel launches of serving-like calls (query and K/V as views of a fused
    QKV projection, assorted batch sizes and block-table widths, plain and under each (window,
    soft-cap) of a Gemma-2-like model) and of `warmup`, and check that
    each serving launch has a warmup launch of the same variant whose arguments Triton would
    specialize identically for sm_90 (its binder, no GPU needed): then warmup compiled the very
    binary serving runs. Run with TRITON_INTERPRET unset. Returns the serving launches checked."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from kernels import triton_attention as ta
    from kernels import triton_cache as tc

    backend = make_backend(GPUTarget("cuda", 90, 32))
    kernels_ = {"attention": (ta, "_attention_kernel"), "reduce": (ta, "_reduce_splits_kernel"),
                "write_kv": (tc, "_write_kv_kernel")}
    real = {name: getattr(module, attr) for name, (module, attr) in kernels_.items()}
    binders = {name: create_function_from_signature(fn.signature, fn.params, backend) for name, fn in real.items()}
    calls: list[tuple[str, tuple, dict]] = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.name, args, kwargs))

        def warmup(self, *args, grid, **kwargs):  # _compile_split_variant's compile, for its n_regs
            calls.append((self.name, args, kwargs))
            return SimpleNamespace(n_regs=64, metadata=SimpleNamespace(shared=0), _init_handles=lambda: None)

    def variant(name, args, kwargs):
        _, spec, _ = binders[name](*args, **kwargs)
        constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("num_warps", "num_stages")))
        return (name, constexprs, kwargs.get("num_warps"), kwargs.get("num_stages")), spec

    for name, (module, attr) in kernels_.items():
        setattr(module, attr, Recorder(name))
    slots_of = ta._slots_of
    ta._slots_of = lambda shape, device: (lambda config: 132 * 4)  # an H100's slots: small batches split
    try:
        cpu, dtype, heads, kvh, hd, bs = torch.device("cpu"), torch.bfloat16, 32, 8, 128, 16
        masks = [(None, None), (1024, 50.0), (None, 50.0), (300, None)]  # (window, soft-cap) of the layers
        shapes = {mask: AttentionShape(kvh, heads // kvh, hd, bs, "bfloat16", mask[0] is not None, mask[1] is not None)
                  for mask in masks}
        for (window, _), shape in shapes.items():
            ta.warmup(shape, 4096, cpu, sliding_window=window)
        tc.write_kv(*(torch.zeros((1, kvh, hd), dtype=dtype),) * 2, torch.zeros((2, 2, bs, kvh, hd), dtype=dtype),
                    torch.full((1,), -1))
        warm = dict(variant(*call) for call in calls)
        calls.clear()
        for phase, shape in itertools.product(tuning.PHASES, shapes.values()):  # counts registers for the splits
            ta._compile_split_variant(shape, default_config(shape.group, hd, phase), cpu)
        for key, spec in (variant(*call) for call in calls):
            assert warm[key] == spec, f"_compile_split_variant compiles another {key}"
        calls.clear()
        for num_seqs, q_len, width in [(1, 1, 1), (7, 1, 63), (64, 1, 256), (3, 40, 44), (1, 2048, 128), (2, 5, 16)]:
            num_tokens = num_seqs * q_len
            qkv = torch.zeros((num_tokens, (heads + 2 * kvh) * hd), dtype=dtype)
            q, k, v = (t.view(num_tokens, -1, hd) for t in qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1))
            cache = torch.zeros((num_seqs * width + 1, 2, bs, kvh, hd), dtype=dtype)
            tc.write_kv(k, v, cache, torch.arange(num_tokens))
            for window, softcap in masks:
                ta.paged_attention(q, cache, torch.ones((num_seqs, width), dtype=torch.int32),
                                   torch.full((num_seqs,), width * bs, dtype=torch.int32),
                                   torch.arange(num_seqs + 1, dtype=torch.int32) * q_len, hd**-0.5,
                                   sliding_window=window, logit_softcap=softcap)
        served = [variant(*call) for call in calls]
    finally:
        for name, (module, attr) in kernels_.items():
            setattr(module, attr, real[name])
        ta._slots_of = slots_of
    assert {key[0] for key, _ in served} == {"attention", "reduce", "write_kv"}
    for key, spec in served:
        assert key in warm, f"warmup never launched {key}"
        assert spec == warm[key], f"{key[0]} specializes differently:\n{spec}\n{warm[key]}"
    return len(served)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_warmup_launches_specialize_like_serving_launches_for_sm90():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.test_kernels_tuning import _warmup_specializations_match_serving as f; print(f())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 30


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="runs the tuner's launches in Triton's interpreter (TRITON_INTERPRET=1)")
def test_the_tuner_times_each_config_through_the_kernel_and_merges_the_best_into_the_table(tmp_path, monkeypatch):
    """`pagoda bench kernels --tune` end to end on CPU, with do_bench replaced by a clock that
    runs the call once and says the 32-key tile is fastest (and 2 stages faster than 1)."""
    import argparse

    import triton.testing

    from pagoda.bench import kernels as bench

    space = {phase: [tuning.make_config(tuning.min_block_m(3, phase), n, 4, s, 3) for n, s in ((16, 2), (32, 1), (32, 2))]
             for phase in tuning.PHASES}
    monkeypatch.setattr(tuning, "config_space", lambda group, head_dim, phase: space[phase])
    timed = []

    def fake_do_bench(call, warmup, rep, return_mode):
        call()
        config = call.__defaults__[2]
        timed.append(config)
        return {16: 2.0, 32: 1.0, 64: 3.0}[config.block_n] + (0.5 if config.num_stages == 1 else 0.0)

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    table = tmp_path / "attention.json"
    table.write_text(json.dumps({"version": 1, "entries": {"other GPU|head_dim=64|group=3|decode": {"block_m": 16}}}))
    args = argparse.Namespace(models="smollm2-135m", batch_sizes="1,2", context_lens="40", block_size=16,
                              dtype="float32", tune_output=str(table), output=None, tune=True)
    assert bench.tune(args, torch.device("cpu"), torch.float32) == 0
    entries = json.loads(table.read_text())["entries"]
    assert sorted(entries) == ["interpreter|head_dim=64|group=3|decode", "interpreter|head_dim=64|group=3|prefill",
                               "other GPU|head_dim=64|group=3|decode"]
    decode = entries["interpreter|head_dim=64|group=3|decode"]
    assert {k: decode[k] for k in ("block_m", "block_n", "num_warps", "num_stages")} == {
        "block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
    assert decode["score"] == 1.0 and decode["default_score"] == pytest.approx(3.0)
    assert decode["cases"] == [[1, 40], [2, 40]]
    # the default config (64-key tiles) is timed too, beside the space: 4 configs x 2 cases x 2 phases
    assert len(timed) == 16 and tuning.default_config(3, 64, "decode") in timed
    assert tuning.lookup_config(tuning.parse_table(json.loads(table.read_text())), "interpreter", 3, 64,
                                "prefill") == space["prefill"][2]


def test_a_frozen_workspace_serves_smaller_launches_and_refuses_to_grow():
    """Captured CUDA graphs hold the split-KV workspace's address: once frozen it never moves."""
    from kernels import triton_common

    device = torch.device("cpu")
    key = triton_common.device_key(device)
    saved = triton_common._workspaces.pop(key, None)
    try:
        first = triton_common.workspace(device, 64, reserve=100)
        triton_common.freeze_workspace(device)
        assert triton_common.workspace(device, 100).data_ptr() == first.data_ptr()
        with pytest.raises(RuntimeError, match="kernels.warmup must reserve the largest launch"):
            triton_common.workspace(device, 101)
        assert triton_common._workspaces[key].numel() == 100
    finally:
        triton_common._frozen.discard(key)
        triton_common._workspaces.pop(key, None)
        if saved is not None:
            triton_common._workspaces[key] = saved


def test_a_later_engines_warmup_grows_a_frozen_workspace_and_keeps_the_old_one_alive():
    """Two engines in one process (two LLMs, a benchmark's runs): the first one's graphs froze the
    workspace; the second one's start-up needs more. It gets a new buffer; the old one stays
    allocated, since the first engine's graphs still write into it."""
    from kernels import triton_common

    device = torch.device("cpu")
    key = triton_common.device_key(device)
    saved = triton_common._workspaces.pop(key, None)
    try:
        first = triton_common.workspace(device, 64)
        triton_common.freeze_workspace(device)
        triton_common.reserve_workspace(device, 50)  # fits: the frozen buffer serves it
        assert triton_common._workspaces[key] is first._base and key in triton_common._frozen
        triton_common.reserve_workspace(device, 80)
        grown = triton_common._workspaces[key]
        assert grown.numel() == 80 and key not in triton_common._frozen
        assert triton_common._retired[-1] is first._base
        assert triton_common.workspace(device, 80).data_ptr() == grown.data_ptr()
    finally:
        triton_common._frozen.discard(key)
        triton_common._workspaces.pop(key, None)
        if triton_common._retired and triton_common._retired[-1] is first._base:
            triton_common._retired.pop()
        if saved is not None:
            triton_common._workspaces[key] = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_and_cuda_0_are_one_device_key():
    from kernels import triton_common

    assert triton_common.device_key(torch.device("cuda")) == triton_common.device_key(
        torch.device("cuda", torch.cuda.current_device()))
