#!/usr/bin/env bash
# Start the Ray head on this node, then run a megagrpo command against the cluster.
#   launch/ray_head.sh [--max-restarts K] [megagrpo args...]
#   e.g. launch/ray_head.sh --max-restarts 3 train --config configs/deepscaler/8k.yaml
# Workers join with launch/ray_worker.sh <head-ip>:<port>. The command gets cluster.ray_address=auto.
# --max-restarts K: relaunch the command with --resume after it stops on a fault (launch/supervise.sh).
# NODE_RESOURCES='{"trainer_node": 1}' labels this node for cluster.policy_resource / engine_resource.
# Ray's token authentication is on (launch/ray_auth.sh: the head creates ~/.ray/auth_token, or
# RAY_AUTH_TOKEN_PATH, when missing; every node needs the same token; RAY_AUTH_MODE=disabled turns it off).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
supervise=()
if [ "${1:-}" = "--max-restarts" ]; then
  supervise=("$here/launch/supervise.sh" --max-restarts "${2:?--max-restarts needs a number}")
  shift 2
fi
bin="${VENV:-$here/.venv}/bin"
. "$here/launch/ray_auth.sh" head
port="${RAY_PORT:-6379}"
"$bin/ray" start --head --port "$port" --num-gpus "${GPUS_PER_NODE:-0}" --disable-usage-stats \
  ${NODE_RESOURCES:+--resources "$NODE_RESOURCES"}
trap '"$bin/ray" stop' EXIT
if [ "$#" -gt 0 ]; then
  "${supervise[@]}" "$bin/megagrpo" "$@" cluster.ray_address=auto
fi
