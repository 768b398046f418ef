#!/usr/bin/env bash
# Start the Ray head on this node, then run a megagrpo command against the cluster.
#   launch/ray_head.sh [megagrpo args...]       e.g. launch/ray_head.sh train --config configs/deepscaler/8k.yaml
# Workers join with launch/ray_worker.sh <head-ip>:<port>. The command gets cluster.ray_address=auto.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${VENV:-$here/.venv}/bin"
port="${RAY_PORT:-6379}"
"$bin/ray" start --head --port "$port" --num-gpus "${GPUS_PER_NODE:-0}" --disable-usage-stats
trap '"$bin/ray" stop' EXIT
if [ "$#" -gt 0 ]; then
  "$bin/megagrpo" "$@" cluster.ray_address=auto
fi
