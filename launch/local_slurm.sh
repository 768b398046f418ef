#!/usr/bin/env bash
# A real one-node Slurm on this machine, for testing launch/slurm.sbatch and launch/slurm_torchrun.sbatch
# (tests/e2e/test_slurm_real.py):
#   launch/local_slurm.sh start|stop|status          (make slurm-up / make slurm-down)
# then, in the shell that submits:  export SLURM_CONF=/tmp/megagrpo-slurm/slurm.conf
#
# start: when sbatch, slurmctld, slurmd or munged is missing, installs Debian's packages, as root and
# without asking: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# (Debian 12 ships Slurm 22.05). Then writes a munge key and a slurm.conf into the state directory,
# starts munged, slurmctld and slurmd as plain daemons (no systemd) and waits until the node is idle.
# One node, named `hostname -s`, with the CPUs and memory that `slurmd -C` finds; select/cons_tres;
# proctrack/linuxproc and task/none, since a container has no cgroups to give Slurm; no accounting
# (`scontrol show job` and `sbatch --wait` report exit codes). Everything runs as root and lives in the
# state directory: config, key, sockets, state, spool and logs. Already up with the same configuration:
# nothing is restarted; with another one (say LOCAL_SLURM_GPUS changed): restarted.
# LOCAL_SLURM_GPUS=N declares N stand-in GPUs: GRES whose device files are links to /dev/null, so that
# GPU requests are scheduled and steps get CUDA_VISIBLE_DEVICES, with no GPU behind them.
# stop: cancels the jobs, stops the daemons and removes the state directory. status: exit 0 when up.
# Environment: MEGAGRPO_SLURM_DIR (the state directory, default /tmp/megagrpo-slurm), LOCAL_SLURM_GPUS (0),
# SLURMCTLD_PORT (6817), SLURMD_PORT (6818), SLURM_UP_TIMEOUT_S (60).
set -euo pipefail
state="${MEGAGRPO_SLURM_DIR:-/tmp/megagrpo-slurm}"
export SLURM_CONF="$state/slurm.conf"
node="$(hostname -s)"
gpus="${LOCAL_SLURM_GPUS:-0}"
up_timeout="${SLURM_UP_TIMEOUT_S:-60}"

say() { echo "local_slurm: $*" >&2; }

install_slurm() {
  local tool missing=()
  for tool in sbatch srun scontrol sinfo squeue scancel slurmctld slurmd munged; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  ((${#missing[@]} == 0)) && return 0
  if ((EUID != 0)) || ! command -v apt-get >/dev/null; then
    say "${missing[*]} not installed; installing Debian's slurmctld slurmd slurm-client munge needs root" \
      "and apt-get"
    return 1
  fi
  say "installing slurmctld slurmd slurm-client munge with apt-get (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

running() { # daemon: whether the pid in its pid file is alive
  local pid_file="$state/run/$1.pid"
  [[ -s "$pid_file" ]] && kill -0 "$(cat "$pid_file")" 2>/dev/null
}

all_running() { running munged && running slurmctld && running slurmd; }

slurm_conf() { # the configuration, on stdout
  local hardware gres=
  # slurmd's own view of the machine: a node configured with more than it finds is drained.
  hardware="$(slurmd -C | head -n 1 | sed -E 's/^NodeName=[^ ]+ //')"
  if ((gpus > 0)); then
    gres=" Gres=gpu:$gpus"
  fi
  cat <<EOF
ClusterName=megagrpo
SlurmctldHost=$node
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$state/run/munge.socket
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=10
MinJobAge=600
GresTypes=gpu
NodeName=$node $hardware$gres State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

write_state() { # config text
  local i
  mkdir -p "$state"/{munge,run,log,ctld,spool}
  chmod 700 "$state/munge"
  head -c 1024 /dev/urandom >"$state/munge/munge.key"
  chmod 400 "$state/munge/munge.key"
  printf '%s\n' "$1" >"$SLURM_CONF"
  : >"$state/gres.conf"
  for ((i = 0; i < gpus; i++)); do
    ln -s /dev/null "$state/gpu$i"
    echo "Name=gpu File=$state/gpu$i" >>"$state/gres.conf"
  done
}

wait_idle() {
  local deadline=$((SECONDS + up_timeout)) node_state=
  while ((SECONDS < deadline)); do
    node_state="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
    [[ "$node_state" == idle ]] && return 0
    sleep 1
  done
  say "node $node is '${node_state:-not listed}' after ${up_timeout}s, not idle; logs in $state/log:"
  tail -n 20 "$state"/log/*.log >&2 || true
  return 1
}

start() {
  local config
  install_slurm
  config="$(slurm_conf)"
  if all_running && [[ "$config" == "$(cat "$SLURM_CONF")" ]]; then
    say "already up ($state)"
  else
    if [[ -e "$state" ]]; then
      say "$state holds another configuration or a stopped Slurm; stopping it first"
      stop
    fi
    write_state "$config"
    munged --force --key-file="$state/munge/munge.key" --socket="$state/run/munge.socket" \
      --pid-file="$state/run/munged.pid" --log-file="$state/log/munged.log" --seed-file="$state/munge/seed"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
  fi
  wait_idle
  say "up: node $node idle; export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local daemon pid jobs
  if running slurmctld; then
    mapfile -t jobs < <(squeue -h -o %i 2>/dev/null || true)
    if ((${#jobs[@]} > 0)); then
      scancel "${jobs[@]}" || true
      for _ in {1..30}; do
        [[ -z "$(squeue -h -o %i 2>/dev/null || true)" ]] && break
        sleep 1
      done
    fi
  fi
  for daemon in slurmd slurmctld munged; do
    running "$daemon" || continue
    pid="$(cat "$state/run/$daemon.pid")"
    kill "$pid"
    for _ in {1..50}; do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -rf "$state"
  say "stopped; $state removed"
}

status() {
  if all_running; then
    sinfo -o "%P %a %D %T %N %G"
    echo "export SLURM_CONF=$SLURM_CONF"
  else
    say "not running ($state)"
    return 1
  fi
}

case "${1:-}" in
  start | stop | status) "$1" ;;
  *)
    echo "usage: launch/local_slurm.sh start|stop|status" >&2
    exit 2
    ;;
esac
