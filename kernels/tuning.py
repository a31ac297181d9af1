"""The attention kernel's launch configuration: tile shapes per GPU from a tuned table, the split-KV
count from resident programs, and the set of kernel variants a model can launch (for start-up
compilation). Pure Python, no torch or triton: every rule here is unit-tested with explicit numbers.

The tuned table, `kernels/tuned/attention.json`, is written by `pagoda bench kernels --tune` on a
GPU (it times every `config_space` entry with triton.testing.do_bench) and keyed by
(device name, head_dim, group, phase), phase being "decode" (every query length 1) or "prefill"
(any launch holding a longer query). A launch whose key is absent runs `default_config`, the
fixed heuristic the kernel always had.
"""
from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Phase = Literal["decode", "prefill"]
PHASES: tuple[Phase, Phase] = ("decode", "prefill")
TUNED_TABLE = Path(__file__).resolve().parent / "tuned" / "attention.json"
TABLE_VERSION = 1

MAX_KV_SPLITS = 32
MIN_TILES_PER_SPLIT = 2  # a split reads at least this many BLOCK_N tiles, or splitting is not worth a reduce
REDUCE_NUM_WARPS = 4


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int  # rows of a query tile: block_q tokens x group heads (padded to a power of two)
    block_q: int  # query tokens per tile
    block_n: int  # keys per KV tile
    num_warps: int
    num_stages: int


def phase_of(num_tokens: int, num_seqs: int) -> Phase:
    """Every q_len is 1 exactly when num_tokens == num_seqs (each sequence has at least one query)."""
    return "decode" if num_tokens <= num_seqs else "prefill"


def min_block_m(group: int, phase: Phase) -> int:
    """BLOCK_M >= 16 for tl.dot, and at least one token's whole query group."""
    return max(16, next_power_of_2(group)) if phase == "decode" else max(32, next_power_of_2(group))


