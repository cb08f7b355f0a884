# The two set-up commands of the README: `make demo` (main job) and `make test` (test suite).
# Both create .venv on first use. torch is pinned to the CPU build found locally on the
# development/CI machines; CUDA users: see README "On a CUDA machine" (Quickstart).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	# setuptools prints an "Editable installation" notice (a UserWarning) for every editable build
	PYTHONWARNINGS="ignore::UserWarning" $(BIN)/pip install -q -e ".[test,plot]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/sparse-io-attn demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q tests

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

# The C++ CPU kernel built with AddressSanitizer + UBSan (its own cached build), fuzzed against the
# torch backend and the float64 reference. Python is not instrumented: the ASan runtime is preloaded
# and leak checks are off. FUZZ_CASES=300 for a quick run.
FUZZ_CASES ?= 5000
fuzz-sanitize: $(STAMP)
	SPARSE_IO_ATTN_SANITIZE=address,undefined SPARSE_IO_ATTN_FUZZ_CASES=$(FUZZ_CASES) \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" \
	$(BIN)/python -m pytest -q -n 0 -p no:randomly tests/block_sparse/test_fuzz.py -k cpu_case

.PHONY: venv demo test test-gpu fuzz-sanitize
