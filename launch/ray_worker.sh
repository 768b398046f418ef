#!/usr/bin/env bash
# Join a Ray cluster started by launch/ray_head.sh:   launch/ray_worker.sh HEAD_IP:PORT
# NODE_RESOURCES='{"engine_node": 1}' labels this node for cluster.policy_resource / engine_resource.
# Token authentication as the head's (launch/ray_auth.sh): this node needs the head's token file.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${VENV:-$here/.venv}/bin"
address="${1:?usage: ray_worker.sh HEAD_IP:PORT}"
. "$here/launch/ray_auth.sh" worker
exec "$bin/ray" start --address "$address" --num-gpus "${GPUS_PER_NODE:-0}" --block --disable-usage-stats \
  ${NODE_RESOURCES:+--resources "$NODE_RESOURCES"}
