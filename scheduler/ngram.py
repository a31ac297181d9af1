"""N-gram prompt lookup (vLLM's `ngram` method), the draft proposer that
needs no model. The scheduler holds every sequence's token ids, so it can propose drafts itself.

`propose(tokens, k, min_n, max_n)`: for n from `max_n` down to `min_n`, the latest earlier place
where the sequence's last n tokens occur; the draft is the (up to) k tokens that followed them
there, up to an image's placeholder (never a draft). No match: no draft.
"""
from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence

from common.multimodal import PLACEHOLDER_BASE


def propose(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"k={k}, min_n={min_n}, max_n={max_n}: need k >= 1 and 1 <= min_n <= max_n")
    length = len(tokens)
    # The search runs over the tokens' bytes (8 per token: an image's placeholder ids are 62-bit) in
    # C: bytes.rfind, keeping only matches that start on a token's boundary. It runs for every
    # speculating sequence every step.
    data = array("q", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[8 * (length - n):]
        end = 8 * (length - 1)  # a match must end before the last token: its continuation exists
        while (at := data.rfind(suffix, 0, end)) >= 0:
            if at % 8 == 0:
                start = at // 8 + n
                return list(itertools.takewhile(lambda t: t < PLACEHOLDER_BASE, tokens[start:start + k]))
            end = at + len(suffix) - 1
    return []
