"""common/protocol.py and common/config.py: the codec round-trips, refuses what breaks the contract,
and invalid parameters or settings fail with errors that name what was wrong."""
import dataclasses

import msgpack
import pytest

from common import protocol
from common.config import ConfigError, EngineConfig
from common.protocol import (
    PROTOCOL_VERSION, CachedSequence, decode_events, GenerateRequest, HeldRequests, InvalidParamError, MemoryEvent, MemorySnapshot,
    LoRARequest, MultiModalItem, NewSequence, PooledOutput, PoolingParams, PromptLogprobs, ProtocolError, StructuredOutput,
    RequestEvent, SampledToken, SamplingParams, SchedulerStatus, StepPlan, StepResult, WorkerHello, decode, encode,
)

FULL_PARAMS = SamplingParams(
    n=1, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=1234, presence_penalty=0.5,
    frequency_penalty=-0.5, repetition_penalty=1.1, max_tokens=None, min_tokens=3,
    stop_token_ids=[7, 8], ignore_eos=True, logprobs=5, logit_bias=[[5, -100.0], [6, 2.5]], prompt_logprobs=2,
    structured_output=StructuredOutput("json_schema", '{"type": "object"}'),
    reasoning_end_token_ids=[11, 12], thinking_token_budget=64,
)
NEW_SEQ = NewSequence(
    seq_id=3, prompt_token_ids=[1, 2, 3, 4], output_token_ids=[9], block_ids=[5, 6],
    num_computed_tokens=0, num_scheduled_tokens=5, sampling_params=FULL_PARAMS, num_samples=3,
)
CACHED_SEQ = CachedSequence(
    seq_id=4, new_block_ids=[11], block_table_offset=2, num_scheduled_tokens=1, last_token_id=42, num_samples=2,
)
PLAN = StepPlan(
    step=17, epoch=2, new_seqs=[NEW_SEQ], cached_seqs=[CACHED_SEQ, CachedSequence(5, [], 3, 16, 0)],
    finished_seq_ids=[1, 2], preempted_seq_ids=[9], blocks_to_copy=[[3, 12]],
    blocks_to_swap_in=[[0, 13]], blocks_to_swap_out=[[14, 1]],
)
SAMPLED = SampledToken(seq_id=4, token_id=77, logprob=-0.125, top_logprobs=[[77, -0.125], [78, -2.5]])
RESULT = StepResult(step=17, epoch=2, sampled=[SAMPLED, SampledToken(3, 5, -1.0)], error=None)
HELLO = WorkerHello(
    rank=0, world_size=2, device="cuda:0", model="SmolLM2-135M-Instruct", num_gpu_blocks=4096,
    num_cpu_blocks=512, block_size=16, max_model_len=8192, vocab_size=49152, eos_token_ids=[0, 2],
    kv_bytes_per_block=1 << 20, host_bandwidth=2.5e10, prefill_tokens_per_s=12345.5,
)
REQUEST = GenerateRequest("cmpl-1", [1, 2, 3], FULL_PARAMS, "pagoda:replies:gw1", 1.7e9)
EVENT = RequestEvent("cmpl-1", [5, 6], [[-0.5, [[5, -0.5]]], [-1.0, [[6, -1.0]]]], "length")
STATUS = SchedulerStatus(
    scheduler_id="host-1", model="SmolLM2-135M-Instruct", max_model_len=8192, block_size=16, num_gpu_blocks=100,
    max_request_tokens=1584,
    workers_ready=True, num_running=2, num_waiting=1, num_swapped=0, kv_cache_usage=0.25, num_preemptions_total=3,
    prefix_cache_queries_total=10, prefix_cache_hits_total=4, updated_at=1.7e9, engine="2",
    num_cpu_blocks=8, cpu_cache_usage=0.5, num_shared_blocks=3, num_blocks_saved_by_sharing=6, num_cow_copies_total=2,
    num_swapped_out_blocks_total=4, num_swapped_in_blocks_total=4, num_prefix_evictions_total=1,
    iteration_tokens=[0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], iteration_tokens_sum=5,
)
MEMORY_EVENT = MemoryEvent(3, 17, 1.7e9, "cow", "cmpl-1", 4, [3, 12], 2)
SNAPSHOT = MemorySnapshot(
    engine="0", scheduler_id="host-1", time=1.7e9, step=17, version=5, block_size=16, num_gpu_blocks=4,
    num_cpu_blocks=2, ref_counts=bytes(4) + (2).to_bytes(4, "little") * 2 + bytes(4), cpu_ref_counts=bytes(8),
    cached=[3], sequences=[["cmpl-1", 4, "running", 20, 20, "gpu", [1, 2]], ["cmpl-1", 5, "running", 20, 20, "gpu", [1, 2]]],
    events=[MEMORY_EVENT], stats={"num_running": 1},
)
MESSAGES = [
    SamplingParams(), FULL_PARAMS, NEW_SEQ, CACHED_SEQ, StepPlan(1, 0), PLAN, SAMPLED, RESULT,
    StepResult(3, 0, error="CUDA out of memory"), HELLO, REQUEST, EVENT,
    RequestEvent("cmpl-2", [], None, "error", "the worker failed"), STATUS, HeldRequests("host-1", ["cmpl-1", "cmpl-2"]),
    MEMORY_EVENT, SNAPSHOT, StructuredOutput("json_object"), PromptLogprobs(2, 3, [-1.5], [4], [[]]),
    StepResult(4, 0, [SAMPLED], None, [PromptLogprobs(4, 1, [-0.5, -2.0], [1, 7], [[[9, -0.25]], [[3, -1.0]]])]),
    RequestEvent("cmpl-3", [], None, "length", prompt_logprobs=[None, [-0.5, 1, [[9, -0.25]]]]),
    # LoRA: a request naming an adapter, a plan loading it into slot 1 for a new sequence
    LoRARequest("sql", 7, "/adapters/sql"),
    GenerateRequest("cmpl-4", [1, 2], SamplingParams(), "pagoda:replies:gw1", 1.7e9, LoRARequest("sql", 7, "/a")),
    StepPlan(18, 2, [dataclasses.replace(NEW_SEQ, lora_slot=1)], lora_loads=[[1, LoRARequest("sql", 7, "/a")]]),
    # images: a request's, and a new sequence's (common/multimodal.py)
    MultiModalItem(b"h" * 32, 1, 2, b"\x81\xa1a\x90", True),
    GenerateRequest("cmpl-5", [1, 2, 3], SamplingParams(), "r", 1.0, None, [MultiModalItem(b"i" * 32, 1, 2, b"")]),
    StepPlan(19, 2, [dataclasses.replace(NEW_SEQ, mm_items=[MultiModalItem(b"i" * 32, 1, 2, b"px")])]),
    StepResult(5, 0, encoder_cache_queries=2, encoder_cache_hits=1), StepResult(6, 0, recompiles=1),
    dataclasses.replace(STATUS, running_lora_adapters=["sql"], waiting_lora_adapters=["chat", "sql"], max_loras=4,
                        num_lora_loads_total=3, num_lora_evictions_total=1),
    # pooling: a request's params, a worker's vector, the event that carries it
    PoolingParams("classify", "mean", True), SamplingParams(max_tokens=0, pooling=PoolingParams()),
    PooledOutput(2, b""), StepResult(5, 0, pooled=[PooledOutput(3, b"\x00\x00\x80?" * 2)]),
    RequestEvent("pool-1", [], None, "length", embedding=b"\x00\x00\x80?"),
]


