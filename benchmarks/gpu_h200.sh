#!/usr/bin/env bash
# Policy training throughput, MFU and memory on one H200 with the torch layers (PyTorch SDPA / varlen
# attention, torch RMSNorm) next to Megatron's local layers, in one call of the device tool.
#
#   bash benchmarks/gpu_h200.sh            # on the H200 (planned to end within 8 minutes)
#   bash benchmarks/gpu_h200.sh --smoke    # the same steps with a toy model on this CPU (gloo)
#
# What it runs, from the repository root:
#   1. nvidia-smi and torch.cuda checks; megatron-core 0.16.1 installed from the carried wheel when
#      the image lacks it (the image has PyTorch, no Transformer Engine, no internet).
#   2. benchmarks/train_bench.py: PolicyWorker.train() vs a bare Megatron step (same engine, same
#      micro-batches) for a Qwen2-1.5B-shaped random model (28 layers, hidden 1536, ffn 8960, 12 heads,
#      2 kv groups, vocab 151936, tied), bf16, TP=1, one rank, nccl (parallel.backend=auto), micro-batch
#      budget 16384 tokens, every sequence exactly 4096 (8 per step) or 8192 (4 per step) tokens. Runs,
#      in this order, each while the plan has time left (results appended to train_<seq>.json):
#        a. torch layers, 4096    (parallel.transformer_impl=torch: SDPA flash attention, sequences
#                                  packed end to end through varlen_attn, no recompute)
#        b. torch layers, 8192
#        c. local layers, 4096    (Megatron's unfused attention keeps fp32 [b, heads, s, s]
#                                  probabilities, ~34 GB per 4K sequence at this shape: selective
#                                  recompute of core attention, as the earlier local runs; padded rows)
#        d. torch layers + compile, 4096 (Megatron's torch.compile'd SwiGLU and bias-dropout-add)
#        e. local layers, 8192
#      Each reports tokens/s, MFU = 6 N tokens/s / 989e12 (N = 1.544e9, all parameters with the tied
#      embedding once) and (6 N + 12 L h s) tokens/s / 989e12 with the attention matmuls, peak memory
#      and activation memory (bytes saved for backward); the Markdown has torch/local ratios.
#      Recomputed FLOPs are not counted in the MFU.
#   3. With RUN_MEMORY=1 first: benchmarks/logprob_memory.py on CUDA (chunked vocab-parallel logprobs vs
#      log_softmax over full fp32 logits, 8192 and 16384 tokens; measured before, results kept in
#      benchmarks/results/gpu_h200/logprob_memory.*).
#
# Preparing the call (here, once): the wheel for the device's Python 3.12 goes to an ignored folder,
#   .venv/bin/python -m pip download megatron-core==0.16.1 --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 -d benchmarks/results/tmp/wheels
# and the run tool is called with
#   carry: ["benchmarks/results/tmp/wheels"]
#   command: bash benchmarks/gpu_h200.sh
#   timeout_s: 540
# Results come back through $OUT: $OUT/gpu_h200/train_{4096,8192}.{json,md} and gpu_h200.log (and
# logprob_memory.{json,md} with RUN_MEMORY=1); copy them to benchmarks/results/gpu_h200/. Without $OUT
# they are written there directly. WHEELS=<dir> and PYTHON=<interpreter> override the defaults.
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
PLAN_S=460    # everything inside 8 minutes
MIN_RUN_S=80  # a train_bench run that cannot have this long is skipped
MAX_RUN_S=170 # and none takes longer (its own timeout)
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

# One train_bench run (appended to train_<seq>.json), if the plan has time left:
#   train_run LABEL IMPL SEQ BATCH [train_bench options...]
train_run() {
  local label=$1 impl=$2 seq=$3 batch=$4 left
  shift 4
  left=$((PLAN_S - (SECONDS - START)))
  if ((left < MIN_RUN_S)); then
    stamp "skipping $label: ${left}s left of the plan"
    return 0
  fi
  if ((left > MAX_RUN_S)); then left=$MAX_RUN_S; fi
  stamp "train_bench $label (at most ${left}s)"
  # Every sequence is exactly $seq tokens (--min-len-frac 1): tokens/s counts no padding.
  timeout "$left" "$PYTHON" benchmarks/train_bench.py "${model[@]}" "${steps[@]}" --impl "$impl" \
    --seq "$seq" --batch "$batch" --budget "$budget" --min-len-frac 1.0 --timeout $((left - 5)) \
    --append --out "$RESULTS/train_$seq.json" "$@" || { status=$?; stamp "train_bench $label failed ($status)"; }
}

run_all() {
  check_environment
  local mem short long
  if [[ $SMOKE == 1 ]]; then
    # Toy shape on the CPU (gloo): every code path of the real run, in a few minutes.
    model=(--preset smoke --dtype bfloat16 --tp 1 --backend auto --peak-tflops 989)
    short=128
    long=256
    budget=512 # 4 x 128 or 2 x 256 tokens per micro-batch, two micro-batches per step
    steps=(--warmup 1 --iters 2)
    mem=(--tokens 512 1024 --vocab 4096 --chunk 256)
  else
    model=(--preset qwen2-1.5b --dtype bfloat16 --tp 1 --backend auto --peak-tflops 989)
    short=4096
    long=8192
    budget=16384 # 4 x 4096 or 2 x 8192 tokens per micro-batch, two micro-batches per step
    steps=(--warmup 2 --iters 5)
    mem=(--tokens 8192 16384 --vocab 151936 --chunk 1024)
  fi
  status=0
  rm -f "$RESULTS"/train_"$short".* "$RESULTS"/train_"$long".* # --append: start from empty reports

  if [[ -n "${RUN_MEMORY:-}" ]]; then
    stamp "logprob_memory"
    timeout 150 "$PYTHON" benchmarks/logprob_memory.py "${mem[@]}" --out "$RESULTS/logprob_memory.json" ||
      { status=$?; stamp "logprob_memory failed ($status)"; }
  fi

  # The new measurements first, then the local layers beside them, then the extras.
  local b_short=$((2 * budget / short)) b_long=$((2 * budget / long))
  train_run "torch $short" torch "$short" "$b_short"
  train_run "torch $long" torch "$long" "$b_long"
  train_run "local $short" local "$short" "$b_short" --recompute core_attention
  train_run "torch+compile $short" torch "$short" "$b_short" --compile
  train_run "local $long" local "$long" "$b_long" --recompute core_attention

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
