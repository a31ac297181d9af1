"""Sequences (one stream of tokens with a block table) and sequence groups (one request)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.protocol import LoRARequest, MultiModalItem, SamplingParams
from scheduler.block_manager import lora_salt


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # plain attributes, not properties: read for every sequence every step
        self.finished: bool = value in ("stop", "length", "abort")
        self.finish_reason: str | None = value if self.finished else None


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens.

        [0, num_computed_tokens)           KV is in the cache and may be read
        [num_computed_tokens, num_tokens)  not yet computed; a step schedules a prefix of it
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # the group's, with this sample's own seed
    index: int = 0  # the sample's index in its request
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, list[list]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_sent_blocks: int = 0  # block ids the workers already hold (plan diffs)
    # drafts its last verification accepted, not yet sent to the workers (their KV is)
    accepted_unsent: list[int] = field(default_factory=list)
    # The plan in flight (async scheduling: the one sent whose result has not come) and this
    # sequence: the tokens it surely computes there (of one verifying drafts, only its last), the
    # tokens it draws there, and that plan's step (its result clears them, unless a later plan
    # has set them since).
    ahead: int = 0
    ahead_draws: int = 0
    ahead_step: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def draws_in_flight(self) -> bool:
        """The plan in flight computes the sequence's last token: it draws the next one there."""
        ahead = self.ahead
        return ahead != 0 and self.num_computed_tokens + ahead == len(self.prompt_token_ids) + len(self.output_token_ids)

    def plan_ahead(self, step: int, num_tokens: int, num_draws: int) -> None:
        """Planned in step `step` (being made): what that plan computes and draws for it."""
        self.ahead, self.ahead_draws, self.ahead_step = num_tokens, num_draws, step

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.num_sent_blocks = 0
        self.status = SequenceStatus.WAITING


class TokenView:
    """A sequence's prompt and output as one sliceable list, without concatenating them."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq

    def __len__(self) -> int:
        return self.seq.num_tokens

    def __getitem__(self, index: slice) -> list[int]:
        prompt, output = self.seq.prompt_token_ids, self.seq.output_token_ids
        start, stop = index.start or 0, len(self) if index.stop is None else index.stop
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return output[start - n:stop - n]
        return prompt[start:] + output[:stop - n]


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """The sequences of one request, scheduled, preempted and resumed as one unit."""

    request_id: str
    seqs: list[Sequence]  # live ones; for beam search, the running beams best first
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    beam: BeamState | None = None
    first_scheduled_time: float | None = None  # time.time() when first scheduled (vLLM's queue time ends)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when first scheduled (usage's cached_tokens)
    # prompt_logprobs asked: per prompt position None (the first, or not yet scored) else
    # [logprob, rank, top]; complete once `num_prompt_logprobs_missing` is 0
    prompt_logprobs: list | None = None
    num_prompt_logprobs_missing: int = 0
    # one sequence for good that streams its tokens (no beams, n = best_of = 1, max_tokens > 0): the
    # case `Scheduler.update` takes without its general path
    simple: bool = False
    lora: LoRARequest | None = None  # the adapter it runs with
    lora_slot: int = -1  # the workers' slot of that adapter while the group runs (pinned), else -1
    prompt_block_keys: list[bytes] | None = None  # its prompt's full blocks' prefix-cache keys, once asked
    pooled: bytes | None = None  # a pooling request's vector (PooledOutput.data), once computed
    mm_items: list[MultiModalItem] = field(default_factory=list)  # its prompt's images (common/multimodal.py)

    @property
    def prefix_salt(self) -> bytes | None:
        """What keys its prefix-cache blocks apart from other adapters' (None: the base model's)."""
        return None if self.lora is None else lora_salt(self.lora.lora_int_id, self.lora.lora_path)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still to score: the prefill must compute every position (no prefix-cache hit)."""
        return self.num_prompt_logprobs_missing > 0

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether its own steps must compute every prompt position (no prefix-cache hit): it scores
        them, or pools all of them (a pooling request's mean or CLS; common/pooling.py)."""
        pooling = self.sampling_params.pooling
        return self.needs_prompt_logprobs or (pooling is not None and pooling.reads_every_token)

    @property
    def complete_prompt_logprobs(self) -> list | None:
        return self.prompt_logprobs if self.num_prompt_logprobs_missing == 0 else None

    @property
    def best_of(self) -> int:
        return self.sampling_params.best_of or self.sampling_params.n

    @property
    def max_seqs(self) -> int:
        """The most sequences this group runs at once (what max_num_seqs admits it against)."""
        return self.beam.width if self.beam is not None else self.best_of

    @property
    def selects_at_end(self) -> bool:
        """Whether the outputs are chosen only when the request ends (nothing streams before)."""
        return self.beam is not None or self.best_of > self.sampling_params.n

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def seqs_with(self, status: SequenceStatus) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.status is status]

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        for seq in self.seqs:
            if not seq.status.finished:
                return False
        return True


@dataclass(slots=True)
class BeamHypothesis:
    score: float  # float32: sum of logprobs / generated length ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


@dataclass(slots=True)
class BeamState:
    """transformers' beam search bookkeeping for one request: the best finished hypotheses and
    whether the running beams can still beat them."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most `width`
    improvable: bool = True
    done: bool = False
    pending: dict = field(default_factory=dict)  # seq_id -> SampledToken: beams that sampled, waiting for the rest


@dataclass(slots=True)
class SequenceOutput:
    index: int
    token_ids: list[int]  # every output token so far (a view: copy it to keep it)
    num_new_tokens: int  # how many of them this step added
    cumulative_logprob: float
    logprobs: list[tuple[float, list[list]]] | None
    finish_reason: str | None

    @property
    def new_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_new_tokens:]


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens, and whether it ended."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceOutput]
    finished: bool
    first_scheduled_time: float | None = None  # SequenceGroup.first_scheduled_time (RequestEvent.scheduled_at)
    # prompt_logprobs once every prompt position has them (RequestEvent.prompt_logprobs's shape), else None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # SequenceGroup.num_cached_tokens (vLLM's RequestOutput.num_cached_tokens)
    pooled: bytes | None = None  # SequenceGroup.pooled, on a pooling request's one output