def test_every_message_type_is_covered():
    assert {type(m) for m in MESSAGES} == set(protocol._MESSAGE_TYPES)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_equal(message):
    data = encode(message)
    assert isinstance(data, bytes)
    decoded = decode(data)
    assert type(decoded) is type(message)
    assert decoded == message


def test_nested_messages_come_back_as_their_types():
    plan = decode(encode(PLAN))
    assert type(plan.new_seqs[0]) is NewSequence
    assert type(plan.new_seqs[0].sampling_params) is SamplingParams
    assert type(plan.cached_seqs[1]) is CachedSequence
    assert plan.num_scheduled_tokens == 5 + 1 + 16
    result = decode(encode(RESULT))
    assert [type(s) for s in result.sampled] == [SampledToken, SampledToken]


def test_plain_values_and_containers_round_trip():
    value = {"step": 1, "ids": [1, 2, 3], "params": SamplingParams(temperature=0.0)}
    assert decode(encode(value)) == value


def test_encoding_a_non_protocol_object_fails():
    @dataclasses.dataclass
    class NotAMessage:
        x: int = 1

    with pytest.raises(TypeError, match="not a protocol message"):
        encode(NotAMessage())


# ----------------------------------------------------------------------------- malformed input


def _ext(tag, *values) -> msgpack.ExtType:
    return msgpack.ExtType(protocol._EXT_MESSAGE, msgpack.packb([tag, *values], use_bin_type=True))


def _body(data: bytes) -> list:
    """The outer message of encoded bytes as [tag, field values], nested messages left as extensions."""
    _, ext = msgpack.unpackb(data, raw=False)
    return msgpack.unpackb(ext.data, raw=False)


