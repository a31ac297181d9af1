"""The benches' one definition of a percentile and of a timing summary, and the loop that times
calls in turn. No torch, no numpy: `pagoda bench memory` runs on a host without them."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 to 100), interpolated linearly between the two nearest ranks: numpy's
    default, and vLLM's benchmarks'."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stat(values: Sequence[float], name: str) -> float:
    """mean, median, max, or pNN (any percentile, e.g. p99) of `values`."""
    if name == "mean":
        return statistics.fmean(values)
    if name == "median":
        return statistics.median(values)
    if name == "max":
        return max(values)
    return percentile(values, float(name.removeprefix("p")))


def stats(values: Sequence[float], names: Sequence[str] = ("mean", "median", "p99"), scale: float = 1.0) -> dict:
    """{name: statistic of `values` x `scale`} (1e3: seconds to milliseconds); each None when there
    are no values."""
    return {name: stat(values, name) * scale if len(values) else None for name in names}


def median_ms(seconds: Sequence[float]) -> float:
    """The median of `seconds`, in milliseconds to 4 places."""
    return round(statistics.median(seconds) * 1e3, 4)


def time_in_turn(calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 0, repeats: int = 1,
                 sync: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Seconds per call of each of `calls`, the median over `rounds`: `warmup` untimed calls of each
    first, then each round every one in turn (a drift of the machine's speed falls on all of them
    alike), timed over `repeats` back-to-back calls, synchronized before and after."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(samples) for name, samples in times.items()}
