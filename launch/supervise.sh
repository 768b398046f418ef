#!/usr/bin/env bash
# Run a megagrpo command and run it again with --resume when it stops on a fault, up to K times
# (as torchrun's elastic agent restarts a job):
#   launch/supervise.sh --max-restarts K megagrpo train --config FILE ...
# Relaunched: exit status 75 (megagrpo's "stopped on a fault; --resume continues it": a policy rank
# lost, engines failing past generation.max_engine_restarts) and deaths by a signal other than
# SIGINT/SIGTERM (e.g. the driver OOM-killed). Final: success, errors (status 1, 2) and Ctrl-C.
# The relaunch adds --resume (once); SUPERVISE_DELAY_S (default 10) seconds pass before it.
set -uo pipefail
max=0
if [ "${1:-}" = "--max-restarts" ]; then
  max="${2:?--max-restarts needs a number}"
  shift 2
fi
[ "$#" -gt 0 ] || { echo "usage: launch/supervise.sh [--max-restarts K] COMMAND [ARGS...]" >&2; exit 2; }
command=("$@")
restarts=0
while true; do
  "${command[@]}"
  status=$?
  if [ "$status" -ne 75 ] && { [ "$status" -le 128 ] || [ "$status" -eq 130 ] || [ "$status" -eq 143 ]; }; then
    exit "$status"
  fi
  if [ "$restarts" -ge "$max" ]; then
    echo "supervise: exit status $status after $restarts restart(s) of $max; giving up" >&2
    exit "$status"
  fi
  restarts=$((restarts + 1))
  echo "supervise: exit status $status; relaunching with --resume ($restarts of $max)" >&2
  case " ${command[*]} " in *" --resume "*) ;; *) command+=(--resume) ;; esac
  sleep "${SUPERVISE_DELAY_S:-10}"
done
