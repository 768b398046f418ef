"""launch/slurm.sbatch's own logic, run with stand-in ``srun`` / ``scontrol`` / ``ray`` / ``megagrpo``.

This is not a test of SLURM or of Ray (tests/e2e/test_slurm_real.py runs the script on a real Slurm):
``srun [OPTIONS] -w NODE CMD`` runs CMD here with ``SLURMD_NODENAME=NODE`` (and notes the options), the
stand-in ``ray start`` registers its node's ``slurm_node_<name>`` resource (a worker only when the head it
names is up), blocks like the real one and notes its node as stopped when its step is ended (SIGTERM to
its srun), and ``ray status`` lists the resources of the nodes whose ``ray start`` is running. What is
checked is the script: it waits for every node and names the missing ones after its timeout (or at once
when their Ray step ended), starts the command with the cluster's address, passes its exit code through,
and ends the Ray step of every node however the job ends.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "slurm.sbatch"

STANDINS = {
    "scontrol": """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || { echo "scontrol stand-in: $*" >&2; exit 2; }
tr ',' '\\n' <<<"$3"
""",
    "srun": """#!/usr/bin/env bash
node= options=()
while [[ "$1" == -* ]]; do
  case "$1" in
    -w) node="$2"; shift 2 ;;
    *) options+=("$1"); shift ;;
  esac
done
[[ -n "$node" ]] || { echo "srun stand-in: no -w NODE" >&2; exit 2; }
echo "${options[*]} $1 $2" >>"$FAKE_STATE/srun.calls"
export SLURMD_NODENAME="$node"
exec "$@"
""",
    "hostname": """#!/usr/bin/env bash
echo 127.0.0.1
""",
}

FAKE_RAY = """#!/usr/bin/env bash
state="$FAKE_STATE"
cmd="$1"; shift
[[ "$cmd" == status ]] || node="${SLURMD_NODENAME:?ray $cmd stand-in run outside srun}"
case "$cmd" in
  start)
    head=0 address= port= resources=
    while (($#)); do
      case "$1" in
        --head) head=1; shift ;;
        --address) address="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --resources) resources="$2"; shift 2 ;;
        --block|--disable-usage-stats) shift ;;
        *) shift 2 ;;
      esac
    done
    [[ ":$FAKE_DOWN:" == *":$node:"* ]] && { echo "ray start failed on $node" >&2; exit 1; }
    trap 'echo "$node" >>"$state/stopped"; kill "$sleeper"; exit 0' TERM
    sleep 300 &
    sleeper=$!
    echo "$$" >"$state/pid.$node"
    [[ ":$FAKE_SILENT:" == *":$node:"* ]] && { wait; exit 0; }  # runs, never joins
    if ((head)); then
      echo "127.0.0.1:$port" >"$state/head_address"
    else
      [[ -f "$state/head_address" && "$(cat "$state/head_address")" == "$address" ]] ||
        { echo "no head at $address" >&2; exit 1; }
    fi
    echo "$resources" >"$state/resources.$node"
    echo "${RAY_AUTH_MODE:-}:${RAY_AUTH_TOKEN:-}" >"$state/auth.$node"
    wait
    ;;
  status)
    [[ -f "$state/head_address" ]] || { echo "no cluster" >&2; exit 1; }
    # As Ray's: a client without the head's authentication mode and token is refused.
    for f in "$state"/auth.*; do
      [[ "$(cat "$f")" == "${RAY_AUTH_MODE:-}:${RAY_AUTH_TOKEN:-}" ]] || { echo "auth" >&2; exit 1; }
    done
    echo "Resources"
    for f in "$state"/resources.*; do
      [[ -f "$f" ]] || continue
      n="${f##*/resources.}"
      kill -0 "$(cat "$state/pid.$n")" 2>/dev/null || continue
      sed -E 's/[{}" ]//g; s/:1$//; s/^/ 0.0\\/1.0 /' "$f"
    done
    ;;
  stop)
    echo "ray stop stops every Ray on the node, not only the job's" >&2
    exit 1
    ;;
