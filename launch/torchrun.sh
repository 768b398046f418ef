#!/usr/bin/env bash
# Run a megagrpo trainer command with torchrun: one process per trainer rank, on one or many nodes.
# Ranks read RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from torchrun; the config's parallel layout
# (DP x TP x PP x CP) must equal NNODES x NPROC_PER_NODE.
#
#   single node, 2 ranks:   NPROC_PER_NODE=2 launch/torchrun.sh warmup --config configs/tiny_cpu.yaml
#   node i of N:            NNODES=N NODE_RANK=i MASTER_ADDR=head-host NPROC_PER_NODE=8 launch/torchrun.sh warmup ...
#
# Only trainer-only commands run this way (`sft`, `dpo`, `warmup`). GRPO (`megagrpo train`) also drives
# vLLM engines and is launched through Ray instead (launch/ray_head.sh, launch/slurm.sbatch).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$here/.venv/bin/python}"
exec "$python" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" \
  --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  -m megagrpo.cli "$@"