def make_config(block_m: int, block_n: int, num_warps: int, num_stages: int, group: int) -> TileConfig:
    return TileConfig(block_m, block_m // group, block_n, num_warps, num_stages)


def default_config(group: int, head_dim: int, phase: Phase) -> TileConfig:
    """The untuned heuristic: small tiles for decode-only batches, taller ones with a prefill."""
    block_m = max(16 if phase == "decode" else 64, next_power_of_2(group))
    return make_config(block_m, 64 if head_dim <= 128 else 32, 4, 2, group)


def config_space(group: int, head_dim: int, phase: Phase) -> list[TileConfig]:
    """What the tuner times. A decode tile holds one token's group (more rows would be padding), so
    decode varies the key tile, warps and stages; prefill varies the query tile height too."""
    base = min_block_m(group, phase)
    block_ms = [base] if phase == "decode" else sorted({m for m in (32, 64, 128) if m >= base} or {base})
    block_ns = (16, 32, 64, 128) if head_dim <= 128 else (16, 32, 64)
    warps = (2, 4, 8) if phase == "decode" else (4, 8)
    stages = (1, 2, 3, 4) if phase == "decode" else (1, 2, 3)
    return [make_config(m, n, w, s, group) for m, n, w, s in itertools.product(block_ms, block_ns, warps, stages)]


# ----------------------------------------------------------------------------- the tuned table


def table_key(device_name: str, head_dim: int, group: int, phase: Phase) -> str:
    return f"{device_name}|head_dim={head_dim}|group={group}|{phase}"


def config_entry(config: TileConfig) -> dict:
    """A table entry's launch fields (block_q is derived: block_m // group)."""
    return {k: v for k, v in asdict(config).items() if k != "block_q"}


def parse_table(data: dict) -> dict[str, dict]:
    if data.get("version") != TABLE_VERSION:
        raise ValueError(f"tuned table version {data.get('version')!r}, expected {TABLE_VERSION}")
    return dict(data.get("entries", {}))


@functools.cache
def load_table(path: Path = TUNED_TABLE) -> dict[str, dict]:
    """The shipped table (empty until a GPU session runs `pagoda bench kernels --tune`)."""
    if not path.exists():
        return {}
    return parse_table(json.loads(path.read_text()))


def lookup_config(table: dict[str, dict], device_name: str, group: int, head_dim: int, phase: Phase) -> TileConfig:
    """The tuned config for this GPU and shape, or `default_config` when the table has none (or
    one a kernel could not run: a query tile shorter than the group)."""
    entry = table.get(table_key(device_name, head_dim, group, phase))
    if entry is None or entry["block_m"] < min_block_m(group, phase):
        return default_config(group, head_dim, phase)
    return make_config(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"], group)


def merge_table(old: dict, new_entries: dict[str, dict]) -> dict:
    """A table with `new_entries` replacing entries of the same key (other GPUs' entries stay)."""
    entries = dict(old.get("entries", {})) if old else {}
    entries.update(new_entries)
    return {"version": TABLE_VERSION, "entries": dict(sorted(entries.items()))}


# ----------------------------------------------------------------------------- occupancy and split-KV


@dataclass(frozen=True, slots=True)
class SMLimits:
    """Per-SM resource limits (defaults: an H100 SXM, compute capability 9.0)."""

    num_sms: int = 132
    regs_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    warp_size: int = 32
    reg_alloc_unit: int = 256  # registers are allocated to a warp in units of this many
    shared_reserved_per_block: int = 1024  # the driver's share of each resident block (sm_80 and later)


# resident blocks per SM by compute capability (CUDA occupancy calculator); 16 when unknown
MAX_BLOCKS_PER_SM = {(7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24, (9, 0): 32,
                     (10, 0): 32, (12, 0): 32}


def resident_programs_per_sm(num_warps: int, regs_per_thread: int, shared_bytes: int, limits: SMLimits) -> int:
    """How many programs (thread blocks) of a compiled kernel one SM holds at once: the tightest
    of registers, shared memory, threads and the block limit (at least 1: a kernel that launched
    runs one at a time)."""
    regs_per_warp = cdiv(regs_per_thread * limits.warp_size, limits.reg_alloc_unit) * limits.reg_alloc_unit
    by_regs = (limits.regs_per_sm // regs_per_warp) // num_warps if regs_per_warp else limits.max_blocks_per_sm
    by_threads = limits.max_threads_per_sm // (num_warps * limits.warp_size)
    by_shared = limits.shared_per_sm // (shared_bytes + limits.shared_reserved_per_block)
    return max(min(by_regs, by_threads, by_shared, limits.max_blocks_per_sm), 1)


def num_kv_splits(num_programs: int, max_seqlen_k: int, block_n: int, resident_slots: int) -> int:
    """Split each sequence's keys when the (query tile, KV head) programs leave resident slots
    (SMs x resident programs per SM) empty.

    Enough splits that the grid fills every slot at least once and less than twice, but no split
    shorter than MIN_TILES_PER_SPLIT tiles of the longest context: short contexts gain nothing
    from a reduce.
    """
    if num_programs >= resident_slots:
        return 1
    by_occupancy = cdiv(resident_slots, num_programs)
    by_length = max(cdiv(max_seqlen_k, block_n) // MIN_TILES_PER_SPLIT, 1)
    return min(by_occupancy, by_length, MAX_KV_SPLITS)


def busy_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """The grid's query tiles that hold queries, about: one per sequence plus its full tiles."""
    return num_seqs + (num_tokens - num_seqs) // block_q


# ----------------------------------------------------------------------------- launch variants


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What fixes a model's attention kernels: one compiled variant per (config, SPLIT_KV).

    A layer with a sliding window, a logit soft-cap or sinks runs its own variant of the kernel (the
    HAS_WINDOW, HAS_SOFTCAP and HAS_SINKS constexprs); the window's size, the cap and the sinks are
    runtime arguments.
    """

    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    dtype: str  # "bfloat16", "float16", "float32"
    sliding_window: bool = False
    logit_softcap: bool = False
    kv_dtype: str = ""  # the cache's when it differs from dtype: "float8_e4m3fn" (an fp8 KV cache)
    sinks: bool = False  # a learned logit per head in the softmax (gpt-oss): the HAS_SINKS variant


@dataclass(frozen=True, slots=True)
class Launch:
    """The host-side decisions of one paged_attention call."""

    config: TileConfig
    kv_splits: int


SlotsOf = Callable[[TileConfig], int]  # resident slots of the split variant of a config, on this device


def window_keys(sliding_window: int | None, config: TileConfig) -> int | None:
    """An upper bound on the keys a query tile walks under a window W, in whole KV tiles: its
    first query's W keys up to its last query, W + block_q - 1, from the start of a KV tile (up to
    block_n - 1 keys before). None without a window."""
    return sliding_window + config.block_q + config.block_n - 2 if sliding_window else None


def plan_launch(shape: AttentionShape, num_tokens: int, num_seqs: int, max_seqlen_k: int,
                config_of: Callable[[Phase], TileConfig], slots_of: SlotsOf, *,
                sliding_window: int | None = None) -> Launch:
    """The tile config and split count of a launch, from host-known sizes only. Under a window
    the keys a tile walks are bounded by the window's span, not the longest context."""
    config = config_of(phase_of(num_tokens, num_seqs))
    programs = busy_tiles(num_tokens, num_seqs, config.block_q) * shape.num_kv_heads
    keys = min(max_seqlen_k, window_keys(sliding_window, config) or max_seqlen_k)
    return Launch(config, num_kv_splits(programs, keys, config.block_n, slots_of(config)))


def variants_of(shape: AttentionShape, launch: Launch) -> set[tuple]:
    """The compiled kernels a launch runs, as hashable keys: the attention kernel's constexprs and
    options, and the reduce kernel's when the keys are split."""
    c = launch.config
    keys = {("attention", shape.dtype, shape.group, shape.head_dim, shape.block_size, c.block_m, c.block_q, c.block_n,
             launch.kv_splits > 1, c.num_warps, c.num_stages, shape.sliding_window, shape.logit_softcap, shape.kv_dtype,
             shape.sinks)}
    if launch.kv_splits > 1:
        keys.add(("reduce", shape.dtype, shape.group, shape.head_dim, next_power_of_2(launch.kv_splits)))
    return keys


def warmup_launches(shape: AttentionShape, max_model_len: int, config_of: Callable[[Phase], TileConfig],
                    slots_of: SlotsOf, *, sliding_window: int | None = None) -> list[Launch]:
    """Launches that together compile every variant `plan_launch` can pick for this shape.

    A phase's config is fixed, so what varies is the split count: 1, and every count up to the
    largest the heuristic reaches (the fewest programs: one tile of one sequence; the longest
    context: max_model_len rounded up to a block, as a block table's width bounds it, or a
    window's span). The reduce kernel compiles per power of two of the split count, so one launch
    per power of two covers it.
    """
    launches = []
    for phase in PHASES:
        config = config_of(phase)
        longest = cdiv(max_model_len, shape.block_size) * shape.block_size
        longest = min(longest, window_keys(sliding_window, config) or longest)
        most = num_kv_splits(shape.num_kv_heads, longest, config.block_n, slots_of(config))
        splits = sorted({1} | {min(next_power_of_2(s), most) for s in range(2, most + 1)})
        launches += [Launch(config, s) for s in splits]
    return launches


def warmup_variants(shape: AttentionShape, max_model_len: int, config_of: Callable[[Phase], TileConfig],
                    slots_of: SlotsOf, *, sliding_window: int | None = None) -> set[tuple]:
    return set().union(*(variants_of(shape, launch) for launch in
                         warmup_launches(shape, max_model_len, config_of, slots_of, sliding_window=sliding_window)))


def launch_grid(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                block_size: int) -> Iterable[tuple[int, int, int]]:
    """A grid of (num_tokens, num_seqs, max_seqlen_k) a serving step can launch with (for tests)."""
    seqs = sorted({1, 2, 3, 4, 7, 8, 16, 31, 64, max_num_seqs} & set(range(1, max_num_seqs + 1)))
    lens = sorted({1, block_size, 2 * block_size + 1, 1000, max_model_len} & set(range(1, max_model_len + 1)))
    for num_seqs in seqs:
        for extra in (0, 1, 17, max_num_batched_tokens - num_seqs):
            num_tokens = num_seqs + extra
            if extra >= 0 and num_tokens <= max(max_num_batched_tokens, num_seqs):
                for max_seqlen_k in lens:
                    yield num_tokens, num_seqs, cdiv(max_seqlen_k, block_size) * block_size