def _tag(cls) -> int:
    return protocol._MESSAGE_TYPES.index(cls)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\xff\xfe\xfd", b"garbage bytes that are not msgpack", b"\x92\x01",
    msgpack.packb(5), msgpack.packb([PROTOCOL_VERSION]), msgpack.packb([1, 2, 3]),
], ids=["empty", "reserved-byte", "random", "text", "truncated", "not-a-list", "one-item", "three-items"])
def test_garbage_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_a_wrong_protocol_version_is_a_protocol_error():
    data = msgpack.packb([PROTOCOL_VERSION + 1, _ext(_tag(SampledToken), 1, 2, -0.5, [])], use_bin_type=True)
    with pytest.raises(ProtocolError, match="version"):
        decode(data)
    good = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SampledToken), 1, 2, -0.5, [])], use_bin_type=True)
    assert decode(good) == SampledToken(1, 2, -0.5, [])


@pytest.mark.parametrize("tag", [len(protocol._MESSAGE_TYPES), 99, -1, "StepPlan", None])
def test_an_unknown_tag_is_a_protocol_error(tag):
    data = msgpack.packb([PROTOCOL_VERSION, _ext(tag, 1, 2)], use_bin_type=True)
    with pytest.raises(ProtocolError, match="tag"):
        decode(data)


def test_an_unknown_extension_code_is_a_protocol_error():
    data = msgpack.packb([PROTOCOL_VERSION, msgpack.ExtType(7, b"\x90")], use_bin_type=True)
    with pytest.raises(ProtocolError, match="extension"):
        decode(data)


@pytest.mark.parametrize("values", [[1, 2, -0.5], [1, 2, -0.5, [], "extra"], []])
def test_a_wrong_field_count_is_a_protocol_error(values):
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SampledToken), *values)], use_bin_type=True)
    with pytest.raises(ProtocolError, match="expects 4 fields"):
        decode(data)


def test_a_status_from_a_scheduler_before_the_engine_field_decodes_with_the_defaults():
    """A scheduler from before data parallelism (no `engine`), the memory counters, the KV cache dtype
    and block bytes, the waiting tokens, LoRA adapters, the prefill rate (--ttft-slo-ms), the CPU
    tier's counters and the routing counters, speculative decoding's counters, `draining`, the
    pooling task, the encoder cache's counters, or the compiled step's recompiles."""
    new_fields = [f for f in dataclasses.fields(SchedulerStatus)][-35:]
    old = _body(encode(STATUS))[1:-35]  # every field but the 35 appended
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SchedulerStatus), *old)], use_bin_type=True)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in new_fields}
    assert decode(data) == dataclasses.replace(STATUS, **defaults)
    assert decode(data).engine == "0"
    short = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SchedulerStatus), *old[:-1])], use_bin_type=True)
    with pytest.raises(ProtocolError, match="SchedulerStatus expects 53 fields, got 17"):
        decode(short)


def test_an_event_from_a_scheduler_before_scheduled_at_decodes_as_0():
    old = _body(encode(dataclasses.replace(EVENT, scheduled_at=1.5, prompt_logprobs=[None], num_cached_tokens=3)))[1:-4]
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(RequestEvent), *old)], use_bin_type=True)
    assert decode(data) == EVENT and EVENT.scheduled_at == 0.0 and EVENT.prompt_logprobs is None


def test_an_event_from_a_scheduler_before_cached_tokens_decodes_as_0():
    old = _body(encode(dataclasses.replace(EVENT, num_cached_tokens=32)))[1:-2]
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(RequestEvent), *old)], use_bin_type=True)
    assert decode(data) == EVENT and EVENT.num_cached_tokens == 0
    assert decode(encode(dataclasses.replace(EVENT, num_cached_tokens=32))).num_cached_tokens == 32


def test_sampling_params_from_a_gateway_before_openai_api_decode_with_the_defaults():
    """A gateway older than the OpenAI API's extra fields sends SamplingParams without its last 6."""
    old = _body(encode(FULL_PARAMS))[1:-6]
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SamplingParams), *old)], use_bin_type=True)
    assert decode(data) == dataclasses.replace(FULL_PARAMS, logit_bias=[], prompt_logprobs=None,
                                               structured_output=None, reasoning_end_token_ids=[],
                                               thinking_token_budget=None)


