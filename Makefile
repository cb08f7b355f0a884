# The two set-up commands of the README: `make demo` (main job) and `make test` (test suite).
# Both create .venv on first use. torch is pinned to the CPU build found locally on the
# development/CI machines; CUDA users: see README "Installing on a CUDA machine".
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test,plot,examples]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/sparse-io-attn demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q tests

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

.PHONY: venv demo test test-gpu
