"""Every benchmark, the soak, the workloads and the one stack launcher (`pagoda bench ...`).

    common.py            result header (command, commit, date, device) and result files
    stack.py             start `pagoda up`, wait for /health, stop it (tests, soak, serve, fuzz)
    workloads.py         ShareGPT request pairs
    memory.py            `pagoda bench memory`: paged vs Orca-style KV use (CPU, no model)
    throughput.py        `pagoda bench throughput`: offline engine vs transformers generate
    latency.py           `pagoda bench latency`: fixed lengths through the offline engine, TTFT/TPOT/e2e
    serve.py             `pagoda bench serve`: online latency and throughput through the gateway
    serving_overhead.py  `pagoda bench overhead`: what the serving planes add to TTFT
    kernels.py           `pagoda bench kernels`: Triton decode attention (CUDA)
    step.py              `pagoda bench step`: host work of a decode step, the forward a sleep
    profile.py           `pagoda bench profile`: torch.profiler over steady decode steps (GPU busy, kinds, gaps)
    soak.py              `python -m pagoda.bench.soak`: mixed load, RSS and leak checks
"""
