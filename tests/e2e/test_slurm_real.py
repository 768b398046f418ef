"""The SLURM launch scripts on a real Slurm: a one-node cluster on this machine (``launch/local_slurm.sh``,
Debian's Slurm 22.05, installed on first use), with two stand-in GPUs (GRES over /dev/null) so that the
scripts' GPU requests are scheduled for real.

- ``launch/slurm.sbatch`` runs a 2-step GRPO job of the tiny config: its Ray head runs in a background
  ``srun`` step beside the later steps, the command joins it, the job exits 0 and every process of the
  job is gone afterwards;
- a command that fails (exit 2) is the job's exit code, after Ray joined with 2 GPUs asked of Slurm; a job
  asking for more GPUs than the node has fails its Ray step at once: exit 1, naming the node, the command
  never started; neither leaves a process behind;
- ``launch/slurm_torchrun.sbatch`` runs ``megagrpo sft`` as one torchrun of 2 gloo ranks, exit 0 with the
  run's metrics and checkpoint, and passes a failing command's exit code through.

The fixture fails (does not skip) when Slurm cannot be installed or started: CI runs as root on Debian 12.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from megagrpo.ckpt import manifest
from megagrpo.parallel.local import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LOCAL_SLURM = REPO / "launch" / "local_slurm.sh"
NODE_GPUS = 2  # the stand-in GPUs of the local node
JOB_DEADLINE_S = 900  # generous: a hung job fails the test with its output


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment that submits to the local Slurm (SLURM_CONF); stopped afterwards unless it was up."""
    env = os.environ | {"LOCAL_SLURM_GPUS": str(NODE_GPUS)}
    state = Path(env.get("MEGAGRPO_SLURM_DIR", "/tmp/megagrpo-slurm"))

    def local_slurm(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(LOCAL_SLURM), command], env=env, capture_output=True, text=True, timeout=900
        )

    was_up = local_slurm("status").returncode == 0
    started = local_slurm("start")
    if started.returncode != 0:
        pytest.fail(
            f"launch/local_slurm.sh start failed (exit {started.returncode}): these tests need a real Slurm, "
            f"installed from Debian's packages as root\n{started.stdout}\n{started.stderr}"
        )
    pointer = Path("/tmp/ray/ray_current_cluster")  # where a bare ray.init() looks for a cluster to join
    before = pointer.read_text() if pointer.is_file() else None
    yield env | {"SLURM_CONF": str(state / "slurm.conf")}
    if not was_up:
        local_slurm("stop")
    # The jobs' `ray start --head` pointed it at their clusters, now gone (their steps were ended, not
    # `ray stop`ped, which would remove it): a later bare ray.init() in this machine would wait on them.
    if pointer.is_file() and pointer.read_text() != before:
        pointer.unlink()


def submit(env: dict, tmp_path: Path, script: str, *args: str, **job_env: str) -> tuple[int, int, str]:
    """sbatch of launch/<script> from the repository root, waited for; (job id, exit code, job output)."""
    output = tmp_path / f"{script}-%j.out"
    env = env | {"VENV": str(REPO / ".venv"), **job_env}
    cmd = ["sbatch", "--parsable", f"--output={output}", str(REPO / "launch" / script), *args]
    job = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    job = job.split(";")[0].strip()
    output = Path(str(output).replace("%j", job))
    # Slurm's record of the job, polled: sbatch --wait checks ever less often, up to half a minute late.
    deadline = time.monotonic() + JOB_DEADLINE_S
    while (record := _job_record(env, job))["JobState"] in _UNFINISHED:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} still running after {JOB_DEADLINE_S}s\n{_read(output)}")
        time.sleep(1)
    code, signal = record["ExitCode"].split(":")
    assert signal == "0", f"job {job} ended by signal {signal}: {record}\n{_read(output)}"
    return int(job), int(code), _read(output)


_UNFINISHED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def _job_record(env: dict, job: str) -> dict[str, str]:
    line = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job], env=env, capture_output=True, text=True, check=True
    ).stdout
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


def _read(output: Path) -> str:
    return output.read_text() if output.exists() else f"(no job output at {output})"


