"""[speculative] groundwork: n-gram prompt lookup (vLLM's `ngram` method), the draft proposer that
needs no model. The scheduler holds every sequence's token ids, so it can propose drafts itself.

`propose(tokens, k, min_n, max_n)`: for n from `max_n` down to `min_n`, the latest earlier place
where the sequence's last n tokens occur; the draft is the (up to) k tokens that followed them
there. No match: no draft. Nothing calls it yet.
"""
from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"k={k}, min_n={min_n}, max_n={max_n}: need k >= 1 and 1 <= min_n <= max_n")
    tokens = list(tokens)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # the latest start before the suffix's own: the continuation must exist (start + n < length)
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
