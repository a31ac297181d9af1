"""SGLang's in-batch prefix caching: a prompt whose first blocks another prompt is computing right
now waits for them to be cached instead of computing them again beside it (a burst of requests
sharing a new system prompt computes it once). It keeps its place in the waiting queue, and finds
those blocks cached once a result says they are computed."""
from __future__ import annotations

from common.block_hash import prompt_block_hashes
from scheduler.allocator import Allocator, PrefixMatch
from scheduler.sequence import Sequence, SequenceGroup, TokenView

MIN_SHARED_PREFIX_BLOCKS = 2  # only a shared prefix of this many blocks makes a prompt wait


def prompt_keys(group: SequenceGroup, block_size: int) -> list[bytes]:
    """The prefix-cache keys of the group's full prompt blocks, computed once."""
    if group.prompt_block_keys is None:
        group.prompt_block_keys = prompt_block_hashes(group.prompt_token_ids, block_size, group.prefix_salt)
    return group.prompt_block_keys


def lone_prompt_match(bm: Allocator, group: SequenceGroup, seqs: list[Sequence]) -> PrefixMatch | None:
    """The cached blocks of a lone prompt, looked up once per attempt to start it (by the group's
    prompt block keys, hashed once); None without a prefix cache, for a group that computes every
    prompt position itself (it scores or pools them) and for a preempted group of several sequences."""
    if not bm.enable_prefix_caching or len(seqs) != 1 or group.computes_whole_prompt:
        return None
    seq = seqs[0]
    return bm.match_prefix(TokenView(seq), seq.num_tokens, group.prefix_salt, prompt_keys(group, bm.block_size))


class ComputingPrefixes:
    """The keys of the prompt blocks being computed, for one pass over the waiting queue: those of
    the running prompts (gathered at the first waiting prompt that asks) and of the prompts the
    pass starts."""

    def __init__(self, block_manager: Allocator) -> None:
        self._bm = block_manager
        self._keys: set[bytes] | None = None

    def should_wait(self, group: SequenceGroup, running: list[SequenceGroup], match: PrefixMatch | None) -> bool:
        """Whether the waiting group's prompt begins with MIN_SHARED_PREFIX_BLOCKS or more blocks
        that a prompt is computing and the cache does not hold yet (`match`: what it holds)."""
        if match is None or len(group.seqs) != 1:
            return False
        if self._keys is None:
            self._keys = self._running_prompt_keys(running)
        return self._shares_a_computing_prefix(group, match)

    def started(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """The group's prompt was admitted: its blocks are being computed too, unless cached already."""
        if self._keys is not None and len(seqs) == 1 and seqs[0].num_computed_tokens < seqs[0].num_tokens:
            self._keys.update(prompt_keys(group, self._bm.block_size))

    def _running_prompt_keys(self, running: list[SequenceGroup]) -> set[bytes]:
        """The prompt block keys of the running sequences whose prompt is not computed yet: their
        blocks are cached once a result says so (the plan in flight's included)."""
        keys: set[bytes] = set()
        for group in running:
            if len(group.seqs) == 1 and not group.computes_whole_prompt:
                if group.seqs[0].num_computed_tokens < len(group.prompt_token_ids):
                    keys.update(prompt_keys(group, self._bm.block_size))
        return keys

    def _shares_a_computing_prefix(self, group: SequenceGroup, match: PrefixMatch) -> bool:
        computing, bm = self._keys, self._bm
        if not computing:
            return False
        keys = prompt_keys(group, bm.block_size)
        shared = 0
        while shared < len(keys) and keys[shared] in computing:
            shared += 1
        # a hit never covers the block of the last token (it must be computed): beyond it, nothing to wait for
        shared = min(shared, (group.seqs[0].num_tokens - 1) // bm.block_size)
        if shared < MIN_SHARED_PREFIX_BLOCKS:
            return False
        return match.num_blocks < shared
