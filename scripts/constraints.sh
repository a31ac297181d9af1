#!/usr/bin/env bash
# The constraints `pip install -c` takes in `make setup` and the Dockerfile: requirements.lock (the
# exact versions the suite passed with), less its torch and triton where PYTHON's torch is a GPU build
# (CUDA or ROCm) the host installed first: it keeps the triton it came with (the lock's pair is the
# CPU build's). Such a torch should be the lock's release: another one pins other versions of its own
# requirements, and pip then reports the conflict.
#   scripts/constraints.sh [PYTHON] > constraints.txt
set -euo pipefail
lock="$(dirname "$0")/../requirements.lock"
if "${1:-python3}" -c "import sys, torch; sys.exit(torch.version.cuda is None and torch.version.hip is None)" \
    2>/dev/null; then
  grep -vE '^(torch|triton)==' "$lock"
else
  cat "$lock"
fi
