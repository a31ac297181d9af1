"""`pagoda bench profile`: the kernel classifier, the interval arithmetic and the trace analysis on
synthetic timelines (exact values), and the CPU path through the CLI on the tiny model."""
import json
from pathlib import Path

import pytest

from pagoda.bench.profile import (
    IN_PROCESS_PARTS, KINDS, analyze, covered, default_trace, gap_stats, holes, kernel_kind, merge_intervals,
    read_timeline,
)
from pagoda.cli import main

TINY = Path(__file__).parent / "data" / "tiny-llama.json"
HEADER = ["benchmark", "command", "commit", "date", "device"]

KERNEL_NAMES = {  # names as torch.profiler's Chrome trace carries them (Triton: the Python function's name)
    "_attention_kernel": "attention",
    "_reduce_splits_kernel": "attention",
    "_write_kv_kernel": "attention",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false>(Flash_fwd_params)": "attention",
    "_rms_norm_kernel": "norm_rope_activation",
    "_rotary_kernel": "norm_rope_activation",
    "_silu_and_mul_kernel": "norm_rope_activation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::gelu_kernel_impl"
    "(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#1}::operator()() const, "
    "at::detail::Array<char*, 2> >(int, float, at::detail::Array<char*, 2>)": "norm_rope_activation",
    "_moe_gemm_kernel": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
    "kernel__5x_cublas": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
    "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, false, "
    "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, "
    "float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
    "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, "
    "float> >(float, float)": "gemm",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "sampler",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)": "sampler",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
    "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, "
    "at::cuda::detail::TensorInfo<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, "
    "unsigned int>, unsigned int, unsigned int*)": "sampler",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<float, "
    "long, int>::Policy800, true, float, long, int, int, at_cuda_detail::cub::detail::identity_decomposer_t>"
    "(int*, int*, int*, int const*, float*, float const*, long*, long const*, int, int, int, "
    "at_cuda_detail::cub::detail::identity_decomposer_t)": "sampler",
    "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
    "at::native::templates::cuda::exponential_kernel(at::TensorIteratorBase&, double, "
    "at::CUDAGeneratorImpl*)>(int, at::PhiloxCudaState, T3, T4)": "sampler",
    "void at::native::tensor_kernel_scan_innermost_dim<float, std::plus<float> >(float*, float const*, unsigned int, "
    "unsigned int, unsigned int, float, std::plus<float>)": "sampler",
    "Memcpy HtoD (Pageable -> Device)": "copy",
    "Memcpy DtoH (Device -> Pinned)": "copy",
    "Memset (Device)": "copy",
    "_copy_blocks_kernel": "copy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
    "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, float, "
    "at::detail::Array<char*, 2>)": "copy",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3>)": "other",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>"
    "(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16 const, "
    "unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, unsigned int, "
    "long)": "other",
    "_count_kernel": "other",
    "_align_kernel": "other",
}


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernel_kind_of_real_kernel_names(name):
    assert kernel_kind(name) == KERNEL_NAMES[name]


def test_every_kind_is_named_by_some_kernel():
    assert set(KERNEL_NAMES.values()) == set(KINDS)


def test_merge_intervals_joins_overlapping_and_touching_ones():
    assert merge_intervals([(20, 30), (0, 10), (5, 15), (30, 35), (40, 41), (1, 2)]) == [(0, 15), (20, 35), (40, 41)]
    assert merge_intervals([]) == []


def test_covered_and_holes_clip_to_the_window():
    merged = [(0, 15), (20, 35), (40, 41)]
    assert covered(merged, 2, 42) == 13 + 15 + 1
    assert holes(merged, -5, 50) == [5, 5, 5, 9]
    assert holes(merged, 2, 38) == [5, 3]
    assert holes(merged, 0, 15) == []
    assert holes([], 0, 7) == [7]


def test_gap_stats_counts_gaps_longer_than_the_threshold():
    assert gap_stats([5, 5, 5, 9, 12], 5) == {"count": 2, "total": 21, "largest": 12}
    assert gap_stats([1, 2], 5) == {"count": 0, "total": 0, "largest": 0.0}


