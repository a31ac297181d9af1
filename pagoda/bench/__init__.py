"""Every benchmark (`pagoda bench NAME`), the soak and the stack launcher.

Each bench's module declares its flags, `add_arguments(parser)`, beside the `run(args)` that runs
it; `pagoda bench` imports it only once it is chosen. What they share:

    common.py     the result's header (command, commit, date, device), writing it, engine flags
    timing.py     the one percentile definition, timing summaries, calls timed in turn
    client.py     the one client of the served API: a stream read into TTFT, gaps, text, usage
    stack.py      start `pagoda up`, wait for /health, read its metrics and processes, stop it
    workloads.py  ShareGPT request pairs, shared-prefix conversations
    lora.py       random adapters (throughput, serve)
    soak.py       `python -m pagoda.bench.soak`: mixed load, RSS and leak checks, chaos
"""

# `pagoda bench NAME`: (its module here, what it measures)
BENCHES = {
    "kernels": ("kernels", "Triton paged decode attention vs copy bandwidth and SDPA (CUDA only); "
                           "--moe: the fused MoE kernel vs a loop over experts; "
                           "--int4: the int4 GEMM vs bf16; --swap: the KV swap paths"),
    "ops": ("ops", "ops (CPU, dispatch counter) or CUDA kernels (profiler) of one decode forward"),
    "memory": ("memory", "KV memory use: paged vs Orca-style contiguous (CPU, no model)"),
    "throughput": ("throughput", "offline engine vs transformers generate on ShareGPT, in one run"),
    "latency": ("latency", "fixed input and output lengths through the offline engine: TTFT, TPOT, e2e per "
                           "batch size"),
    "serve": ("serve", "online latency and throughput against the gateway"),
    "overload": ("overload", "`pagoda up` with queue bounds at its sustainable rate, then at 4x it: answers by kind "
                             "(completion or 429 with Retry-After), p99 TTFT of accepted requests, the stack's RSS"),
    "overhead": ("serving_overhead", "time to first token through the stack minus the offline engine's (CPU)"),
    "cpu-tier": ("cpu_tier", "time to first token of an evicted prefix found in the prefix cache's CPU "
                             "tier against recomputed (--cpu-prefix-cache)"),
    "routing": ("routing", "`pagoda up --data-parallel-size 2`: cache-aware routing against pull on conversations "
                           "sharing system prompts: prefix-cache hit rate and request throughput, in one run"),
    "embed": ("embed", "embedding throughput of the offline engine against sentence-transformers' encode, same "
                       "model, texts and threads, in one run (docs/pooling.md)"),
    "long-context": ("long_context", "4k-token prompts of a Gemma-3-shaped model in one KV budget: KV cache groups "
                                     "against the uniform allocator, sequences at once and output tokens/s, in one "
                                     "run (docs/architecture.md)"),
    "vision": ("vision", "time to first token of a chat whose image the encoder cache holds against a new image, "
                         "offline, in one run (docs/vision.md)"),
    "step": ("step", "host side of a decode step: scheduler, wire, worker, sampler; the forward a sleep"),
    "structured": ("structured", "JSON-schema constrained decoding: xgrammar vs llguidance, validity, throughput "
                                 "cost"),
    "profile": ("profile", "torch.profiler over steady decode steps of the offline engine: GPU busy fraction, time "
                           "by kernel kind, idle gaps, roofline (CUDA); host time by part (CPU)"),
    "publish": ("publish", "cost of publishing the memory page's snapshot against the scheduler's step (CPU, no "
                           "model)"),
    "quality": ("quality", "accuracy of each --quantization scheme: perplexity on a fixed text through prompt "
                           "logprobs, greedy agreement with full precision"),
    "verify": ("verify", "a speculative verify step (a token and k drafts per sequence) against a decode step, in "
                         "the model runner: CUDA graphs on CUDA (docs/speculative.md)"),
    "peer": ("peer", "Pagoda against llama.cpp's llama-server on the same GGUF and the same streamed workloads, "
                     "in turn in one run: output tokens/s at 1, 4 and 16 streams, a long prompt's TTFT"),
    "speculative": ("speculative", "output tokens/s through the served API with --speculative-config against "
                                   "without, in one run: acceptance rate, speedup, identical outputs "
                                   "(docs/speculative.md)"),
}
