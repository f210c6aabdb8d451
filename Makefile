# Two entry points (README): `make demo` and `make test`. Each builds .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Pin torch to the CPU build; every later install is constrained by it so pip never pulls a CUDA build.
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: venv demo test test-fast lint gpu-test clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	echo "torch==2.13.0" > $(CONSTRAINTS)
	$(PIP) install -q -c $(CONSTRAINTS) "triton==3.9.0" "pydantic>=2" "pyyaml>=6" "tqdm>=4" numpy \
		"packaging>=24.2" psutil "pytest>=8" pytest-timeout ruff matplotlib
	# Hugging Face export: safetensors (writer), transformers + compressed-tensors (the readers the tests prove with).
	$(PIP) install -q -c $(CONSTRAINTS) "safetensors>=0.4" "transformers==5.23.0" "compressed-tensors==0.20.0"
	# megatron-core declares Python>=3.12 but ships a working cp311 wheel: install it alone, without deps.
	$(PIP) install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/modelopt-moe demo

# The whole CPU suite (GPU tests deselected); tests/conftest.py sets the tiers and time limits.
test: $(STAMP)
	$(PY) -m pytest -q tests

# The edit loop: the single-process tests of the library and the tools (no spawned ranks, no subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/tools -m "not slow and not gpu"

# On a machine with a CUDA GPU, Transformer Engine and megatron-core installed (see README, "Tests").
gpu-test:
	python3 -m pytest -q -m gpu tests/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check modelopt_moe plugins tools tests

clean:
	rm -rf $(VENV) *.egg-info