@pytest.mark.parametrize("params, param", [
    (dict(logit_bias=[[1, 2.0]] * 301), "logit_bias"), (dict(logit_bias=[[1, 100.5]]), "logit_bias"),
    (dict(logit_bias=[[-1, 1.0]]), "logit_bias"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(structured_output=StructuredOutput("yaml")), "structured_output"),
    (dict(structured_output=StructuredOutput("json_object"), beam_width=2), "structured_output"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(pooling=PoolingParams()), "pooling"), (dict(max_tokens=0, n=2, pooling=PoolingParams()), "pooling"),
    (dict(max_tokens=0, pooling=PoolingParams("rank")), "pooling"),
    (dict(max_tokens=0, pooling=PoolingParams(pooling_type="max")), "pooling"),
    (dict(thinking_token_budget=4), "thinking_token_budget"),
    (dict(reasoning_end_token_ids=[1], thinking_token_budget=-1), "thinking_token_budget"),
    (dict(reasoning_end_token_ids=[-1]), "reasoning_end_token_ids"),
])
def test_openai_api_params_out_of_bounds_name_the_param(params, param):
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**params)
    assert info.value.param == param


def test_a_wrong_field_count_deep_inside_a_plan_is_a_protocol_error():
    bad_seqs = [[1], [[]], [0], [1]]  # 4 of 9 columns
    plan = _ext(_tag(StepPlan), 1, 0, [], bad_seqs, [], [], [], [], [])
    with pytest.raises(ProtocolError, match="CachedSequence expects 9 columns, got 4"):
        decode(msgpack.packb([PROTOCOL_VERSION, plan], use_bin_type=True))


def test_the_step_lists_travel_as_columns():
    """A plan's cached sequences and a result's sampled tokens are one list per field, in declaration
    order, not one extension per element (protocol 6; drafts and accepted drafts since 7, KV cache groups since 8)."""
    body = _body(encode(PLAN))
    assert body[4] == [[4, 5], [[11], []], [2, 3], [1, 16], [42, 0], [2, 1], [[], []], [[], []], [[], []]]
    body = _body(encode(RESULT))
    assert body[3] == [[4, 3], [77, 5], [-0.125, -1.0], [[[77, -0.125], [78, -2.5]], []]]
    empty = _body(encode(StepPlan(1, 0)))
    assert empty[4] == [[], [], [], [], [], [], [], [], []]


@pytest.mark.parametrize("columns, words", [
    ([[4, 5], [[11]], [2, 3], [1, 16], [42, 0], [2, 1], [[], []], [[], []], [[], []]], "columns differ in length"),
    ([[4], [[11]], [2], [1], [42], [2], [[]], [[]], [[]], [9]], "expects 9 columns, got 10"),
    ([], "expects 9 columns, got 0"),
    ({"seq_id": [4]}, "expects 9 columns, got dict"),
    ([4, [[11]], [2], [1], [42], [2], [[]], [[]], [[]]], "columns differ in length"),
], ids=["ragged", "nine", "none", "map", "scalar"])
def test_malformed_columns_are_a_protocol_error(columns, words):
    plan = _ext(_tag(StepPlan), 1, 0, [], columns, [], [], [], [], [])
    with pytest.raises(ProtocolError, match=words):
        decode(msgpack.packb([PROTOCOL_VERSION, plan], use_bin_type=True))


def test_a_step_list_holding_another_type_is_not_encoded():
    with pytest.raises(TypeError, match="list of CachedSequence holding another type"):
        encode(StepPlan(1, 0, cached_seqs=[CACHED_SEQ, NEW_SEQ]))
    with pytest.raises(TypeError, match="list of SampledToken holding another type"):
        encode(StepResult(1, 0, sampled=[SAMPLED, (4, 77, -0.1, [])]))


def test_the_version_is_checked_before_the_message():
    """A protocol 5 plan (one extension per cached sequence) is refused by its version, not by its shape."""
    v5_plan = _ext(_tag(StepPlan), 1, 0, [], [_ext(_tag(CachedSequence), 4, [11], 2, 1, 42, 1)], [], [], [], [], [])
    with pytest.raises(ProtocolError, match=f"protocol version 5 is not {PROTOCOL_VERSION}"):
        decode(msgpack.packb([5, v5_plan], use_bin_type=True))
    with pytest.raises(ProtocolError, match="undecodable message: extra data"):
        decode(encode(PLAN) + b"\x00")


def test_invalid_sampling_params_on_the_wire_are_a_protocol_error():
    fields = [getattr(SamplingParams(), f.name) for f in dataclasses.fields(SamplingParams)]
    fields[1] = -1.0  # temperature
    data = msgpack.packb([PROTOCOL_VERSION, _ext(_tag(SamplingParams), *fields)], use_bin_type=True)
    with pytest.raises(ProtocolError, match="temperature"):
        decode(data)


