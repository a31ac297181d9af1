#!/usr/bin/env bash
# Everything Pagoda measures on a GPU host, in one command of under 8 minutes, from a source tree.
#
#   scripts/gpu-check.sh [RESULTS_DIR]      (default benchmarks/results)
#
# The host needs Python with torch (CUDA) and triton; the runtime packages it lacks travel as
# wheels in .whl/ (scripts/fetch-wheels.sh makes them on a machine with a registry, at
# requirements.lock's versions) and are installed to /tmp/site. Each step has its own time limit; a step that fails or runs out is
# reported and the next one runs. Results: RESULTS_DIR/<date>-<gpu>-<step>.json (and .log), and a
# summary table last. Where $OUT is set (the device tool), the results are also packed into
# $OUT/gpu-check.tar.gz. See docs/benchmarks.md ("A GPU host in one command").
#
# A shorter run (a second lease, a re-check): GPU_CHECK_STEPS names the steps to run (e.g.
# "tests throughput-96 latency"), GPU_CHECK_TESTS the test files, HF_BASELINE=0 skips
# transformers' baseline in throughput-96 (about a minute on an H100), GPU_CHECK_TAG goes into the
# result files' names.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu-check: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
gpu=$($PY - <<'EOF'
import re, torch
assert torch.cuda.is_available(), "gpu-check: no CUDA device"
name = torch.cuda.get_device_name()
print(next(iter(re.findall(r"[A-Z]\d{2,4}[A-Za-z]?", name)), "gpu").lower())
EOF
) || exit 1
date=$(date -u +%F)
results=${1:-benchmarks/results}
mkdir -p "$results"
prefix="$results/$date-$gpu${GPU_CHECK_TAG:+-$GPU_CHECK_TAG}"  # a tag keeps a second run's files apart
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null

summary=()
step() {  # step NAME SECONDS COMMAND...: run it under its limit, its output in $prefix-NAME.log
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then return; fi
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$prefix-$name.log" 2>&1
  local rc=$?
  tail -n 6 "$prefix-$name.log"
  local verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (rc $rc)"
  summary+=("$(printf '%-26s %-16s %4ds' "$name" "$verdict" $((SECONDS - start)))")
  printf '%s\n' "${summary[@]}" >"$prefix-summary.txt"
  [ -n "${OUT:-}" ] && tar -czf "$OUT/gpu-check.tar.gz" "$prefix"-*  # each step's results come back even if a later one is cut off
}
has_bench() { $PY -m pagoda.cli bench "$1" --help >/dev/null 2>&1; }

MODEL=dummy:worker/configs/llama-3.1-8b.json
ENGINE=(--device cuda --dtype bfloat16 --max-num-seqs 256 --max-num-batched-tokens 2048 --num-gpu-blocks 8192)

TESTS=${GPU_CHECK_TESTS:-tests/test_kernels_triton.py tests/test_kernels_fused.py tests/test_kernels_swap.py \
  tests/test_kernels_tuning.py tests/test_kernels_moe.py tests/test_input_batch.py tests/test_sampler.py \
  tests/test_tensor_parallel.py tests/test_models_gpu.py tests/test_token_feed.py tests/test_bench_profile.py \
  tests/test_quantization.py tests/test_quant_formats.py tests/test_fp8_kv_cache.py tests/test_lora_gpu.py}
step tests 180 $PY -m pytest -q -n 8 -m gpu -p no:cacheprovider $TESTS
step kernels 45 $PY -m pagoda.cli bench kernels --output "$prefix-kernels.json"
step kernels-moe 60 $PY -m pagoda.cli bench kernels --moe --output "$prefix-kernels-moe.json"
# Speculative decoding: a verify step (k drafts per sequence, in the decode graphs by batch expansion) against a decode step
if has_bench verify; then
  step verify 90 $PY -m pagoda.cli bench verify --model $MODEL --device cuda --dtype bfloat16 --batch-sizes 1,16,64 \
    --num-speculative-tokens 1,2,4,8 --context-len 1024 --output "$prefix-verify.json"
fi
step throughput-96 150 $PY -m pagoda.cli bench throughput --model $MODEL "${ENGINE[@]}" --num-prompts 96 \
  --max-output-len 128 --ignore-eos --hf-batch-size 16 --seed 0 $([ "${HF_BASELINE:-1}" = 0 ] && echo --skip-baseline) \
  --output "$prefix-throughput-96.json"
# LoRA: the same 96 requests on an engine serving 8 random rank-16 adapters, round-robin, over the base engine's
step throughput-96-lora8 120 $PY -m pagoda.cli bench throughput --model $MODEL "${ENGINE[@]}" --num-prompts 96 \
  --max-output-len 128 --ignore-eos --seed 0 --skip-baseline --lora-adapters 8 --lora-rank 16 \
  --output "$prefix-throughput-96-lora8.json"
if has_bench latency; then
  step latency 90 $PY -m pagoda.cli bench latency --model $MODEL --device cuda --dtype bfloat16 --batch-sizes 1,64 \
    --input-len 1024 --output-len 128 --output "$prefix-latency.json"
fi
if has_bench profile; then
  step profile 90 $PY -m pagoda.cli bench profile --model $MODEL --device cuda --dtype bfloat16 --batch-size 256 \
    --context-len 1024 --output "$prefix-profile.json"
fi
step step 60 $PY -m pagoda.cli bench step --device cuda --batch-sizes 64,256 --output "$prefix-step.json"
# Quantization: the int4 GEMM, the FP8 decode step against bf16's at batch 1, an fp8 KV cache's capacity
step kernels-int4 45 $PY -m pagoda.cli bench kernels --int4 --output "$prefix-kernels-int4.json"
step latency-fp8 90 $PY -m pagoda.cli bench latency --model $MODEL --device cuda --dtype bfloat16 --quantization fp8 \
  --batch-sizes 1,64 --input-len 1024 --output-len 128 --output "$prefix-latency-fp8.json"
step latency-fp8-kv 90 $PY -m pagoda.cli bench latency --model $MODEL --device cuda --dtype bfloat16 \
  --kv-cache-dtype fp8 --batch-sizes 1,64 --input-len 1024 --output-len 128 --output "$prefix-latency-fp8-kv.json"

# the KV swap between the device pool and pinned host memory: staged against direct
step kernels-swap 60 $PY -m pagoda.cli bench kernels --swap --output "$prefix-kernels-swap.json"
# The CPU prefix-cache tier: an evicted 8k-token prefix found in the CPU tier and copied back, against recomputing it
step cpu-tier 120 $PY -m pagoda.cli bench cpu-tier --model $MODEL --device cuda --dtype bfloat16 --prefix-len 8192 \
  --rounds 3 --output "$prefix-cpu-tier.json"

step throughput-384 60 $PY -m pagoda.cli bench throughput --model $MODEL "${ENGINE[@]}" --num-prompts 384 \
  --max-output-len 128 --ignore-eos --seed 0 --skip-baseline --output "$prefix-throughput-384.json"
step throughput-96-orca-oracle 60 $PY -m pagoda.cli bench throughput --model $MODEL "${ENGINE[@]}" --num-prompts 96 \
  --max-output-len 128 --ignore-eos --seed 0 --skip-baseline --allocator orca-oracle \
  --output "$prefix-throughput-96-orca-oracle.json"
echo "== summary ($gpu, $date): results in $prefix-*"
printf '%s\n' "${summary[@]}"
