#!/usr/bin/env bash
# The gpu suite on a lent device in one call of the device tool: environment checks, megatron-core
# from a carried wheel when the image lacks it (it has PyTorch, no Transformer Engine, no internet),
# then `python -m benchmarks run --suite gpu` (train: Qwen2-1.5B shape, bf16, 4096 and 8192 tokens
# a sequence, with the weight-sync sender and the colocated sleep path (--offload); train_torch; logprob_memory
# at 8192 and 16384 tokens; ipc_handoff: the colocated handoff through CUDA IPC handles between two processes,
# GB/s, bytes checked; probe_bf16: the weight-sync probe's error in bf16 at Qwen2-1.5B's shape, Megatron against
# transformers on the same weights over 20 syncs; moe: the MoE train step at EP 1 on 4 layers of Qwen3-30B-A3B,
# tokens/s, peak memory), then outside the suite the delta weight sync's encoding (GB/s) and a LoRA train
# step against full fine-tuning (lora_train.json). train and logprob_memory ran on an H200 before
# (results/suite_gpu/); --offload, train_torch's 4K, ipc_handoff, probe_bf16, moe, the delta encoding and
# the LoRA step have not run on a GPU yet: run --quick first.
# Not here: the timing of grpo.async_mode partial's weight swap into requests in flight (pause, load,
# resume). The device has no vLLM, and the load is vLLM's layerwise reload around our block copies
# (weight_sync/vllm_engine.py): a torch-only stand-in would time none of it. The CPU suite's long_tail
# measures the pause and the sync.
#
#   bash benchmarks/gpu_h200.sh            # on the device; results under $OUT/suite_gpu/ (copy them to
#                                          # benchmarks/results/suite_gpu/), else benchmarks/results/suite_gpu/
#   bash benchmarks/gpu_h200.sh --quick    # the same commands at their smallest sizes
#   bash benchmarks/gpu_h200.sh --only moe # other arguments go to `python -m benchmarks run`
#
# Preparing the call (here, once): the wheel for the device's Python 3.12 goes to an ignored folder,
#   .venv/bin/python -m pip download megatron-core==0.16.1 --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 -d benchmarks/results/tmp/wheels
# with transformers and its dependencies beside it when the device lacks them (probe_bf16's reference),
#   .venv/bin/python -m pip download transformers==5.19.0 --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform any -d benchmarks/results/tmp/wheels
# (43 MB) and the run tool is called with carry ["benchmarks/results/tmp/wheels"], command
# `bash benchmarks/gpu_h200.sh`, timeout_s 540. WHEELS=<dir> and PYTHON=<interpreter> override the defaults.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-benchmarks/results/tmp/wheels}"
QUICK=()
if [[ "${1:-}" == "--quick" ]]; then QUICK=(--quick); shift; fi  # the rest goes to the suite (--only ...)
OUT_DIR="${OUT:-benchmarks/results}/suite_gpu${QUICK[*]:+_quick}"
mkdir -p "$OUT_DIR"
# Expandable segments keep the long-sequence train steps from fragmenting the allocator. The suite runs
# ipc_handoff without them (benchmarks/suite.py, unset_env): CUDA IPC exports expandable segments as file
# descriptors taken with pidfd_getfd, which unprivileged containers refuse (EPERM) between sibling
# processes, and the colocated sender refuses the setting.
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    ls "$WHEELS"/megatron_core-*.whl >/dev/null || { echo "no megatron-core wheel in $WHEELS: see above"; exit 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/megatron_core-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$PYTHON" -c "import transformers" 2>/dev/null; then  # probe_bf16's reference model
    ls "$WHEELS"/transformers-*.whl >/dev/null || { echo "no transformers wheel in $WHEELS: see above"; exit 1; }
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-compile --target /tmp/site-hf transformers
    # The device's own numpy stays the one torch was built against.
    if "$PYTHON" -c "import numpy" 2>/dev/null; then rm -rf /tmp/site-hf/numpy /tmp/site-hf/numpy-* /tmp/site-hf/numpy.libs; fi
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site-hf"
  fi
  "$PYTHON" -c "import torch, megatron.core as m; assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('torch', torch.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))"
  "$PYTHON" -m benchmarks run --suite gpu "${QUICK[@]}" "$@" --out "$OUT_DIR"
  # The delta weight sync's encoding and application, GB/s on one GPU (torch only; smoke-tested on CPU,
  # never run on a GPU yet).
  "$PYTHON" -m benchmarks.delta_sync --encode --device cuda "${QUICK[@]}" --out "$OUT_DIR/delta_encode.json"
  # A LoRA train step (policy.lora.rank 8, all four target layers) against full fine-tuning of the same
  # model and batch: tokens/s, peak memory, the gradient buffers and optimizer state (the adapters' alone);
  # Qwen2-1.5B's shape, bf16, 8 x 4096 tokens (--quick: the smoke shape). Smoke-tested on CPU, never run
  # on a GPU yet.
  LORA_STEP=(--preset qwen2-1.5b --tp 1 --seq 4096 --batch 8 --budget 16384 --min-len-frac 1.0
    --recompute core_attention --warmup 2 --repeat 3)
  if [[ ${#QUICK[@]} -gt 0 ]]; then LORA_STEP=(--preset smoke); fi
  "$PYTHON" -m benchmarks.train "${LORA_STEP[@]}" --dtype bfloat16 --lora-rank 0 8 --steps train \
    "${QUICK[@]}" --out "$OUT_DIR/lora_train.json"
} 2>&1 | tee "$OUT_DIR/gpu_h200.log"
exit "${PIPESTATUS[0]}"