esac
"""

FAKE_MEGAGRPO = """#!/usr/bin/env bash
echo "RAY_ADDRESS=$RAY_ADDRESS $*" >"$FAKE_STATE/megagrpo"
echo "${RAY_AUTH_MODE:-}:${RAY_AUTH_TOKEN:-}" >"$FAKE_STATE/auth.megagrpo"
echo "$*" >>"$FAKE_STATE/megagrpo.calls"
exit "${FAKE_EXIT:-0}"
"""


def run_job(
    tmp_path: Path,
    nodes: str,
    *,
    down: str = "",
    silent: str = "",
    exit_code: int = 0,
    gpus: str = "0",
    timeout_s: str = "20",
    options: tuple[str, ...] = (),
):
    bin_dir, venv, state = tmp_path / "bin", tmp_path / "venv", tmp_path / "state"
    for d in (bin_dir, venv / "bin", state):
        d.mkdir(parents=True)
    files = {**{bin_dir / k: v for k, v in STANDINS.items()}, venv / "bin" / "ray": FAKE_RAY}
    files[venv / "bin" / "megagrpo"] = FAKE_MEGAGRPO
    for path, text in files.items():
        path.write_text(text)
        path.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},  # the job makes its own
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VENV": str(venv),
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RAY_PORT": "6399",
        "JOIN_TIMEOUT_S": timeout_s,
        "JOIN_POLL_S": "0.2",
        "FAKE_STATE": str(state),
        "FAKE_DOWN": down,
        "FAKE_SILENT": silent,
        "GPUS_PER_NODE": gpus,
        "FAKE_EXIT": str(exit_code),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), *options, "train", "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, state


def ray_left_running(state: Path) -> list[str]:
    left = []
    for f in state.glob("pid.*"):
        try:
            os.kill(int(f.read_text()), 0)
            left.append(f.name)
        except ProcessLookupError:
            pass
    return left


def stopped(state: Path) -> list[str]:
    return sorted((state / "stopped").read_text().split())


def test_every_node_joins_then_the_command_runs_and_ray_stops_everywhere(tmp_path):
    proc, state = run_job(tmp_path, "n0,n1,n2")
    assert proc.returncode == 0, proc.stderr
    assert "all 3 nodes joined" in proc.stdout
    assert (state / "megagrpo").read_text().split() == [
        "RAY_ADDRESS=127.0.0.1:6399",
        "train",
        "--config",
        "x.yaml",
        "cluster.ray_address=127.0.0.1:6399",
    ]
    assert sorted(p.name for p in state.glob("resources.*")) == [
        "resources.n0",
        "resources.n1",
        "resources.n2",
    ]
    assert stopped(state) == ["n0", "n1", "n2"]
    assert ray_left_running(state) == []
    # One token, made for the job, reaches every node's Ray and the command.
    auth = {p.name: p.read_text().strip() for p in state.glob("auth.*")}
    assert sorted(auth) == ["auth.megagrpo", "auth.n0", "auth.n1", "auth.n2"]
    mode, token = auth["auth.n0"].split(":")
    assert mode == "token" and len(token) == 64 and set(auth.values()) == {auth["auth.n0"]}


def test_the_command_exit_code_is_the_job_exit_code_and_ray_is_stopped(tmp_path):
    proc, state = run_job(tmp_path, "n0,n1", exit_code=3)
    assert proc.returncode == 3, proc.stderr
    assert (state / "megagrpo").exists()
    assert stopped(state) == ["n0", "n1"]
    assert ray_left_running(state) == []


def test_a_node_that_never_joins_is_named_and_the_command_never_starts(tmp_path):
    proc, state = run_job(tmp_path, "n0,n1,n2,n3", silent="n2:n3", timeout_s="2")
    assert proc.returncode == 1
    assert "2 of 4 nodes did not join the Ray cluster at 127.0.0.1:6399 within 2s: n2 n3" in proc.stderr
    assert not (state / "megagrpo").exists()
    assert stopped(state) == ["n0", "n1", "n2", "n3"]
    assert ray_left_running(state) == []


def test_a_ray_step_that_ends_before_joining_ends_the_job_without_waiting_out_the_timeout(tmp_path):
    proc, state = run_job(tmp_path, "n0,n1,n2", down="n2", timeout_s="600")
    assert proc.returncode == 1
    assert "the Ray step ended on 1 of 3 nodes before the command started: n2" in proc.stderr
    assert not (state / "megagrpo").exists()
    assert stopped(state) == ["n0", "n1"]
    assert ray_left_running(state) == []


def test_every_step_overlaps_and_ray_steps_ask_for_the_gpus(tmp_path):
    proc, state = run_job(tmp_path, "n0,n1", gpus="8")
    assert proc.returncode == 0, proc.stderr
    calls = (state / "srun.calls").read_text().splitlines()
    assert all(call.startswith("--overlap --nodes=1 --ntasks=1") for call in calls), calls
    ray_steps = [call for call in calls if call.endswith("ray start")]
    assert len(ray_steps) == 2 and all("--gres=gpu:8" in call for call in ray_steps), calls
    assert not any("--gres" in call for call in calls if call not in ray_steps), calls


def test_max_restarts_relaunches_a_fault_with_resume(tmp_path):
    (tmp_path / "launch").mkdir()
    supervise = tmp_path / "launch" / "supervise.sh"  # the submit directory is the repository
    supervise.write_text((SCRIPT.parent / "supervise.sh").read_text())
    supervise.chmod(0o755)
    os.environ["SUPERVISE_DELAY_S"] = "0"
    try:
        proc, state = run_job(tmp_path, "n0,n1", exit_code=75, options=("--max-restarts", "1"))
    finally:
        del os.environ["SUPERVISE_DELAY_S"]
    assert proc.returncode == 75, proc.stderr
    calls = (state / "megagrpo.calls").read_text().splitlines()
    address = "cluster.ray_address=127.0.0.1:6399"
    assert calls == [f"train --config x.yaml {address}", f"train --config x.yaml {address} --resume"]
    assert stopped(state) == ["n0", "n1"]