def _x(cat: str, name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def synthetic_trace() -> dict:
    """Two steps of 100 us. Step 0: a graph launch (GEMM, attention, an overlapping norm), the
    sampler's range (its argmax and the tokens' copy); step 1: a GEMM, the MoE router's top-k
    (outside the sampler: other) and the KV write. One kernel before the window."""
    kernel, launch = "kernel", "cuda_runtime"
    return {"traceEvents": [
        _x("user_annotation", "pagoda step 1", 100, 100), _x("user_annotation", "pagoda step 0", 0, 100),
        _x("gpu_user_annotation", "pagoda step 0", 0, 200),  # the GPU-side copy of a range: not device work
        _x(kernel, "_rms_norm_kernel", -20, 10, 9), _x(launch, "cudaLaunchKernel", -25, 2, 9),
        _x(launch, "cudaGraphLaunch", 5, 3, 1),
        _x(kernel, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 10, 30, 1),
        _x(kernel, "_attention_kernel", 40, 20, 1),
        _x(kernel, "_rms_norm_kernel", 55, 15, 1),
        _x("user_annotation", "pagoda sampler", 70, 20),
        _x("cuda_driver", "cuLaunchKernel", 72, 1, 2),
        _x(kernel, "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float> > >", 75, 5, 2),
        _x(launch, "cudaMemcpyAsync", 78, 1, 3), _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 80, 2, 3),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 3, "ts": 78},
        _x(launch, "cudaGraphLaunch", 101, 3, 4),
        _x(kernel, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 130, 40, 4),
        _x(kernel, "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", 170, 5, 4),
        _x(kernel, "_write_kv_kernel", 175, 5, 4),
    ]}


def test_read_timeline_orders_steps_and_attributes_the_sampler_by_its_range():
    timeline = read_timeline(synthetic_trace())
    assert timeline.steps == [(0, 100), (100, 200)]
    assert [(e.start, e.kind) for e in timeline.events] == [
        (-20, "norm_rope_activation"), (10, "gemm"), (40, "attention"), (55, "norm_rope_activation"), (75, "sampler"),
        (80, "copy"), (130, "gemm"), (170, "other"), (175, "attention")]


def test_analyze_gives_busy_fraction_kinds_gaps_and_steps_exactly():
    gpu = analyze(read_timeline(synthetic_trace()), gap_threshold_us=8)
    # busy: [10, 70) + [75, 82) + [130, 180) = 117 of 200 us
    assert (gpu["window_ms"], gpu["busy_ms"], gpu["busy_fraction"], gpu["device_events"]) == (0.2, 0.117, 0.585, 8)
    assert gpu["device_ms_by_kind"] == {"gemm": 0.07, "attention": 0.025, "norm_rope_activation": 0.015,
                                        "sampler": 0.005, "copy": 0.002, "collective": 0.0, "other": 0.005}
    assert gpu["device_share_by_kind"]["gemm"] == round(70 / 122, 4)
    # holes: [0, 10) 10, [70, 75) 5, [82, 130) 48, [180, 200) 20; longer than 8 us: 10, 48, 20
    assert gpu["gaps"] == {"threshold_us": 8, "count": 3, "total_ms": 0.078, "largest_ms": 0.048,
                           "between_steps_median_us": 48.0}
    assert gpu["steps"] == {"wall_ms": 0.1, "device_ms": 0.0585, "wall_ms_each": [0.1, 0.1],
                            "device_ms_each": [0.067, 0.05]}
    assert [(k["name"][:12], k["kind"], k["count"], k["total_ms"]) for k in gpu["top_kernels"][:4]] == [
        ("sm90_xmma_ge", "gemm", 1, 0.04), ("nvjet_tst_12", "gemm", 1, 0.03), ("_attention_k", "attention", 1, 0.02),
        ("_rms_norm_ke", "norm_rope_activation", 1, 0.015)]


def test_without_a_sampler_range_sampler_kernels_go_by_name():
    trace = synthetic_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != "pagoda sampler"]
    kinds = [e.kind for e in read_timeline(trace).events]
    assert kinds[4] == "sampler" and kinds[7] == "sampler"  # the argmax, and the top-k by its name


def test_default_trace_sits_beside_the_output():
    assert default_trace("results/x-profile.json") == Path("results/x-profile.trace.json")
    assert default_trace(None) == Path("pagoda-profile.trace.json")


