"""The Triton kernels against their pure-PyTorch references.

Where they run: with TRITON_INTERPRET=1 in the environment (`make test` sets it before triton is
imported) on CPU tensors through Triton's interpreter, float32 and float16 (the interpreter has no
bfloat16); without it they are `gpu` tests that run the compiled kernels on CUDA (`make
test-gpu`), bfloat16 included, and are reported as skipped on a machine with neither.

The cases are the reference tests' own (`tests/test_kernels_reference._build`): shuffled,
non-contiguous block tables, partial last blocks, padding rows, a NaN-poisoned cache. Every
output is NaN-poisoned before a run too, so an element the kernel never writes fails.
"""
from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import reference
from kernels.tuning import TileConfig, make_config
from tests.test_kernels_reference import PAD_VALUE, Case, Seq, _build, _mixed_specs
from tests.triton_env import DEVICE, DTYPES, INTERPRET, TRITON_MARKS, count_compiled_for_sm90, tolerance

pytestmark = TRITON_MARKS


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny tensors: intra-op threads only add overhead."""


def _case(specs, *, group: int, head_dim: int = 64, block_size: int = 16, dtype=torch.float32, seed: int = 0,
          spare_blocks: int = 3) -> Case:
    """A reference-built case (built on CPU, in float32 for bfloat16) moved to DEVICE."""
    case = _build(specs, group=group, head_dim=head_dim, block_size=block_size,
                  dtype=torch.float32 if dtype == torch.bfloat16 else dtype, seed=seed, spare_blocks=spare_blocks)
    move = lambda t: t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE)  # noqa: E731
    return Case(case.seqs, move(case.kv_cache), move(case.block_tables), move(case.seq_lens),
                move(case.cu_seqlens_q), move(case.query), move(case.expected_cache), block_size)


def _attend(case: Case, scale: float, **kwargs) -> torch.Tensor:
    """The Triton kernel into a NaN-poisoned output; every row must come back finite."""
    out = torch.full_like(case.query, float("nan"))
    result = kernels.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens,
                                     case.cu_seqlens_q, scale, out=out, impl="triton", **kwargs)
    assert result is out
    assert not torch.isnan(out).any(), "an output element was never written, or a NaN slot was read"
    return out


def _expected(case: Case, scale: float) -> torch.Tensor:
    """The reference over the same cache, upcast to float32 so that only the kernel rounds."""
    return reference.paged_attention(case.query.float(), case.kv_cache.float(), case.block_tables,
                                     case.seq_lens, case.cu_seqlens_q, scale)


def _check(case: Case, scale: float, dtype: torch.dtype, **kwargs) -> None:
    cache_before = case.kv_cache.clone()
    out = _attend(case, scale, **kwargs)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.float(), _expected(case, scale), **tolerance(dtype))
    torch.testing.assert_close(case.kv_cache, cache_before, rtol=0, atol=0, equal_nan=True)  # attention only reads


# ----------------------------------------------------------------------------- write_kv


def _tokens_with_padding(seqs: list[Seq], block_size: int, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token of every sequence, a padding row (slot -1) after every third; K and V as strided
    views of one fused [num_tokens, 2 * kvh, head_dim] tensor, as a QKV projection produces them."""
    rows, slots = [], []
    for s in seqs:
        for p, slot in enumerate(s.slots(block_size, range(s.seq_len))):
            rows.append(torch.cat([s.k[p], s.v[p]]))
            slots.append(slot)
            if p % 3 == 2:
                rows.append(torch.cat([torch.full_like(s.k[p], PAD_VALUE), torch.full_like(s.v[p], -PAD_VALUE)]))
                slots.append(-1)
    fused = torch.stack(rows).to(DEVICE, dtype)
    kvh = seqs[0].k.shape[1]
    return fused[:, :kvh], fused[:, kvh:], torch.tensor(slots, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_writes_owned_slots_skips_padding_and_matches_reference(dtype, block_size):
    case = _case(_mixed_specs(block_size), group=1, block_size=block_size, dtype=dtype, seed=11)
    key, value, slots = _tokens_with_padding(case.seqs, block_size, dtype)
    assert not key.is_contiguous()
    cache = torch.full_like(case.kv_cache, float("nan"))
    kernels.write_kv(key, value, cache, slots, impl="triton")
    expected = torch.full_like(cache, float("nan"))
    reference.write_kv(key, value, expected, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache, case.expected_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(cache[0]).all(), "the null block must never be written"


def test_write_kv_converts_to_the_cache_dtype_and_all_padding_is_a_no_op():
    cache = torch.full((4, 2, 16, 2, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    key, value = torch.randn(3, 2, 64, device=DEVICE), torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([16 * 3 + 15, -1, 16 * 2], dtype=torch.int64, device=DEVICE)
    kernels.write_kv(key, value, cache, slots, impl="triton")
    assert torch.equal(cache[3, 0, 15], key[0].half()) and torch.equal(cache[3, 1, 15], value[0].half())
    assert torch.equal(cache[2, 0, 0], key[2].half()) and torch.equal(cache[2, 1, 0], value[2].half())
    assert int(torch.isnan(cache).sum()) == cache.numel() - 4 * 2 * 64
    before = cache.clone()
    kernels.write_kv(key, value, cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE), impl="triton")
    torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- paged_attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
def test_paged_attention_mixed_batch_matches_reference(group, head_dim, block_size, dtype):
    """Prefills, decodes and queries after a cached prefix in one launch, GQA packed per KV head."""
    case = _case(_mixed_specs(block_size), group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                 seed=group * 1000 + head_dim + block_size)
    _check(case, 1.0 / math.sqrt(head_dim), dtype)


HOMOGENEOUS_BATCHES = [
    pytest.param([(40, 1), (3, 1), (17, 1), (16, 1), (33, 1)], id="decodes-only"),
    pytest.param([(40, 40), (3, 3), (17, 17)], id="prefills-only"),
    pytest.param([(50, 7), (33, 32), (17, 2)], id="cached-prefix-only"),
    pytest.param([(16 * 6 + 3, 16 * 6 + 3)], id="long-prefill"),
]


@pytest.mark.parametrize("specs", [pytest.param([(1, 1)], id="one-token-decode"), *HOMOGENEOUS_BATCHES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_homogeneous_batches_match_reference(specs, dtype):
    _check(_case(specs, group=4, dtype=dtype, seed=len(specs)), 0.125, dtype)


@pytest.mark.parametrize("group, head_dim", [(5, 80), (20, 64), (1, 8)])
def test_head_dims_off_powers_of_two_and_groups_past_sixteen(group, head_dim):
    """Padded head dims are masked (a head dim under 16 is padded to tl.dot's least K: on a GPU
    its compiler refuses less); a group wider than a 16-row tile gets a taller tile."""
    specs = [(2 * 16 + 5, 2 * 16 + 5), (1, 1), (40, 3), (17, 1)]
    _check(_case(specs, group=group, head_dim=head_dim, seed=group), head_dim**-0.5, torch.float32)
    _check(_case([(40, 1), (9, 1)], group=group, head_dim=head_dim, seed=group), head_dim**-0.5, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "specs, group",
    [
        pytest.param([(300, 1)], 4, id="one-long-decode"),
        pytest.param([(230, 1), (17, 1)], 7, id="two-decodes"),
    ],
)
def test_split_kv_decode_chosen_by_the_heuristic_matches_reference(specs, group, dtype):
    """Few programs against the SM count (8 under the interpreter): the keys are split and reduced."""
    from kernels.triton_attention import launch_plan

    case = _case(specs, group=group, dtype=dtype, seed=3)
    _, kv_splits = launch_plan(len(specs), len(specs), 2, group, 64, case.block_tables.shape[1] * 16, case.query.device)
    assert kv_splits > 1
    _check(case, 0.125, dtype)


@pytest.mark.parametrize("kv_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forced_kv_splits_on_a_mixed_batch_match_reference(kv_splits, dtype):
    """Splits of a prefill tile that end before a row's first key, and more splits than tiles."""
    specs = [(150, 20), (3, 1), (130, 1), (40, 40)]
    _check(_case(specs, group=3, dtype=dtype, seed=kv_splits), 0.125, dtype, kv_splits=kv_splits)


def test_a_batch_of_more_sequences_than_one_search_chunk_finds_every_sequence():
    """Programs find their sequence 128 cu_seqlens_q entries at a time: 131 sequences take two chunks."""
    specs = [(1 + i % 5, 1) for i in range(130)] + [(20, 20)]
    _check(_case(specs, group=1, seed=5), 0.125, torch.float32)


def test_num_kv_splits_fills_resident_slots_and_keeps_splits_long():
    from kernels.triton_attention import MAX_KV_SPLITS, num_kv_splits

    # Llama-3.1-8B decode, (sequences x 8 KV heads) programs, 64-key tiles, on 132 SMs holding
    # 4 programs each: 528 resident slots.
    slots = 132 * 4
    assert num_kv_splits(128 * 8, 2048, 64, slots) == 1  # enough programs already
    assert num_kv_splits(64 * 8, 2048, 64, slots) == 2  # 512 programs: 1,024 fill the 528 slots once, not twice
    assert num_kv_splits(16 * 8, 2048, 64, slots) == 5  # 640 programs
    assert num_kv_splits(1 * 8, 8192, 64, slots) == MAX_KV_SPLITS
    assert num_kv_splits(1 * 8, 512, 64, slots) == 4  # no split under 2 tiles
    assert num_kv_splits(1 * 8, 64, 64, slots) == 1


def test_paged_attention_uses_the_scale_and_ignores_placement():
    specs = [(37, 1), (29, 29), (45, 6)]
    a = _case(specs, group=3, seed=1)
    for scale in (0.01, 0.3):
        torch.testing.assert_close(_attend(a, scale), _expected(a, scale), atol=2e-5, rtol=2e-5)
    b = _case(specs, group=3, seed=1, spare_blocks=9)
    assert [s.blocks for s in a.seqs] != [s.blocks for s in b.seqs]
    torch.testing.assert_close(_attend(a, 0.125), _attend(b, 0.125), atol=0, rtol=0)


def _written_step_by_step(seed: int, group: int, n_prompt: int, total: int, blocks: list[int]):
    """Prefill, then decode token by token as the worker does, write_kv in Triton into a cache of
    NaN: yields each step's Case once its K and V are written (block size 16, 2 KV heads of 64)."""
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, hd = 16, 2, 64
    k, v = torch.randn(total, kvh, hd, generator=gen), torch.randn(total, kvh, hd, generator=gen)
    q = torch.randn(total, kvh * group, hd, generator=gen)
    cache = torch.full((8, 2, bs, kvh, hd), float("nan"), device=DEVICE)
    table = torch.tensor([blocks + [0]], dtype=torch.int32, device=DEVICE)
    for lo, hi in [(0, n_prompt)] + [(p, p + 1) for p in range(n_prompt, total)]:
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(lo, hi)], device=DEVICE)
        kernels.write_kv(k[lo:hi].to(DEVICE), v[lo:hi].to(DEVICE), cache, slots, impl="triton")
        yield Case([], cache, table, torch.tensor([hi], dtype=torch.int32, device=DEVICE),
                   torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE), q[lo:hi].to(DEVICE), cache, bs)


def test_write_then_attend_step_by_step_with_triton_only():
    """Prefill, then decode token by token as the worker does, both kernels in Triton."""
    for case in _written_step_by_step(0, group=4, n_prompt=13, total=21, blocks=[5, 2]):
        torch.testing.assert_close(_attend(case, 0.125), _expected(case, 0.125), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- sliding window and soft-cap


def _expected_masked(case: Case, scale: float, window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The plain loop of the masked reference over the same cache, upcast to float32."""
    return reference.paged_attention_masked(case.query.float(), case.kv_cache.float(), case.block_tables,
                                            case.seq_lens, case.cu_seqlens_q, scale, sliding_window=window,
                                            logit_softcap=softcap, sinks=sinks)


def _attend_masked(case: Case, scale: float, window: int | None, softcap: float | None, *, config=None,
                   kv_splits: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (a forced tile config when given) into a NaN-poisoned output, every row finite."""
    from kernels import triton_attention

    out = torch.full_like(case.query, float("nan"))
    triton_attention.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q,
                                     scale, out=out, config=config, kv_splits=kv_splits, sliding_window=window,
                                     logit_softcap=softcap, sinks=sinks)
    assert not torch.isnan(out).any(), "an output element was never written, or a NaN slot was read"
    return out


def _check_masked(case: Case, scale: float, dtype: torch.dtype, window: int | None, softcap: float | None,
                  **kwargs) -> torch.Tensor:
    cache_before = case.kv_cache.clone()
    out = _attend_masked(case, scale, window, softcap, **kwargs)
    assert out.dtype == dtype and out.shape == case.query.shape
    expected = _expected_masked(case, scale, window, softcap, kwargs.get("sinks"))
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    torch.testing.assert_close(case.kv_cache, cache_before, rtol=0, atol=0, equal_nan=True)  # attention only reads
    return out


WINDOWS = [1, 5, 16, 23, 40, 1000]  # one key, smaller than a block, equal to it, neither a multiple, past every context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_on_a_mixed_batch_matches_reference(window, dtype):
    """Prefills, decodes and queries after a cached prefix, 16-key blocks and 64-key KV tiles: the
    first KV tile of most query tiles straddles the window's start."""
    case = _case(_mixed_specs(16), group=2, dtype=dtype, seed=window)
    _check_masked(case, 0.125, dtype, window, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, 5.0), (None, 50.0), (23, 5.0), (5, 30.0), (1000, 50.0)])
def test_softcap_alone_and_with_a_window_matches_reference(window, softcap, dtype):
    case = _case(_mixed_specs(16), group=2, dtype=dtype, seed=int(softcap))
    # scores past the cap: a large scale drives tanh to +-1 (and q.k / c far past exp2's range)
    for scale in (0.125, 4.0):
        _check_masked(case, scale, dtype, window, softcap)


@pytest.mark.parametrize("specs", HOMOGENEOUS_BATCHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_and_softcap_on_homogeneous_batches_match_reference(specs, dtype):
    _check_masked(_case(specs, group=4, dtype=dtype, seed=len(specs)), 0.125, dtype, 23, 30.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_window_and_softcap_with_gqa_groups_match_reference(group, dtype):
    case = _case(_mixed_specs(16), group=group, head_dim=128, dtype=dtype, seed=group)
    _check_masked(case, 128**-0.5, dtype, 23, 30.0)
    _check_masked(case, 128**-0.5, dtype, 40, None)


@pytest.mark.parametrize("dtype", [torch.float32])  # the split reduce's fp16 rounding: the mixed-batch split test
@pytest.mark.parametrize("kv_splits", [2, 5])
@pytest.mark.parametrize("window, softcap", [(16, None), (40, 30.0), (100, None)])
def test_forced_kv_splits_under_a_window_match_reference(window, softcap, kv_splits, dtype):
    """Splits divide the window's tiles, not [0, end): some splits hold no key a row sees (or no
    tile at all), and split 0 no longer holds key 0."""
    specs = [(150, 20), (3, 1), (130, 1), (40, 40), (200, 1)]
    _check_masked(_case(specs, group=3, dtype=dtype, seed=kv_splits), 0.125, dtype, window, softcap,
                  kv_splits=kv_splits)


def _sinks(num_heads: int) -> torch.Tensor:
    """From no sink at all (-1e4) to one that takes most of a row's mass."""
    return torch.linspace(-3.0, 6.0, num_heads).index_fill_(0, torch.tensor([0]), -1e4).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (23, None), (5, 30.0), (None, 50.0)])
def test_sinks_match_reference(window, softcap, dtype):
    """gpt-oss's sinks (HAS_SINKS) on a mixed batch, alone and with a window and a soft-cap."""
    case = _case(_mixed_specs(16), group=2, dtype=dtype, seed=17)
    _check_masked(case, 0.125, dtype, window, softcap, sinks=_sinks(case.query.shape[1]))


@pytest.mark.parametrize("kv_splits", [2, 5])
@pytest.mark.parametrize("window", [None, 40])
def test_sinks_are_counted_once_under_split_kv(kv_splits, window):
    """Split 0 starts from the sink; the other splits do not, so the reduce counts it once, also
    where split 0 holds no key a row sees (under a window)."""
    specs = [(150, 20), (3, 1), (130, 1), (40, 40), (200, 1)]
    case = _case(specs, group=3, dtype=torch.float32, seed=kv_splits)
    _check_masked(case, 0.125, torch.float32, window, None, kv_splits=kv_splits, sinks=_sinks(case.query.shape[1]))


def test_split_count_under_a_window_is_bounded_by_the_windows_span():
    """A decode of 300 keys (a 336-key table: 3 splits) splits by its context, but under a window
    by the window's span: a 40-key window is one split, a 200-key window (266 keys of 64-key
    tiles at most) two."""
    from kernels.triton_attention import launch_plan

    case = _case([(300, 1)], group=4, dtype=torch.float32, seed=3)
    width = case.block_tables.shape[1] * 16
    plan = lambda window: launch_plan(1, 1, 2, 4, 64, width, case.query.device, dtype=torch.float32,  # noqa: E731
                                      sliding_window=window)[1]
    assert (plan(None), plan(40), plan(200)) == (3, 1, 2)
    for window in (40, 200):
        _check_masked(case, 0.125, torch.float32, window, None)


def _tile(block_n: int, block_m: int = 32, group: int = 2) -> TileConfig:
    """A forced tile: 32 rows (16 tokens of a 2-head group), `block_n` keys."""
    return make_config(block_m, block_n, 4, 2, group)


@pytest.mark.parametrize("dtype", [torch.float32])  # which keys a tile loads does not depend on the dtype
@pytest.mark.parametrize("block_size, block_n, window, softcap, kv_splits", [
    (16, 16, 23, None, None), (16, 32, 40, 30.0, 3), (16, 128, 23, 30.0, None), (32, 16, 40, None, 3),
    (32, 64, 23, None, None),
])
def test_kv_tiles_wider_and_narrower_than_a_block_under_a_window_match_reference(block_size, block_n, window, softcap,
                                                                                 kv_splits, dtype):
    """A KV tile of several blocks straddles the window's start; one narrower than a block starts
    inside one."""
    case = _case(_mixed_specs(block_size), group=2, block_size=block_size, dtype=dtype, seed=block_n)
    _check_masked(case, 0.125, dtype, window, softcap, config=_tile(block_n), kv_splits=kv_splits)


@pytest.mark.parametrize("dtype", [torch.float32])  # which keys a tile loads does not depend on the dtype
@pytest.mark.parametrize("replace_with", ["null", "nan-block", "other-sequence", "own-nan"])
@pytest.mark.parametrize("window, softcap, block_n, kv_splits", [(5, None, 64, None), (23, 30.0, 128, 2),
                                                                 (40, None, 16, 3)])
def test_keys_before_the_window_are_never_loaded(window, softcap, block_n, kv_splits, replace_with, dtype):
    """The blocks wholly before each sequence's window point at the null block, at a block of
    NaN, at another sequence's block, or keep their own blocks filled with NaN; the slots before
    the window in its first block are NaN too. The output is finite and bit for bit what the
    intact cache gives: the kernel never loaded a key outside the windows."""
    from tests.test_kernels_reference import _poison_before_windows, _spare_block

    specs = [(100, 1), (37, 1), (150, 30), (60, 5), (200, 1)]
    case = _case(specs, group=2, dtype=dtype, seed=9)
    kwargs = dict(config=_tile(block_n), kv_splits=kv_splits)
    intact = _attend_masked(case, 0.125, window, softcap, **kwargs)
    replace = {"null": 0, "nan-block": _spare_block(case), "other-sequence": case.seqs[0].blocks[-1],
               "own-nan": None}[replace_with]
    _poison_before_windows(case, window, replace)
    poisoned = _check_masked(case, 0.125, dtype, window, softcap, **kwargs)
    torch.testing.assert_close(poisoned, intact, rtol=0, atol=0)


def test_write_then_attend_step_by_step_under_a_window_with_triton_only():
    """Prefill, then decode token by token past the window, both kernels in Triton."""
    window = 19
    for case in _written_step_by_step(1, group=2, n_prompt=21, total=45, blocks=[5, 2, 7]):
        out = kernels.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens,
                                      case.cu_seqlens_q, 0.125, impl="triton", sliding_window=window, logit_softcap=20.0)
        torch.testing.assert_close(out, _expected_masked(case, 0.125, window, 20.0), atol=2e-5, rtol=2e-5)


def test_no_window_and_no_softcap_launch_the_plain_variant_with_the_plain_arguments(monkeypatch):
    """None and 0 select the variant without the window's or the cap's code (HAS_WINDOW and
    HAS_SOFTCAP False, everything else as before) and pass scale * log2(e), as the kernel always had;
    the sm_90 compile test checks that the variant never reads the two new arguments."""
    from kernels import triton_attention as ta

    launched = []
    real = ta._attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((args, kw))
                return real[grid](*args, **kw)
            return launch

        def __getattr__(self, name):  # warmup (a GPU compiles the split variant to size its grid), arg_names
            return getattr(real, name)

    monkeypatch.setattr(ta, "_attention_kernel", Recorder())
    case = _case([(40, 1), (20, 20)], group=2, seed=1)
    outs = [_attend(case, 0.125, **kw) for kw in ({}, {"sliding_window": None, "logit_softcap": None},
                                                  {"sliding_window": 0, "logit_softcap": 0.0})]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    names = real.arg_names
    for args, kw in launched:
        assert kw["HAS_WINDOW"] is False and kw["HAS_SOFTCAP"] is False and kw["KV_FP8"] is False
        assert set(kw) == {"GROUP", "HEAD_DIM", "HEAD_DIM_P2", "BLOCK_SIZE", "BLOCK_M", "BLOCK_Q", "BLOCK_N",
                           "SPLIT_KV", "HAS_WINDOW", "HAS_SOFTCAP", "KV_FP8", "DOT_PRECISION", "HAS_SINKS",
                           "num_warps", "num_stages"}
        assert kw["HAS_SINKS"] is False
        assert args[names.index("qk_scale")] == 0.125 * math.log2(math.e)
    launched.clear()
    _attend(case, 0.125, sliding_window=7, logit_softcap=20.0)
    (args, kw), = launched
    assert kw["HAS_WINDOW"] is True and kw["HAS_SOFTCAP"] is True and args[names.index("sliding_window")] == 7
    assert args[names.index("qk_scale")] == 0.125 / 20.0
    assert args[names.index("softcap_log2")] == pytest.approx(20.0 * math.log2(math.e))


def test_negative_windows_and_caps_are_refused():
    case = _case([(20, 1)], group=2, seed=1)
    for kw in ({"sliding_window": -1}, {"logit_softcap": -5.0}):
        with pytest.raises(ValueError, match="must be positive"):
            _attend(case, 0.125, **kw)


# ----------------------------------------------------------------------------- a pool past int32 offsets


def _random_seqs(specs, tables, kvh: int, group: int, hd: int, block_size: int) -> list[Seq]:
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen).half()  # noqa: E731
    return [Seq(n, q, rand(n, kvh, hd), rand(n, kvh, hd), rand(q, kvh * group, hd), table[: -(-n // block_size)])
            for (n, q), table in zip(specs, tables)]


def _paged_case(seqs: list[Seq], pool: torch.Tensor, tables: list[list[int]]) -> Case:
    width = max(len(t) for t in tables)
    cu = torch.tensor([0] + [s.q_len for s in seqs]).cumsum(0)
    return Case(
        seqs, pool, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        torch.tensor([s.seq_len for s in seqs], dtype=torch.int32, device=DEVICE), cu.to(DEVICE, torch.int32),
        torch.cat([s.q for s in seqs]).to(DEVICE), pool, pool.shape[2],
    )


def test_pool_past_int32_element_offsets_writes_reads_and_copies_high_blocks():
    """524,352 blocks of [2, 16, 2, 64] float16: block ids past 2**19 put element offsets past
    2**31, so any int32 product of block id and block stride would land elsewhere. The pool is
    4 GiB of address space, but only the touched blocks get memory (on CPU, pages are mapped on
    first touch), so only those are poisoned."""
    bs, kvh, hd, group = 16, 2, 64, 4
    num_blocks = (1 << 31) // (2 * bs * kvh * hd) + 64
    pool = torch.empty((num_blocks, 2, bs, kvh, hd), dtype=torch.float16, device=DEVICE)
    assert pool.numel() > 2**31 and num_blocks >= 32768
    high = num_blocks - 40  # blocks from here on start past element 2**31
    tables = [[high + 3, 7, high + 30, high + 1, high + 2], [high + 10, high + 39, high + 11],
              [3, high + 20, high + 21, high + 22]]
    touched = sorted({0, high + 36, high + 37} | {b for t in tables for b in t})
    pool[touched] = float("nan")

    seqs = _random_seqs([(70, 1), (40, 40), (50, 10)], tables, kvh, group, hd, bs)
    key, value, slots = _tokens_with_padding(seqs, bs, torch.float16)
    kernels.write_kv(key, value, pool, slots, impl="triton")
    for s in seqs:
        for p in range(s.seq_len):
            b, o = s.blocks[p // bs], p % bs
            assert torch.equal(pool[b, 0, o].cpu(), s.k[p]) and torch.equal(pool[b, 1, o].cpu(), s.v[p])

    # The reference reads a compact copy of the touched blocks (upcasting the pool would touch it all).
    compact_id = {b: i for i, b in enumerate(touched)}
    expected = _expected(_paged_case(seqs, pool[touched], [[compact_id[b] for b in t] for t in tables]), 0.125)
    for kv_splits in (None, 3):
        out = _attend(_paged_case(seqs, pool, tables), 0.125, kv_splits=kv_splits)
        torch.testing.assert_close(out.float(), expected, **tolerance(torch.float16))

    kernels.copy_blocks([pool], [(high + 3, high + 36), (7, high + 37)], impl="triton")
    assert torch.equal(pool[high + 36], pool[high + 3]) and torch.equal(pool[high + 37], pool[7])


# ----------------------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer_like_the_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(9, 2, 16, 2, 64, generator=gen).to(DEVICE, dtype) for _ in range(3)]
    expected = [c.clone() for c in caches]
    pairs = [(1, 4), (8, 2), (3, 7)]
    kernels.copy_blocks(caches, pairs, impl="triton")
    kernels.copy_blocks(expected, pairs, impl="torch")
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    assert torch.equal(caches[2][2], caches[2][8]) and not torch.equal(caches[2][2], caches[1][2])


# ----------------------------------------------------------------------------- compiled for Hopper, without a GPU


def _compile_for_sm90() -> list[str]:
    """Compile every kernel variant the wrappers launch for sm_90 (Triton's own ptxas), with the
    16-divisibility the JIT gives pointers and strides. Run with TRITON_INTERPRET unset."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_attention as ta
    from kernels import triton_cache as tc

    def compile_(fn, types: dict, consts: dict, num_warps=4, num_stages=2):
        sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_table")}
        kernel = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages})
        assert kernel.metadata.shared <= 227 * 1024, f"{fn.__name__} needs {kernel.metadata.shared} B of shared memory"
        return f"{fn.__name__} {sorted(consts.items())}", kernel

    def reads(kernel, arg: str) -> bool:
        """Whether the PTX loads a runtime argument (its params are the non-constexpr arguments, in order)."""
        fn = ta._attention_kernel
        index = [n for n in fn.arg_names if not n.isupper()].index(arg)
        return f"[{fn.__name__}_param_{index}]" in kernel.asm["ptx"]

    done = []
    # (dtype, group, head_dim, decode, split, window, softcap): the plain variants, then the masked
    # ones of the models that need them (Gemma 2: group 2, head_dim 256, both; Mistral: a window);
    # then an fp8 cache's (KV_FP8: a bfloat16 or float16 query over a float8_e4m3fn cache); then
    # gpt-oss's sinks (group 8, head_dim 64; windowed and global, split and not)
    for dtype, group, head_dim, decode, split, window, softcap, fp8, sinks in [(*v, False, False) for v in [
        ("bf16", 4, 128, True, False, False, False), ("bf16", 4, 128, True, True, False, False),
        ("bf16", 4, 128, False, False, False, False), ("fp16", 3, 64, False, True, False, False),
        ("fp32", 7, 80, True, True, False, False), ("bf16", 20, 64, True, False, False, False),
        ("bf16", 4, 128, True, True, True, False), ("bf16", 4, 128, False, False, True, False),
        ("fp16", 3, 64, True, False, False, True), ("bf16", 2, 256, True, True, True, True),
        ("bf16", 2, 256, False, False, True, True), ("fp32", 7, 80, False, True, True, True),
    ]] + [(*v, False) for v in [
        ("bf16", 4, 128, True, False, False, False, True), ("bf16", 4, 128, True, True, False, False, True),
        ("bf16", 4, 128, False, False, False, False, True), ("fp16", 2, 256, True, True, True, True, True),
    ]] + [
        ("bf16", 8, 64, True, True, True, False, False, True), ("bf16", 8, 64, False, False, False, False, False, True),
        ("bf16", 8, 64, True, False, False, False, False, True), ("bf16", 8, 64, False, False, True, False, False, True),
    ]:
        cfg = ta.tile_config(1 if decode else 2, 1, group, head_dim)
        ptr = f"*{dtype}"
        kv_ptr = "*fp8e4nv" if fp8 else ptr
        types = {"out_ptr": ptr, "query_ptr": ptr, "kv_cache_ptr": kv_ptr, "o_partial_ptr": "*fp32",
                 "lse_partial_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "cu_seqlens_q_ptr": "*i32", "sinks_ptr": "*fp32", "qk_scale": "fp32", "softcap_log2": "fp32",
                 "v_scale": "fp32"}
        p2 = triton.next_power_of_2
        name, kernel = compile_(ta._attention_kernel, types, dict(
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=p2(head_dim), BLOCK_SIZE=16, BLOCK_M=cfg.block_m,
            BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n, SPLIT_KV=split, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
            KV_FP8=fp8, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", HAS_SINKS=sinks,
        ), cfg.num_warps, cfg.num_stages)
        # a variant without the window or the cap compiles their code away: it never reads the argument
        assert reads(kernel, "qk_scale") and reads(kernel, "stride_table"), "the PTX's params are not the arguments"
        assert (reads(kernel, "sliding_window"), reads(kernel, "softcap_log2")) == (window, softcap), name
        assert reads(kernel, "v_scale") == fp8, name  # a full-precision cache's variant never reads the scale
        assert reads(kernel, "sinks_ptr") == sinks, name
        done.append(name)
        if window or softcap or sinks or (fp8 and not (decode and not split)):
            continue  # the reduce, write_kv and copy_blocks have no masked variants
        if split:
            done.append(compile_(ta._reduce_splits_kernel, types, dict(
                GROUP=group, GROUP_P2=p2(group), HEAD_DIM=head_dim, HEAD_DIM_P2=p2(head_dim), SPLITS_P2=32))[0])
        done.append(compile_(tc._write_kv_kernel, {"key_ptr": ptr, "value_ptr": ptr, "kv_cache_ptr": kv_ptr,
                                                    "slot_mapping_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"},
                             dict(NUM_KV_HEADS=8, HEAD_DIM=head_dim, HEADS_P2=8, HEAD_DIM_P2=p2(head_dim),
                                  BLOCK_SIZE=16, KV_FP8=fp8, FP8_MAX=448.0 if fp8 else 0.0))[0])
        tl_dtype = tl.uint8 if fp8 else {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
        done.append(compile_(tc._copy_blocks_kernel, {"layer_ptrs": "*i64", "src_to_dst_ptr": "*i64"},
                             dict(DTYPE=tl_dtype, CHUNK=tc.COPY_CHUNK))[0])
    return done


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernels are compiled for the device itself")
def test_every_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter runs Python, not the compiler: this catches what only compiling would."""
    # 6 plain attention variants, 3 reduces, 6 write_kv, 6 copy_blocks; 6 windowed or soft-capped variants;
    # 4 over an fp8 cache, with its write_kv and (byte) copy_blocks; 4 with sinks
    assert count_compiled_for_sm90("tests.test_kernels_triton", "_compile_for_sm90") == 37


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="runs the compiled kernels on CUDA; TRITON_INTERPRET=1 is set")
def test_cuda_tensors_dispatch_to_triton_by_default(monkeypatch):
    from kernels import triton_attention

    calls = []
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = _case([(20, 20), (9, 1)], group=3)
    out = kernels.paged_attention(case.query, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q, 0.125)
    assert calls == [1]
    torch.testing.assert_close(out, _expected(case, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need the compiled kernels; TRITON_INTERPRET=1 is set")
@pytest.mark.parametrize("window, softcap", [(None, None), (50, 30.0)])
@pytest.mark.parametrize("kv_splits", [None, 1])  # None: the heuristic splits (6 programs, 1,024-key bound)
def test_paged_attention_replays_in_a_cuda_graph_with_new_lengths(kv_splits, window, softcap):
    """Static shapes, new contents: the same captured launch serves other context lengths (and,
    under a window, other window starts)."""
    first = _case([(40, 1), (70, 1), (5, 1)], group=4, seed=1)
    second = _case([(33, 1), (90, 1), (17, 1)], group=4, seed=2)
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    blocks = max(first.kv_cache.shape[0], second.kv_cache.shape[0])
    static = {
        "cache": torch.zeros((blocks, *first.kv_cache.shape[1:]), device=DEVICE),
        "tables": torch.zeros((3, width), dtype=torch.int32, device=DEVICE),
        "lens": torch.zeros(3, dtype=torch.int32, device=DEVICE),
        "query": torch.zeros_like(first.query), "out": torch.zeros_like(first.query),
    }
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)

    def load(case: Case) -> Case:
        static["cache"][: case.kv_cache.shape[0]] = case.kv_cache
        static["tables"].zero_()[:, : case.block_tables.shape[1]] = case.block_tables
        static["lens"].copy_(case.seq_lens)
        static["query"].copy_(case.query)
        return Case(case.seqs, static["cache"], static["tables"], static["lens"], cu, static["query"], None, 16)

    def launch():
        kernels.paged_attention(static["query"], static["cache"], static["tables"], static["lens"], cu, 0.125,
                                out=static["out"], max_seqlen_k=1024, kv_splits=kv_splits, sliding_window=window,
                                logit_softcap=softcap)

    load(first)
    launch()  # warm-up: compiles, and sizes the split workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for case in (first, second):
        view = load(case)
        static["out"].fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(static["out"], _expected_masked(view, 0.125, window, softcap), atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="pinned host memory needs CUDA; TRITON_INTERPRET=1 is set")
def test_swap_blocks_round_trip_through_a_pinned_cpu_pool():
    gpu = [torch.randn(10, 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    cpu = [torch.zeros(6, 2, 16, 2, 64, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    original = [g.clone() for g in gpu]
    kernels.swap_blocks(gpu, cpu, [(3, 0), (4, 1), (9, 5)])  # swap out
    for g in gpu:
        g[[3, 4, 9]] = 0  # the GPU blocks are reused
    kernels.swap_blocks(cpu, gpu, [(0, 6), (1, 7), (5, 2)])  # swap in, elsewhere
    torch.cuda.synchronize()
    for g, o in zip(gpu, original):
        assert torch.equal(g[[6, 7, 2]], o[[3, 4, 9]])
