"""The contract between the control plane (scheduler) and the data plane (workers).

Every message that crosses a process boundary is a dataclass defined here and encoded with
msgpack by `encode`/`decode`; nothing is pickled. A dataclass travels as a msgpack extension
holding `[type_tag, field values in declaration order]`, so nested messages need no schema. The
per-sequence lists of a step (a plan's cached sequences, a result's sampled tokens) travel as
columns instead, one list per field, so a step costs no extension per sequence.

Step plans are diffs: a sequence the worker has not seen (or has dropped) comes in full as a
`NewSequence`; afterwards it comes as a `CachedSequence` carrying only its new block ids, the
number of tokens scheduled and its last token. Both say how many tokens the sequence draws when
the step computes its last token (`num_samples`), so the worker applies no rule of its own;
common/plan_state.py keeps the worker's side of the diffs.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import msgpack

# 5: CachedSequence.last_token_id may be PENDING_TOKEN (async scheduling)
# 6: a StepPlan's cached_seqs and a StepResult's sampled travel as columns (_COLUMNS_OF)
# 7: CachedSequence.draft_token_ids and accepted_token_ids
# 8: CachedSequence.group_block_ids (KV cache groups)
# 9: WorkerHello.recurrent_state and state_checkpoints; StepPlan.state_forks, state_swapped_out and
#    state_saves; NewSequence.state_checkpoint (linear-attention layers' state, held by the worker)
PROTOCOL_VERSION = 9
_EXT_MESSAGE = 1


class ProtocolError(ValueError):
    """A message that could not be decoded or that breaks the contract."""


@dataclass(slots=True)
class SamplingParams:
    """What a request asks of the sampler and of the stop checks. Defaults follow OpenAI/vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    best_of: int | None = None  # sample this many, return the n of highest cumulative logprob
    beam_width: int = 0  # > 0: beam search (deterministic; the n best beams are returned)
    length_penalty: float = 1.0  # beam score = sum of logprobs / generated length ** length_penalty
    early_stopping: bool | str = False  # beam search: True, False or "never", as in transformers
    # appended (an older peer's SamplingParams still decodes)
    logit_bias: list[list] = field(default_factory=list)  # [[token_id, bias], ...]: added to the logits
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob, rank and top k
    structured_output: StructuredOutput | None = None  # a grammar the output must follow (worker/grammar.py)
    # a thinking model's output reasons until these tokens (its end-of-thinking tag): the grammar
    # applies after them, and `thinking_token_budget` reasoning tokens at most are drawn before
    # they are forced (worker/reasoning_gate.py); empty: the output is all answer
    reasoning_end_token_ids: list[int] = field(default_factory=list)
    thinking_token_budget: int | None = None
    # a pooling request (embeddings, classification scores): its prompt's hidden states pooled
    # into one vector (common/pooling.py); it computes its prompt and generates nothing
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        _require(1 <= self.n <= MAX_SAMPLES, "n", f"n must be in [1, {MAX_SAMPLES}]")
        _require(self.best_of is None or self.n <= self.best_of <= MAX_SAMPLES, "best_of",
                 f"best_of must be in [n, {MAX_SAMPLES}]")
        _require(0 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width", f"beam_width must be in [0, {MAX_BEAM_WIDTH}]")
        if self.beam_width:
            _require(self.n <= self.beam_width, "n", "with beam search, n must be <= beam_width")
            _require(self.best_of is None, "best_of", "best_of does not apply to beam search")
        _require(abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
                 f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        _require(self.early_stopping in (True, False, "never"), "early_stopping",
                 "early_stopping must be true, false or \"never\"")
        _require(self.temperature >= 0.0, "temperature", "temperature must be >= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _require(-1 <= self.top_k <= MAX_INT_PARAM, "top_k", f"top_k must be in [-1, {MAX_INT_PARAM}] (0 or -1: off)")
        _require(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        _require(abs(self.presence_penalty) <= MAX_PENALTY, "presence_penalty",
                 f"presence_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _require(abs(self.frequency_penalty) <= MAX_PENALTY, "frequency_penalty",
                 f"frequency_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0")
        _require(self.max_tokens is None or 0 <= self.max_tokens <= MAX_INT_PARAM, "max_tokens",
                 f"max_tokens must be in [0, {MAX_INT_PARAM}] (0: score the prompt, generate nothing)")
        _require(0 <= self.min_tokens <= MAX_INT_PARAM, "min_tokens", f"min_tokens must be in [0, {MAX_INT_PARAM}]")
        _require(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", "seed must fit in 64 bits")
        _require(all(0 <= t < 2**31 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be token ids")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", "min_tokens must be <= max_tokens",
        )
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                 f"logprobs must be in [0, {MAX_LOGPROBS}]")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                 f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                 f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries")
        _require(all(isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], int) and 0 <= e[0] < 2**31
                     and isinstance(e[1], (int, float)) and abs(e[1]) <= MAX_LOGIT_BIAS_VALUE for e in self.logit_bias),
                 "logit_bias", f"logit_bias must map token ids to biases in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                               f"{MAX_LOGIT_BIAS_VALUE:g}]")
        if self.structured_output is not None:
            _require(isinstance(self.structured_output, StructuredOutput)
                     and self.structured_output.kind in STRUCTURED_OUTPUT_KINDS, "structured_output",
                     f"structured_output.kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
            _require(not self.beam_width, "structured_output", "structured output does not apply to beam search")
        _require(all(isinstance(t, int) and 0 <= t < 2**31 for t in self.reasoning_end_token_ids),
                 "reasoning_end_token_ids", "reasoning_end_token_ids must be token ids")
        if self.thinking_token_budget is not None:
            _require(0 <= self.thinking_token_budget <= MAX_INT_PARAM, "thinking_token_budget",
                     f"thinking_token_budget must be in [0, {MAX_INT_PARAM}]")
            _require(bool(self.reasoning_end_token_ids), "thinking_token_budget",
                     "thinking_token_budget needs the tokens that end the thinking (a reasoning parser)")
            _require(not self.beam_width, "thinking_token_budget", "a thinking budget does not apply to beam search")
        if self.pooling is not None:
            _require(isinstance(self.pooling, PoolingParams), "pooling", "pooling must be PoolingParams")
            self.pooling.validate()
            _require(self.max_tokens == 0 and self.n == 1 and not self.beam_width and self.best_of is None
                     and self.prompt_logprobs is None, "pooling",
                     "a pooling request computes its prompt only: max_tokens 0, n 1, no beams or prompt logprobs")


MAX_INT_PARAM = 1 << 24  # bounds every count a request names, so none overflows a tensor
MAX_SAMPLES = 128  # n and best_of
MAX_BEAM_WIDTH = 32
# Beam scores are divided by length ** length_penalty in float32; for every length up to
# MAX_INT_PARAM this bound keeps that divisor finite and nonzero (a larger |length_penalty|
# overflowed it, or divided by zero, and took the scheduler down).
MAX_LENGTH_PENALTY = 5.0
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty|, as OpenAI's
MAX_LOGPROBS = 20  # top alternatives reported per token
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI's
MAX_LOGIT_BIAS_VALUE = 100.0
# json_schema: spec is the schema as JSON text, in its own key order (the output keeps it); json_object:
# any JSON object, spec ""; regex: spec is the pattern; choice: spec is a JSON list of the strings
# allowed; grammar: spec is an EBNF grammar (xgrammar's dialect, vLLM's guided_grammar). (kind, spec)
# is the worker's grammar cache key.
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


POOLING_TYPES = ("last", "mean", "cls")  # the token whose hidden state is the vector, or the mean of all
POOLING_TASKS = ("embed", "classify")


@dataclass(slots=True)
class PoolingParams:
    """How a pooling request's prompt becomes its vector: the hidden states of its tokens pooled
    (`pooling_type`), then for "classify" the model's classifier head and its activation (sigmoid
    for one label, softmax for more), or for "embed" an L2 normalization when `normalize`."""

    task: str = "embed"
    pooling_type: str = "last"
    normalize: bool = False

    @property
    def reads_every_token(self) -> bool:
        """Whether every prompt position must be computed by this request's own steps (no prefix-cache hit)."""
        return self.pooling_type != "last"

    def validate(self) -> None:
        _require(self.task in POOLING_TASKS, "pooling", f"pooling task must be one of {', '.join(POOLING_TASKS)}")
        _require(self.pooling_type in POOLING_TYPES, "pooling",
                 f"pooling_type must be one of {', '.join(POOLING_TYPES)}")


@dataclass(slots=True)
class StructuredOutput:
    """What a constrained request's output must follow, compiled once per distinct (kind, spec) by
    the worker (worker/grammar.py) and checked by the gateway before the request is queued."""

    kind: str
    spec: str = ""


def num_beam_candidates(beam_width: int, num_eos_tokens: int) -> int:
    """Continuations kept per beam search step (transformers' rule): enough that `beam_width`
    of them go on even when the best ones all end in an EOS token."""
    return max(2, 1 + num_eos_tokens) * beam_width


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a seeded request (sample 0 keeps the request's seed)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


class InvalidParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParamError(param, message)


# ----------------------------------------------------------------------------- step plan

NULL_BLOCK = 0  # pads block tables; never allocated to a sequence
# A CachedSequence's last_token_id in a plan made while the step that samples that token still
# runs (async scheduling): the worker appends the token it sampled itself for the sequence in
# the step before (common/plan_state.py).
PENDING_TOKEN = -1


@dataclass(slots=True)
class MultiModalItem:
    """One image of a prompt: its placeholder tokens [offset, offset + length) of the prompt take
    the rows of its encoder output (docs/vision.md). The gateway writes those positions' token ids
    as `common.multimodal.placeholder_ids(hash, length)`, never vocabulary ids, so the prefix cache's block
    keys and the router's hashes tell two images apart with no rule of their own."""

    hash: bytes  # SHA-256 of the processed pixels: the encoder cache's key
    offset: int
    length: int
    data: bytes  # the processor's tensors (common.multimodal.pack_arrays)
    bidirectional: bool = False  # its tokens attend to each other both ways (Gemma 3): a chunk never splits it
    # the placeholders' (t, h, w) layout where the language model rotates them by it (Qwen-VL's M-RoPE)
    grid: list[int] = field(default_factory=list)


@dataclass(slots=True)
class NewSequence:
    """A sequence in full: first scheduled, or rescheduled after the worker dropped it."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling_params: SamplingParams
    num_samples: int = 1  # tokens drawn if this step computes its last token (best_of for a first token)
    lora_slot: int = -1  # the workers' adapter slot its tokens use (-1: the base model alone)
    mm_items: list[MultiModalItem] = field(default_factory=list)  # its prompt's images, in order
    # a model with KV cache groups (WorkerHello.kv_groups): the tables of groups 1.. (block_ids is group 0's)
    group_block_ids: list[list[int]] = field(default_factory=list)
    # a model with recurrent state whose prefix-cache hit ends at a block with a saved state: the
    # checkpoint slot it starts from (scheduler/state_cache.py); -1: none
    state_checkpoint: int = -1


@dataclass(slots=True)
class CachedSequence:
    """A sequence the worker already holds: only what changed since the last plan."""

    seq_id: int
    new_block_ids: list[int]  # replace the held table from block_table_offset on
    block_table_offset: int  # the held length, or one less after a copy-on-write of the last block
    num_scheduled_tokens: int
    last_token_id: int  # the newest token, appended if the worker lacks it; PENDING_TOKEN: the one it sampled last step
    num_samples: int = 1  # tokens drawn if this step computes its last token
    # draft tokens proposed after last_token_id: the step computes them too (after its
    # last token, num_scheduled_tokens = 1 + len(drafts)) and verifies them, emitting the accepted
    # ones and one more (docs/speculative.md). The worker does not keep them.
    draft_token_ids: list[int] = field(default_factory=list)
    # the drafts the sequence's last verification accepted: appended before last_token_id, their KV
    # already written by that step (counted computed)
    accepted_token_ids: list[int] = field(default_factory=list)
    # KV cache groups 1.. (WorkerHello.kv_groups): each one's table from block_table_offset on
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    step: int
    epoch: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    cached_seqs: list[CachedSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop state, blocks already freed
    preempted_seq_ids: list[int] = field(default_factory=list)  # drop state, will come back new
    blocks_to_copy: list[list[int]] = field(default_factory=list)  # copy-on-write (src, dst)
    blocks_to_swap_in: list[list[int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_swap_out: list[list[int]] = field(default_factory=list)  # (gpu, cpu)
    # adapters to load before the step: [[slot, LoRARequest], ...] (a slot no sequence of
    # the step or of a step in flight uses; the scheduler pins an adapter while it runs)
    lora_loads: list[list] = field(default_factory=list)
    # a model with recurrent state (WorkerHello.recurrent_state; worker/recurrent_state.py): [parent,
    # child] sequences forked since the last plan (the child starts from the parent's state as it is
    # before this plan), and the sequences this plan swaps out (the worker keeps their state until
    # they come back)
    state_forks: list[list[int]] = field(default_factory=list)
    state_swapped_out: list[int] = field(default_factory=list)
    # [seq_id, position, slot]: save the sequence's state after its first `position` tokens (a block
    # boundary this step passes) into checkpoint slot `slot` (scheduler/state_cache.py)
    state_saves: list[list[int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.cached_seqs
        )


@dataclass(slots=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: list[list] = field(default_factory=list)  # [[token_id, logprob], ...], best first


@dataclass(slots=True)
class PromptLogprobs:
    """The logprobs of prompt tokens one step computed for one sequence (prompt_logprobs): the
    tokens at positions [start, start + len(logprobs)), each scored by the logits of the position
    before it, so start >= 1 (the first prompt token has none)."""

    seq_id: int
    start: int
    logprobs: list[float]
    ranks: list[int]  # 1 + how many tokens the model found likelier than the prompt's
    top: list[list[list]]  # per token: [[token_id, logprob], ...], best first (prompt_logprobs of them)


@dataclass(slots=True)
class PooledOutput:
    """A pooling request's vector, computed in the step that computed its last prompt token:
    float32 values, little-endian (as OpenAI's base64 embeddings carry them)."""

    seq_id: int
    data: bytes


@dataclass(slots=True)
class StepResult:
    step: int
    epoch: int
    sampled: list[SampledToken] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # only sequences that ask
    # adapters the plan's lora_loads could not load: [[slot, what went wrong], ...] (the slot
    # is left empty; the scheduler fails the requests that use it, and only those)
    lora_errors: list[list] = field(default_factory=list)
    pooled: list[PooledOutput] = field(default_factory=list)  # pooling requests whose prompt ended this step
    # images the step needed, and of them those the encoder cache held (worker/multimodal.py)
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    recompiles: int = 0  # graphs the compiled CPU decode step compiled while serving, since the last step


@dataclass(slots=True)
class WorkerHello:
    """A worker's capacity, sent once it has loaded the model and sized its KV pool."""

    rank: int
    world_size: int
    device: str
    model: str
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_bytes_per_block: int
    host_bandwidth: float  # bytes/s between device and swap pool, measured
    prefill_tokens_per_s: float  # measured
    # Every layer attends only to its last `sliding_window` keys (Mistral v0.1): the scheduler frees
    # the blocks wholly outside the window as a sequence grows. None when any layer is global.
    sliding_window: int | None = None
    quantization: str = "none"  # the linear layers' scheme, described (worker/quantization)
    kv_cache_dtype: str = ""  # the KV pools' element type ("bfloat16", "float8_e4m3fn"); kv_bytes_per_block counts it
    pooling_task: str = ""  # a pooling model's task (common/pooling.py): "embed" or "classify"; "" for generation
    encoder: bool = False  # its layers attend both ways: a prompt is computed whole in one step (no chunks)
    # its vision encoder's images (common/multimodal.py): "" none; "bidirectional" (Gemma 3: an
    # image's tokens attend to each other both ways); "mrope" (Qwen-VL: causal, each with its grid)
    images: str = ""
    # its KV cache groups (scheduler/kv_groups.py), each one's sliding window, 0 for global
    # attention; empty when the model has one group (its sliding_window, if any, is every layer's)
    kv_groups: list[int] = field(default_factory=list)
    # its linear-attention layers keep a recurrent state per sequence (Qwen3-Next; worker/recurrent_state.py),
    # which the worker holds with the sequence (StepPlan.state_forks, state_swapped_out, state_saves)
    recurrent_state: bool = False
    state_checkpoints: int = 0  # its checkpoint slots for the states at cached blocks' ends (prefix caching)


# ----------------------------------------------------------------------------- requests (Redis)


@dataclass(slots=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's LoRARequest): `lora_name` is what a client names as
    its model, `lora_int_id` a positive id stable for the name (the KV events' lora_id), `lora_path`
    the PEFT directory the workers load it from. (id, path) keys it in the slots and the prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        _require(bool(self.lora_name), "lora_name", "a LoRA adapter needs a name")
        _require(isinstance(self.lora_int_id, int) and 0 < self.lora_int_id < 2**31, "lora_int_id",
                 "lora_int_id must be in [1, 2**31)")

    @property
    def key(self) -> tuple[int, str]:
        return self.lora_int_id, self.lora_path


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized, validated request, put on the requests stream by a gateway."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    reply_stream: str  # the gateway process's reply stream
    arrival_time: float  # time.time() at the gateway
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names
    mm_items: list[MultiModalItem] = field(default_factory=list)  # its prompt's images, in order


@dataclass(slots=True)
class RequestEvent:
    """What one output of a request gained in one step, written by a scheduler to the request's
    reply stream.

    `finish_reason` is None while the output runs, else "stop", "length", "abort" or "error"
    (with `error` saying what went wrong); it is that output's last event. A request with
    best_of > n or beam search sends its n outputs whole, in one step, best first.
    """

    request_id: str
    token_ids: list[int]  # the new tokens
    logprobs: list[list] | None  # per new token: [logprob, [[token_id, logprob], ...]]
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # which output of the request (n > 1); "error" and "abort" end them all
    # The request's token-bearing events, numbered from 1 by its scheduler; 0 on events without
    # tokens. A gateway drops one it has already seen (a Redis write retried after a timeout).
    seq: int = 0
    # time.time() at the scheduler when the request was first scheduled, on its first token-bearing
    # event (0.0 otherwise): the gateway's queue and prefill times (vLLM's metrics)
    scheduled_at: float = 0.0
    # prompt_logprobs, on the request's first event that carries an output's tokens or its end (any
    # index): per prompt token, None for the first, else [logprob, rank, [[token_id, logprob], ...]]
    prompt_logprobs: list | None = None
    # prompt tokens found in the prefix cache, beside scheduled_at (usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # a pooling request's vector (PooledOutput.data), on its one event
    embedding: bytes | None = None


@dataclass(slots=True)
class SchedulerStatus:
    """A scheduler's heartbeat and gauges, refreshed twice a second under a short TTL."""

    scheduler_id: str
    model: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_request_tokens: int  # the most KV one request may ever hold (the pool less its watermark)
    workers_ready: bool
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    updated_at: float
    # the rest of what common/admission.py checks a request against
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    engine: str = "0"  # the scheduler's --engine-id: the `engine` label of its /metrics series
    # the swap pool, sharing and the memory counters (gateway/metrics.py)
    num_cpu_blocks: int = 0
    cpu_cache_usage: float = 0.0  # 0..1, the swap pool
    num_shared_blocks: int = 0  # device blocks held by more than one table
    num_blocks_saved_by_sharing: int = 0  # blocks in tables less distinct blocks held
    num_cow_copies_total: int = 0
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    num_prefix_evictions_total: int = 0
    # tokens per step, counted per bucket of ITERATION_TOKENS_BUCKETS and one more for +Inf (not cumulative)
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # the KV cache's configuration (vLLM's cache_config_info): its element type and one block's bytes
    kv_cache_dtype: str = ""
    kv_bytes_per_block: int = 0
    # the prompt tokens of the waiting requests (the gateway's --max-num-queued-tokens)
    num_waiting_tokens: int = 0
    # the adapters of the running and of the waiting requests (vLLM's lora_requests_info),
    # the workers' slots, and the adapters loaded into them and evicted from them so far
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_loras: int = 0  # 0: LoRA off
    num_lora_loads_total: int = 0
    num_lora_evictions_total: int = 0
    # the workers' measured prefill rate (the gateway's --ttft-slo-ms predicts by it)
    prefill_tokens_per_s: float = 0.0
    # the prefix cache's CPU tier (--cpu-prefix-cache): its hits in tokens, the
    # blocks it holds, the blocks stored into it so far
    cpu_prefix_cache_hits_total: int = 0
    num_cpu_prefix_cache_blocks: int = 0
    num_cpu_prefix_cache_stores_total: int = 0
    # requests read from this engine group's own stream (a router sent them), from
    # the shared stream, and stolen from another group's stream (left unread there)
    num_routed_total: int = 0
    num_shared_total: int = 0
    num_stolen_total: int = 0
    # vLLM's spec_decode counters: verifications with drafts, draft tokens, accepted
    # drafts, and per draft position how often it was accepted
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    draining: bool = False  # SIGTERM: finishing what it runs, taking nothing new (routers pass it over)
    pooling_task: str = ""  # WorkerHello.pooling_task: what its engine serves (common/admission.py)
    mm_encoder_cache_queries_total: int = 0  # images a step needed encoded (StepResult.encoder_cache_queries)
    mm_encoder_cache_hits_total: int = 0
    compiled_step_recompiles_total: int = 0  # StepResult.recompiles, summed (0 without --compile)


# vLLM's `iteration_tokens_total` buckets
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class HeldRequests:
    """The requests a scheduler holds, published when it finds Redis restarted (a new run_id): a
    gateway fails only those that neither a scheduler holds nor the new Redis has."""

    scheduler_id: str
    request_ids: list[str]


# ----------------------------------------------------------------------------- memory (dashboard)


@dataclass(slots=True)
class MemoryEvent:
    """Something that happened to KV blocks (scheduler/memory_view.py lists the kinds)."""

    id: int  # from 1, per scheduler
    step: int
    time: float  # time.time()
    kind: str
    request_id: str  # "" for prefix-cache evictions
    seq_id: int  # -1 when the event is the request's, not one sequence's
    # the blocks concerned (cow: [src, dst]; swaps: the device blocks), packed by
    # common/memory_snapshot.pack_ints: the first scheduler/memory_view.MAX_EVENT_BLOCKS (32) of them
    blocks: bytes
    num_blocks: int  # how many blocks are concerned: more than `blocks` holds past the first 32


@dataclass(slots=True)
class MemorySnapshot:
    """One scheduler's block manager as the dashboard draws it; JSON by common/memory_snapshot.py.

    Reference counts travel packed by common/memory_snapshot.pack_ints, one per block id (the null
    block 0 included, always 0): one byte each unless a count passes 255; `sequences` as rows
    [request_id, seq_id, status, num_tokens, num_slots, pool, block_table] (pool "gpu" or "cpu";
    block_table packed by pack_ints). common/memory_snapshot.snapshot_json unpacks them all.
    """

    engine: str
    scheduler_id: str
    time: float
    step: int
    version: int  # per publisher, from 1: advances whenever the memory may have changed
    block_size: int
    num_gpu_blocks: int  # the device pool, the null block included
    num_cpu_blocks: int
    ref_counts: bytes
    cpu_ref_counts: bytes
    cached: list[int]  # device blocks held only by the prefix cache (reference count 0, evictable)
    sequences: list[list]
    events: list[MemoryEvent]  # the latest, oldest first
    stats: dict  # common/memory_snapshot.py STATS
    # swap-pool blocks held only by the prefix cache's CPU tier (--cpu-prefix-cache)
    cpu_cached: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------- codec

_MESSAGE_TYPES: list[type] = [  # append only: a message's tag is its index
    SamplingParams, NewSequence, CachedSequence, StepPlan, SampledToken, StepResult, WorkerHello,
    GenerateRequest, RequestEvent, SchedulerStatus, HeldRequests, MemoryEvent, MemorySnapshot,
    StructuredOutput, PromptLogprobs, LoRARequest, PoolingParams, PooledOutput, MultiModalItem,
]
_TAG_OF = {cls: tag for tag, cls in enumerate(_MESSAGE_TYPES)}
_FIELDS_OF = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _MESSAGE_TYPES}
# Fields appended to a message within a protocol version, each with a default: a peer that predates
# them sends the message without them (a status key written by an older scheduler still decodes).
_ADDED_FIELDS: dict[type, int] = {  # how many, per message
    SchedulerStatus: 35, RequestEvent: 4, SamplingParams: 6, StepResult: 6, WorkerHello: 8,
    NewSequence: 3, StepPlan: 4, GenerateRequest: 2, MemorySnapshot: 1, MultiModalItem: 0,
}
_VALUES_OF = {cls: operator.attrgetter(*names) for cls, names in _FIELDS_OF.items()}  # each has 2+ fields
# List fields of the hot messages (one entry per sequence of a step, or per memory event) travel as
# columns, one list per field of the element type in declaration order, not one extension per element.
_COLUMNS_OF: dict[type, dict[int, type]] = {
    StepPlan: {_FIELDS_OF[StepPlan].index("cached_seqs"): CachedSequence},
    StepResult: {_FIELDS_OF[StepResult].index("sampled"): SampledToken},
    MemorySnapshot: {_FIELDS_OF[MemorySnapshot].index("events"): MemoryEvent},
}


def _to_columns(items: list, cls: type) -> list[list]:
    if not items:
        return [[] for _ in _FIELDS_OF[cls]]
    if set(map(type, items)) != {cls}:
        raise TypeError(f"cannot encode a list of {cls.__name__} holding another type")
    return list(zip(*map(_VALUES_OF[cls], items)))  # tuples: msgpack packs them as arrays


def _from_columns(columns: Any, cls: type) -> list:
    names = _FIELDS_OF[cls]
    if not isinstance(columns, list) or len(columns) != len(names):
        got = len(columns) if isinstance(columns, list) else type(columns).__name__
        raise ProtocolError(f"{cls.__name__} expects {len(names)} columns, got {got}")
    if not all(isinstance(column, list) and len(column) == len(columns[0]) for column in columns):
        raise ProtocolError(f"{cls.__name__} columns differ in length")
    return list(map(cls, *columns))


def _default(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    tag = _TAG_OF.get(cls)
    if tag is None:
        raise TypeError(f"cannot encode {cls.__name__}: not a protocol message")
    values = [tag, *_VALUES_OF[cls](obj)]
    for index, item_cls in _COLUMNS_OF.get(cls, {}).items():
        values[index + 1] = _to_columns(values[index + 1], item_cls)
    return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb(values, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        raise ProtocolError(f"unknown msgpack extension {code}")
    tag, *values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, use_list=True, strict_map_key=False)
    if not isinstance(tag, int) or not 0 <= tag < len(_MESSAGE_TYPES):
        raise ProtocolError(f"unknown message tag {tag!r}")
    cls = _MESSAGE_TYPES[tag]
    names = _FIELDS_OF[cls]
    if not len(names) - _ADDED_FIELDS.get(cls, 0) <= len(values) <= len(names):
        raise ProtocolError(f"{cls.__name__} expects {len(names)} fields, got {len(values)}")
    for index, item_cls in _COLUMNS_OF.get(cls, {}).items():
        values[index] = _from_columns(values[index], item_cls)
    try:
        return cls(*values)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"invalid {cls.__name__}: {exc}") from exc


def encode(message: Any) -> bytes:
    """Encode a protocol message (with the protocol version) to bytes."""
    return msgpack.packb([PROTOCOL_VERSION, message], default=_default, use_bin_type=True)


def decode_events(data: bytes) -> list[RequestEvent]:
    """A reply-stream entry: every event one flush of a scheduler wrote for that gateway (a list),
    or one event (a scheduler of before the batched return path). ProtocolError otherwise."""
    message = decode(data)
    events = message if isinstance(message, list) else [message]
    if not all(isinstance(event, RequestEvent) for event in events):
        raise ProtocolError("a reply entry holds RequestEvents only")
    return events


def decode(data: bytes) -> Any:
    """Decode bytes from `encode`; raises ProtocolError on anything malformed. The version is read
    first: a peer of another version is refused by it, not by what its message holds."""
    unpacker = msgpack.Unpacker(ext_hook=_ext_hook, raw=False, strict_map_key=False, max_buffer_size=len(data))
    try:
        unpacker.feed(data)
        if unpacker.read_array_header() != 2:
            raise ValueError("not a [version, message] pair")
        version = unpacker.unpack()
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}")
        message = unpacker.unpack()
        if unpacker.tell() != len(data):
            raise ValueError("extra data after the message")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable message: {exc}") from exc
    return message
