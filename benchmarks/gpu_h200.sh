#!/usr/bin/env bash
# Policy training throughput/MFU and logprob-path memory on one H200, in one call of the device tool.
#
#   bash benchmarks/gpu_h200.sh            # on the H200 (about 5 minutes; planned to end within 8)
#   bash benchmarks/gpu_h200.sh --smoke    # the same steps with a toy model on this CPU (gloo)
#
# What it runs, from the repository root:
#   1. nvidia-smi and torch.cuda checks; megatron-core 0.16.1 installed from the carried wheel when
#      the image lacks it (the image has PyTorch, no Transformer Engine, no internet).
#   2. benchmarks/logprob_memory.py on CUDA: peak memory of vocab_parallel_logprobs (chunked) vs
#      log_softmax over full fp32 logits, forward + backward, 8192 and 16384 tokens x 151936.
#   3. benchmarks/train_bench.py: PolicyWorker.train() vs a bare Megatron step (same engine, same
#      micro-batches) for a Qwen2-1.5B-shaped random model (28 layers, hidden 1536, ffn 8960, 12 heads,
#      2 kv groups, vocab 151936, tied), bf16, parallel.transformer_impl=local, TP=1, one rank, nccl
#      (parallel.backend=auto), micro-batch budget 16384 tokens: sequence 4096 (8 x 4096 tokens per
#      step), then 8192 (4 x 8192) if the plan has time left. MFU = 6 N tokens/s / 989e12 (N = 1.544e9,
#      all parameters with the tied embedding once) and (6 N + 12 L h s) tokens/s / 989e12 with the
#      attention matmuls. The local spec's attention is unfused (fp32 [b, heads, s, s] probabilities
#      kept for backward, ~34 GB per 4K sequence at this shape), so Megatron's selective recompute of
#      core attention is switched on (--recompute core_attention): without it neither length fits a
#      16K-token micro-batch in 141 GB. Recomputed FLOPs are not counted in the MFU.
#      The 4096 run also times the weight-sync sender on that model (HF conversion + 512 MB
#      double-buffered buckets on an NCCL group with no receivers) against one flat device copy of
#      the same bytes.
#
# Preparing the call (here, once): the wheel for the device's Python 3.12 goes to an ignored folder,
#   .venv/bin/python -m pip download megatron-core==0.16.1 --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 -d benchmarks/results/tmp/wheels
# and the run tool is called with
#   carry: ["benchmarks/results/tmp/wheels"]
#   command: bash benchmarks/gpu_h200.sh
#   timeout_s: 540
# Results come back through $OUT (at most 8 files, 7 used): $OUT/gpu_h200/{logprob_memory,train_4096,
# train_8192}.{json,md} and gpu_h200.log; copy them to benchmarks/results/gpu_h200/. Without $OUT they
# are written there directly. WHEELS=<dir> and PYTHON=<interpreter> override the defaults.
set -euo pipefail

cd "$(dirname "$0")/.."
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-benchmarks/results/tmp/wheels}"
if [[ -n "${OUT:-}" ]]; then
  RESULTS="$OUT/gpu_h200"
elif [[ $SMOKE == 1 ]]; then
  RESULTS="benchmarks/results/tmp/gpu_h200_smoke"
else
  RESULTS="benchmarks/results/gpu_h200"
fi
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
START=$SECONDS
PLAN_S=460 # everything inside 8 minutes
stamp() { echo "=== [$((SECONDS - START))s] $*"; }

check_environment() {
  stamp "environment"
  if [[ $SMOKE == 0 ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  fi
  "$PYTHON" -c "
import sys, torch
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
if sys.argv[1] == '0':
    assert torch.cuda.is_available(), 'torch sees no CUDA device'
    print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
" "$SMOKE"
  if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    stamp "installing megatron-core from $WHEELS"
    if ! ls "$WHEELS"/megatron_core-*.whl >/dev/null 2>&1; then
      echo "no megatron-core wheel in $WHEELS: see the header of this script"
      return 1
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHEELS"/megatron_core-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PYTHON" -c "import megatron.core as m; print('megatron-core', m.__version__)"
  # The backend the runs below use: parallel.backend=auto for the trainer, and the weight sync follows it.
  "$PYTHON" -c "
from megagrpo.parallel.backends import resolve_backend, weight_sync_backend
b = resolve_backend('auto', check_available=True)
print('backend: trainer', b, '(parallel.backend=auto), weight sync', weight_sync_backend(b))
"
}

run_all() {
  check_environment
  local model lengths batch budget steps mem
  if [[ $SMOKE == 1 ]]; then
    # Toy shape on the CPU (gloo): every code path of the real run, in under a minute.
    model=(--preset smoke --dtype bfloat16 --tp 1 --backend auto --recompute core_attention --peak-tflops 989)
    lengths=(128 256)
    batch=(4 2)
    budget=512
    bucket_mb=0.05
    steps=(--warmup 1 --iters 2)
    mem=(--tokens 512 1024 --vocab 4096 --chunk 256)
  else
    model=(--preset qwen2-1.5b --dtype bfloat16 --tp 1 --backend auto --recompute core_attention --peak-tflops 989)
    lengths=(4096 8192)
    batch=(8 4)
    budget=16384
    bucket_mb=512
    steps=(--warmup 2 --iters 5)
    mem=(--tokens 8192 16384 --vocab 151936 --chunk 1024)
  fi
  local status=0 seq left i sync

  # Shortest and surest first: the memory comparison (about a minute on the H200).
  if [[ -z "${SKIP_MEMORY:-}" ]]; then # SKIP_MEMORY=1: the training runs alone
    stamp "logprob_memory"
    timeout 150 "$PYTHON" benchmarks/logprob_memory.py "${mem[@]}" --out "$RESULTS/logprob_memory.json" ||
      { status=$?; stamp "logprob_memory failed ($status)"; }
  fi

  for i in 0 1; do
    seq=${lengths[$i]}
    left=$((PLAN_S - (SECONDS - START)))
    if ((left < 100)); then
      stamp "skipping sequence $seq: ${left}s left of the plan"
      continue
    fi
    if ((left > 220)); then left=220; fi
    # The first run also times the weight-sync sender on this model (see train_bench.py).
    sync=()
    if ((i == 0)); then sync=(--sync-bucket-mb "$bucket_mb"); fi
    stamp "train_bench sequence $seq (at most ${left}s)"
    # Every sequence is exactly $seq tokens (--min-len-frac 1): tokens/s counts no padding.
    timeout "$left" "$PYTHON" benchmarks/train_bench.py "${model[@]}" "${steps[@]}" --seq "$seq" \
      --batch "${batch[$i]}" --budget "$budget" --min-len-frac 1.0 "${sync[@]}" --timeout $((left - 5)) \
      --out "$RESULTS/train_$seq.json" || { status=$?; stamp "train_bench $seq failed ($status)"; }
  done

  stamp "summary"
  for f in "$RESULTS"/logprob_memory.md "$RESULTS"/train_*.md; do
    if [[ -f "$f" ]]; then
      echo "--- $f"
      cat "$f"
    fi
  done
  if [[ $SMOKE == 0 ]]; then
    nvidia-smi --query-gpu=memory.used,temperature.gpu,clocks.sm --format=csv
  fi
  stamp "done (status $status)"
  return $status
}

run_all 2>&1 | tee "$RESULTS/gpu_h200.log"
exit "${PIPESTATUS[0]}"