# ----------------------------------------------------------------------------- sampling params


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 129}, "n"),
    ({"n": 0}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 129}, "best_of"),
    ({"beam_width": -1}, "beam_width"),
    ({"beam_width": 33}, "beam_width"),
    ({"beam_width": 2, "n": 3}, "n"),
    ({"beam_width": 2, "best_of": 2}, "best_of"),
    ({"length_penalty": float("nan")}, "length_penalty"),
    ({"length_penalty": -5.01}, "length_penalty"),  # was a division by zero in the scheduler's beam step
    ({"length_penalty": 1000.0}, "length_penalty"),  # was an OverflowError there
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"temperature": -0.01}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_catches_a_value_changed_after_construction():
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(InvalidParamError) as info:
        params.validate()
    assert info.value.param == "top_p"


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"min_p": 1.0},
    {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 4, "min_tokens": 4}, {"logprobs": 0}, {"logprobs": 20}, {"max_tokens": 1}, {"max_tokens": 0},
])
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.1).greedy


# ----------------------------------------------------------------------------- engine config


@pytest.mark.parametrize("kwargs, words", [
    ({"block_size": 12}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"num_gpu_blocks": 1}, "num_gpu_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024}, "chunked prefill"),
    ({"dtype": "int8"}, "dtype"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"cpu_kv_cache_gb": 0}, "cpu_kv_cache_gb"),
])
def test_bad_engine_config_values_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(**kwargs)


def test_good_engine_configs_are_accepted_and_frozen():
    config = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=1024)
    assert config.max_model_len == 1024
    EngineConfig(block_size=8, num_gpu_blocks=2, gpu_memory_utilization=1.0, dtype="bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32


def test_replace_validates_the_new_config():
    config = EngineConfig()
    assert config.replace(block_size=32).block_size == 32
    assert config.block_size == 16
    with pytest.raises(ConfigError, match="block_size"):
        config.replace(block_size=3)


def test_a_plan_of_protocol_3_without_num_samples_is_refused():
    """Version 4 appended `num_samples` to NewSequence and CachedSequence: a version 3 peer is refused
    by its version, and its 5-field CachedSequence by its field count."""
    assert PROTOCOL_VERSION >= 4
    v3_seqs = [[4], [[11]], [2], [1], [42]]  # as columns (protocol 6)
    with pytest.raises(ProtocolError, match="CachedSequence expects 9 columns, got 5"):
        decode(msgpack.packb([PROTOCOL_VERSION, _ext(_tag(StepPlan), 1, 0, [], v3_seqs, [], [], [], [], [])],
                             use_bin_type=True))
    with pytest.raises(ProtocolError, match=f"protocol version 3 is not {PROTOCOL_VERSION}"):
        decode(msgpack.packb([3, _ext(_tag(StepPlan), 1, 0, [], [], [], [], [], [], [])], use_bin_type=True))


def test_kv_event_batches_are_plain_msgpack_in_vllms_array_layout():
    """What a router outside Pagoda reads with msgpack alone: vLLM's msgspec structs, array-like,
    each event's class name first (common/kv_events.py)."""
    from common.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch,
                                  encode_batch)

    batch = KVEventBatch(1.5, [AllBlocksCleared(), BlockStored([b"h1", b"h2"], None, [1, 2, 3, 4], 2),
                               BlockRemoved([b"h1"])], "0")
    data = encode_batch(batch)
    assert msgpack.unpackb(data, raw=False) == [1.5, [["AllBlocksCleared"],
                                                      ["BlockStored", [b"h1", b"h2"], None, [1, 2, 3, 4], 2, None, "GPU"],
                                                      ["BlockRemoved", [b"h1"], "GPU"]], "0"]
    assert decode_batch(data) == batch
    for bad in (b"\xc1", msgpack.packb([1.0, [["Nope"]], "0"]), msgpack.packb([1.0, [["BlockRemoved"]], "0"]),
                msgpack.packb({"ts": 1})):
        with pytest.raises(ValueError, match="not a KV event batch"):
            decode_batch(bad)


def test_a_reply_entry_holds_a_flushs_events_or_one_event():
    """A scheduler writes one entry per reply stream per flush: the list of its events for that
    gateway; one of before the batched return path wrote one event per entry. Anything else is refused."""
    first, last = RequestEvent("a", [5], None), RequestEvent("b", [], None, "stop", None, 1)
    assert decode_events(encode([first, last])) == [first, last]
    assert decode_events(encode(first)) == [first]
    with pytest.raises(ProtocolError, match="a reply entry holds RequestEvents only"):
        decode_events(encode([first, STATUS]))