def processes_of_job(job: int) -> list[str]:
    """Command lines of the processes whose environment says they belong to Slurm job ``job``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job}".encode() in environ:
                found.append(Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def assert_nothing_left(job: int) -> None:
    """No process of the job runs once it ended (Slurm reaps a killed step's processes in a moment)."""
    deadline = time.monotonic() + 30
    while (left := processes_of_job(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes of job {job} still running: {left}"


def metric_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# The jobs' ports (RAY_PORT, MASTER_PORT) are found free here and bound by the job's Ray head or torchrun,
# programs that take a port number, not a socket: the number must exist before the server does. The e2e
# tier runs one test at a time, so only the job's own processes could take it in between; the job would
# then fail to start, visibly.


def ray_job(**job_env: str) -> dict[str, str]:
    """slurm.sbatch's environment: a free port for Ray, one CPU per actor of the tiny config and more."""
    return {"RAY_PORT": str(free_port()), "CPUS_PER_NODE": "4", "JOIN_POLL_S": "1", **job_env}


def test_grpo_job_on_slurm(slurm_env, tmp_path):
    overrides = [
        f"logging.dir={tmp_path / 'runs'}",
        "run_name=slurm",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "logging.val_every=0",
        "warmup.steps=2",
        "warmup.batch_size=8",
        "warmup.num_eval_prompts=8",
        "grpo.num_prompts_per_step=4",
        "grpo.num_steps=2",
        "policy.mini_batch_size=16",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.export_hf_at_end=false",
    ]
    job, code, output = submit(
        slurm_env,
        tmp_path,
        "slurm.sbatch",
        *("train", "--config", "configs/tiny_cpu.yaml", *overrides),
        **ray_job(GPUS_PER_NODE="0"),
    )
    assert code == 0, output
    assert "all 1 nodes joined the Ray cluster" in output
    assert "placement: policy rank 0,1 on node" in output  # the actors ran in the job's Ray
    assert metric_steps(tmp_path / "runs" / "slurm" / "metrics.jsonl") == [1, 2], output
    assert_nothing_left(job)


def test_failed_command_is_the_job_exit_code_after_ray_joined_with_gpus(slurm_env, tmp_path):
    job, code, output = submit(
        slurm_env,
        tmp_path,
        "slurm.sbatch",
        *("train", "--config", "configs/tiny_cpu.yaml", "--no-such-option"),
        **ray_job(GPUS_PER_NODE=str(NODE_GPUS)),
    )
    assert code == 2, output  # argparse's exit code, not the script's own 1
    assert "all 1 nodes joined the Ray cluster" in output
    assert "unrecognized arguments: --no-such-option" in output
    assert_nothing_left(job)


def test_ray_step_that_slurm_refuses_ends_the_job_at_once(slurm_env, tmp_path):
    job, code, output = submit(
        slurm_env,
        tmp_path,
        "slurm.sbatch",
        *("train", "--config", "configs/tiny_cpu.yaml"),
        **ray_job(GPUS_PER_NODE=str(NODE_GPUS + 1), JOIN_TIMEOUT_S="600"),
    )
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    assert code == 1, output
    assert "Invalid generic resource (gres) specification" in output  # Slurm's own refusal
    assert f"the Ray step ended on 1 of 1 nodes before the command started: {node}" in output
    assert "nodes joined" not in output  # the command never started
    assert_nothing_left(job)


def test_sft_job_under_torchrun_on_slurm(slurm_env, tmp_path):
    overrides = [
        f"logging.dir={tmp_path / 'runs'}",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "sft.num_steps=2",
        "sft.batch_size=8",
        "sft.val_every=2",
        "sft.num_val_examples=8",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.save_every=2",
        "checkpoint.export_hf_at_end=false",
    ]
    job, code, output = submit(
        slurm_env,
        tmp_path,
        "slurm_torchrun.sbatch",
        *("sft", "--config", "configs/tiny_sft.yaml", *overrides),
        GPUS_PER_NODE="0",
        NPROC_PER_NODE="2",  # tiny_sft: TP=2
        MASTER_PORT=str(free_port()),
    )
    assert code == 0, output
    assert "1 node(s) x 2 rank(s)" in output
    assert metric_steps(tmp_path / "runs" / "tiny-sft" / "metrics.jsonl") == [0, 1, 2], output
    manifest.verify(tmp_path / "ckpt" / "step_2")
    assert_nothing_left(job)


def test_failed_torchrun_command_fails_the_job(slurm_env, tmp_path):
    job, code, output = submit(
        slurm_env,
        tmp_path,
        "slurm_torchrun.sbatch",
        *("warmup", "--config", "configs/tiny_cpu.yaml", "--no-such-option"),
        GPUS_PER_NODE=str(NODE_GPUS),
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
    )
    assert code == 1, output  # torchrun's exit code when its ranks fail (each exited 2)
    assert "unrecognized arguments: --no-such-option" in output
    assert_nothing_left(job)