def test_cpu_run_through_the_cli_writes_the_result_and_a_chrome_trace(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--model", f"dummy:{TINY}", "--device", "cpu", "--batch-size", "3",
                 "--context-len", "24", "--steps", "3", "--warmup-steps", "1", "--num-gpu-blocks", "64",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:5] == HEADER and result["benchmark"] == "profile"
    assert result["command"].startswith(f"pagoda bench profile --model dummy:{TINY} --device cpu --dtype auto "
                                        "--quantization none --batch-size 3 --context-len 24 --steps 3 --warmup-steps 1 ")
    assert (result["batch"], result["context"], result["steps"], result["decode_tokens"]) == (3, 24, 3, 9)
    assert result["engine"]["num_gpu_blocks"] == 64 and result["engine"]["max_num_seqs"] == 3
    assert result["engine"]["cuda_graphs"] is False
    assert result["gpu"] is None and "no CUDA device" in result["note"] and "goals" not in result
    assert len(result["step_ms_each"]) == 3 and result["step_ms"] > 0
    assert list(result["host"]["breakdown_ms"]) == list(IN_PROCESS_PARTS)
    parts = result["host"]["breakdown_ms"]
    assert all(v >= 0 for v in parts.values()) and parts["forward"] > 0
    roof = result["roofline"]
    # tiny-llama, float32: 139,584 parameters; KV per token 2 layers x 2 x 2 kv heads x 16 x 4 bytes = 512
    assert roof["weight_bytes"] == 139_584 * 4
    assert 24 < roof["kv_tokens_per_seq"] < 24 + 3 + 1 + 3
    assert roof["kv_bytes"] == int(3 * roof["kv_tokens_per_seq"] * 512)
    assert roof["copy_bandwidth_GBps"] is None and roof["step_over_roofline"] is None
    trace_path = tmp_path / "profile.trace.json"
    assert result["trace"] == str(trace_path)
    trace = json.loads(trace_path.read_text())
    ranges = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert sorted(r for r in ranges if r.startswith("pagoda step")) == [f"pagoda step {i}" for i in range(3)]
    assert ranges.count("pagoda sampler") == 3
    timeline = read_timeline(trace)
    assert len(timeline.steps) == 3 and timeline.events == []  # no device timeline on the CPU
    assert [round((t - s) / 1e3, 4) for s, t in timeline.steps] == result["step_ms_each"]
    assert "no CUDA device" in capsys.readouterr().err


def test_bad_steps_is_a_usage_error(capsys):
    assert main(["bench", "profile", "--model", f"dummy:{TINY}", "--device", "cpu", "--steps", "1"]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_profile_of_the_tiny_model_sees_gemm_and_attention(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--model", f"dummy:{TINY}", "--device", "cuda", "--dtype", "float16",
                 "--batch-size", "8", "--context-len", "64", "--steps", "4", "--warmup-steps", "2",
                 "--num-gpu-blocks", "256", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    gpu = result["gpu"]
    assert 0 < gpu["busy_fraction"] <= 1
    assert gpu["device_ms_by_kind"]["gemm"] > 0 and gpu["device_ms_by_kind"]["attention"] > 0
    assert gpu["device_ms_by_kind"]["sampler"] > 0
    assert result["engine"]["cuda_graphs"] is True
    assert len(gpu["steps"]["wall_ms_each"]) == 4
    assert result["roofline"]["copy_bandwidth_GBps"] > 0 and result["roofline"]["step_over_roofline"] > 0
    assert len(result["goals"]) == 2
    json.loads((tmp_path / "profile.trace.json").read_text())


def test_the_gpu_check_script_s_profile_command_parses(monkeypatch):
    """scripts/gpu-check.sh calls `bench profile` with these flags: they must reach run() as meant."""
    import re
    import shlex

    import pagoda.bench.profile as profile

    script = (Path(__file__).parents[1] / "scripts" / "gpu-check.sh").read_text()
    model = re.search(r"^MODEL=(\S+)$", script, re.M).group(1)
    line = re.search(r"pagoda\.cli bench profile (.*?)--output", script, re.S).group(1)
    words = shlex.split(line.replace("\\\n", " ").replace("$MODEL", model)) + ["--output", "x-profile.json"]
    seen = []
    monkeypatch.setattr(profile, "run", lambda args: seen.append(args) or 0)
    assert main(["bench", "profile", *words]) == 0
    args = seen[0]
    assert (args.model, args.device, args.dtype, args.batch_size, args.context_len) == (
        "dummy:worker/configs/llama-3.1-8b.json", "cuda", "bfloat16", 256, 1024)
    assert (args.steps, args.warmup_steps, args.trace, args.max_num_seqs) == (20, 5, None, None)
    assert profile.default_trace(args.output) == Path("x-profile.trace.json")


def test_the_profiled_engine_launches_each_plan_behind_the_one_in_flight():
    """The recorder passes launch and finish through, so the profile sees the overlapped loop (a
    recorder with `execute` alone made the engine run each plan whole, the GPU idle in between)."""
    from common.protocol import SamplingParams
    from pagoda.bench.profile import instrument
    from pagoda.bench.step import PartClock
    from pagoda.offline import LLM

    llm = LLM(f"dummy:{TINY}", skip_tokenizer_init=True, device="cpu")
    recorder = instrument(llm, PartClock())
    outputs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [4, 4]
    assert recorder.most_in_flight == 2 and not recorder.in_flight
