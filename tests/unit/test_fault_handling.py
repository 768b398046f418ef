"""Fault handling that runs without Ray actors or engines: manifests and verified resume, the engine
restart budget and pool (fake engines), checkpoint write errors (an injected ENOSPC), local Ray
clean-up, loopback stores, and the launch supervisor (stand-in commands)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megagrpo.ckpt import manifest
from megagrpo.ckpt import run as ckpt
from megagrpo.ckpt.manifest import CheckpointCorrupt, DigestCollector, FileDigest
from megagrpo.config import ConfigError, load_config
from megagrpo.policy.worker import PolicyWorker
from megagrpo.trainers.run import Trained

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(root: Path, step: int) -> Path:
    """A checkpoint with one file of each kind a run writes."""
    tmp = ckpt.begin(root, step)
    (tmp / "megatron").mkdir()
    (tmp / "megatron" / "__0_0.distcp").write_bytes(os.urandom(50_000))
    (tmp / "megatron" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}\n')
    return ckpt.commit(tmp, ckpt.DriverState.capture(step, step * 4), "run_name: t\n", keep_last=5)


# ------------------------------------------------------------------------------------- manifests


def test_manifest_lists_every_file_and_verifies(tmp_path):
    step = _checkpoint(tmp_path, 1)
    listed = manifest.read(step)
    assert sorted(listed) == [
        "config.yaml",
        "driver_state.json",
        "megatron/__0_0.distcp",
        "megatron/metadata.json",
    ]
    for rel, digest in listed.items():
        assert digest == manifest.digest_file(step / rel)
    assert manifest.verify(step) == sum(d.size for d in listed.values())


@pytest.mark.parametrize(
    "rel", ["megatron/__0_0.distcp", "megatron/metadata.json", "driver_state.json", "config.yaml"]
)
def test_each_kind_of_damage_names_the_file_and_the_check(rel, tmp_path):
    step = _checkpoint(tmp_path, 1)
    path = step / rel
    size = path.stat().st_size
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointCorrupt, match=rf"{rel}: xxh3_64 checksum [0-9a-f]{{16}}, manifest.json says"
    ):
        manifest.verify(step)
    with path.open("r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointCorrupt, match=rf"{rel}: size {size // 2} bytes, manifest.json says {size}"):
        manifest.verify(step)
    path.unlink()
    with pytest.raises(CheckpointCorrupt, match=rf"{rel}: missing \(listed in manifest.json\)"):
        manifest.verify(step)


def test_a_checkpoint_without_a_readable_manifest_fails(tmp_path):
    step = _checkpoint(tmp_path, 1)
    (step / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointCorrupt, match=r"manifest.json: unreadable"):
        manifest.verify(step)
    (step / "manifest.json").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"manifest.json: missing"):
        manifest.verify(step)


def _write_in_forked_child(collector: DigestCollector, path: Path, chunks: list[bytes]) -> None:
    with collector.writer(path) as fh:
        for chunk in chunks:
            fh.write(chunk)


def test_writers_in_forked_processes_report_the_digest_of_what_they_wrote(tmp_path):
    chunks = [os.urandom(n) for n in (10, 70_000, 3, 1_000_000)]
    with DigestCollector() as collector:
        child = multiprocessing.get_context("fork").Process(
            target=_write_in_forked_child, args=(collector, tmp_path / "a" / "x.distcp", chunks)
        )
        (tmp_path / "a").mkdir()
        child.start()
        child.join()
        with collector.writer(tmp_path / "a" / "y.bin") as fh:  # this process, too
            fh.write(b"abc")
            fh.seek(0)  # rewriting makes the digest unknown: nothing is reported
            fh.write(b"x")
    assert child.exitcode == 0
    assert collector.under(tmp_path) == {"a/x.distcp": manifest.digest_file(tmp_path / "a" / "x.distcp")}
    # build() takes a reported digest only for a file still of that size; the rest is read back.
    known = {"a/x.distcp": FileDigest(1, "0" * 16), "a/y.bin": FileDigest(3, "0" * 16)}
    built = manifest.build(tmp_path, known)
    assert built["a/x.distcp"] == manifest.digest_file(tmp_path / "a" / "x.distcp")
    assert built["a/y.bin"] == FileDigest(3, "0" * 16)


# ----------------------------------------------------------------------------- verified resumes


def test_a_full_disk_under_torch_save_fails_as_the_os_error_naming_the_file():
    """torch.save hides its writer's error behind its own ("unexpected pos ..."); the writer raises
    the OS error again when closed, so a checkpoint writer reports a full disk as one."""
    import torch

    with (
        DigestCollector() as collector,
        pytest.raises(OSError) as failure,
        collector.writer("/dev/full") as fh,  # every write: ENOSPC
    ):
        torch.save({"w": torch.zeros(1 << 16)}, fh)
    assert failure.value.errno == errno.ENOSPC and failure.value.filename == "/dev/full"
    assert collector.digests == {}  # a file that failed reports no digest


def test_resume_falls_back_past_a_corrupt_checkpoint_and_sets_it_aside(tmp_path):
    _checkpoint(tmp_path, 1)
    good = _checkpoint(tmp_path, 2)
    bad = _checkpoint(tmp_path, 3)
    (bad / "driver_state.json").write_text("{}\n")
    said = []
    assert ckpt.latest_verified(tmp_path, "fallback", report=said.append) == good
    assert said[0].startswith("checkpoint step_3 fails verification: ")
    assert "step_3/driver_state.json: size 3 bytes" in said[0]
    assert said[1:] == [
        "checkpoint step_3 set aside as step_3.corrupt",
        "falling back to step_2, the newest checkpoint that verifies",
    ]
    assert (tmp_path / "step_3.corrupt").is_dir() and ckpt.latest(tmp_path) == good


def test_on_corrupt_error_stops_at_the_first_failure(tmp_path):
    _checkpoint(tmp_path, 1)
    bad = _checkpoint(tmp_path, 2)
    (bad / "config.yaml").write_text("run_name: changed\n")
    with pytest.raises(CheckpointCorrupt, match=r"step_2/config.yaml: .*checkpoint.on_corrupt: error"):
        ckpt.latest_verified(tmp_path, "error", report=lambda m: None)
    assert (tmp_path / "step_2").is_dir()  # nothing moved


def test_no_checkpoint_that_verifies_is_an_error_naming_each(tmp_path):
    for step in (1, 2):
        (_checkpoint(tmp_path, step) / "megatron" / "metadata.json").write_text("{}")
    with pytest.raises(
        CheckpointCorrupt, match=r"no checkpoint verifies: .*step_2/megatron.*step_1/megatron"
    ):
        ckpt.latest_verified(tmp_path, "fallback", report=lambda m: None)
    assert ckpt.latest_verified(tmp_path / "none", "fallback") is None


def test_half_written_checkpoints_are_cleaned(tmp_path):
    _checkpoint(tmp_path, 1)
    (tmp_path / ".step_2.tmp" / "megatron").mkdir(parents=True)
    assert [p.name for p in ckpt.clean_partial(tmp_path)] == [".step_2.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_config_checks_the_new_keys():
    with pytest.raises(ConfigError, match=r"checkpoint.on_corrupt"):
        load_config(None, ["checkpoint.on_corrupt=ignore"])
    with pytest.raises(ConfigError, match=r"checkpoint.on_error"):
        load_config(None, ["checkpoint.on_error=retry"])
    with pytest.raises(ConfigError, match=r"generation.max_engine_restarts: must be >= 0"):
        load_config(None, ["generation.max_engine_restarts=-1"])
    cfg = load_config(None, [])
    assert (cfg.checkpoint.on_corrupt, cfg.checkpoint.on_error) == ("fallback", "stop")
    assert (cfg.generation.max_engine_restarts, cfg.generation.engine_restart_window_steps) == (2, 100)


# ------------------------------------------------------------------------ checkpoint write errors


class FakePolicy:
    """Stands in for the policy group: ``save`` writes a file, or fails with ENOSPC when told to."""

    def __init__(self):
        self.full = False

    def call_all(self, method, path):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        (Path(path) / "megatron").mkdir(parents=True)
        (Path(path) / "megatron" / "__0_0.distcp").write_bytes(b"w" * 1000)
        return [{}, {}]

    # The rest of the rank-group surface, as the Ray group has it (the controller is this process).
    is_controller = True

    def barrier(self):
        pass

    def gather_to_controller(self, value):
        return [value]

    def from_controller(self, make):
        return make()


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one_latest(on_error, tmp_path, capsys):
    from megagrpo.trainers.checkpoints import save_checkpoint

    cfg = load_config(None, [f"checkpoint.dir={tmp_path}", f"checkpoint.on_error={on_error}"])
    policy = FakePolicy()
    first = save_checkpoint(cfg, policy, PolicyWorker.save, 1, 64)
    manifest.verify(first)
    policy.full = True
    if on_error == "stop":
        with pytest.raises(ckpt.CheckpointWriteError) as err:
            save_checkpoint(cfg, policy, PolicyWorker.save, 2, 128)
        message = str(err.value)
    else:
        assert save_checkpoint(cfg, policy, PolicyWorker.save, 2, 128) is None
        message = capsys.readouterr().out
    assert f"checkpoint step_2 could not be written to {tmp_path}: " in message
    assert "No space left on device" in message
    assert "the latest checkpoint is still step_1" in message
    assert f"(checkpoint.on_error: {on_error})" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # the failed write is gone


def test_an_unwritable_checkpoint_directory_stops_the_run_with_a_clear_message(tmp_path):
    from megagrpo.trainers.checkpoints import save_checkpoint

    (tmp_path / "file").write_text("not a directory")
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}"])
    with pytest.raises(
        ckpt.CheckpointWriteError, match=r"checkpoint step_1 could not be written to .*Not a directory"
    ):
        save_checkpoint(cfg, FakePolicy(), PolicyWorker.save, 1, 64)


# -------------------------------------------------------------------------------- engine restarts


def test_restart_budget_counts_within_its_window():
    from megagrpo.runtime.engines import RestartBudget

    budget = RestartBudget(2, window_steps=10)
    assert budget.take(1) and budget.take(5)
    assert not budget.take(9)  # a third within 10 steps
    assert budget.take(11)  # step 1's restart has left the window
    whole_run = RestartBudget(1, window_steps=0)
    assert whole_run.take(1) and not whole_run.take(10_000)


class FakeEngine:
    """``generate.remote`` returns its answer; ``dies`` makes the (patched) ray.get raise instead."""

    def __init__(self, index, generation):
        self.index, self.generation, self.dies = index, generation, False
        self.calls = []
        self.generate = SimpleNamespace(remote=self._generate)

    def _generate(self, prompts, settings, seeds):
        self.calls.append((prompts, seeds))
        return (self, [(self.index, self.generation, p, s) for p, s in zip(prompts, seeds, strict=True)])


class FakeSync:
    stats = None  # what the sync put on the links (WeightSync.stats)

    def __init__(self, actors, log):
        self.actors, self.log = actors, log
        log.append(("connect", [(a.index, a.generation) for a in actors]))

    def sync(self):
        self.log.append(("sync",))

    def probe(self):
        self.log.append(("probe",))
        return SimpleNamespace(error=1.0)


class ReadyPolicy:
    """The policy group as the pool uses it: waited for (``ready``) before the sync groups form."""

    def __init__(self):
        self.waited = 0

    def ready(self):
        self.waited += 1
        return self


def fake_engines(monkeypatch, log: list, started: list):
    """``runtime.engines`` with fake engines (``started``, in start order; a replacement is numbered by
    how many started before it) and a fake weight sync logging into ``log``."""
    from megagrpo.runtime import engines

    def start_engines(cfg, model_dir, *, policy=None, engine_cls=None, indices=None, timeout_s=600.0):
        indices = range(cfg.generation.num_engines) if indices is None else indices
        new = [FakeEngine(i, len(started)) for i in indices]
        started.extend(new)
        log.append(("start", list(indices)))
        return new

    def wait_for_engines(actors, timeout_s=600.0):
        log.append(("wait", [a.index for a in actors]))
        return actors

    monkeypatch.setattr(engines, "start_engines", start_engines)
    monkeypatch.setattr(engines, "wait_for_engines", wait_for_engines)
    monkeypatch.setattr(engines, "WeightSync", lambda cfg, policy, actors, vocab_size: FakeSync(actors, log))
    return engines


def _engines_answer_until_they_die(monkeypatch):
    """ray.get returns a stand-in engine's answer, or raises as for a dead actor once it ``dies``."""
    import ray

    def get(ref, timeout):
        engine, answer = ref
        if engine.dies:
            raise ray.exceptions.ActorDiedError()
        return answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: None)


def test_a_failed_engine_is_replaced_resynced_and_asked_again(monkeypatch, capsys):

    from megagrpo.runtime.faults import EngineFailure

    _engines_answer_until_they_die(monkeypatch)
    cfg = load_config(None, ["generation.num_engines=2", "generation.max_engine_restarts=1"])
    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    policy = ReadyPolicy()
    pool = engines.EnginePool.start(cfg, "model", policy)
    pool.actors[1].dies = True
    shares = {0: ([[1], [2]], None, [7, 8]), 1: ([[3]], None, [9])}
    got = pool.call("generate", shares, 5.0, step=3)
    # Engine 1's share, asked again of its replacement (started after the first two) with its seeds.
    assert got == {0: [(0, 0, [1], 7), (0, 0, [2], 8)], 1: [(1, 2, [3], 9)]}
    assert started[2].calls == [([[3]], [9])]
    assert log == [
        ("start", [0, 1]),
        ("connect", [(0, 0), (1, 0)]),
        ("start", [1]),
        ("connect", [(0, 0), (1, 2)]),
        ("sync",),
        ("probe",),
    ]
    assert policy.waited == 2  # before each connect
    assert [index for index, _ in pool.restarts] == [1]
    assert "vLLM engine 1 failed" in capsys.readouterr().out
    # Not restartable (engines generating ahead while the trainer changes the weights): an EngineFailure
    # at once, the budget untouched.
    pool.actors[0].dies = True
    with pytest.raises(EngineFailure, match=r"vLLM engine 0 failed while generating the next step"):
        pool.call("generate", shares, 5.0, step=4, restartable=False)
    # One failure more than max_engine_restarts allows (within the window of steps): an EngineFailure
    # naming the engine.
    with pytest.raises(
        EngineFailure, match=r"vLLM engine 0 failed after 1 engine restart\(s\) within 100 steps"
    ):
        pool.call("generate", shares, 5.0, step=102)


def test_restarts_count_in_the_steps_the_caller_names(monkeypatch):

    _engines_answer_until_they_die(monkeypatch)
    overrides = ["generation.max_engine_restarts=1", "generation.engine_restart_window_steps=10"]
    cfg = load_config(None, overrides)
    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    pool = engines.EnginePool.start(cfg, "model", ReadyPolicy())
    share = {0: ([[1]], None, [5])}
    for step in (1, 11, 21):  # one restart per window of 10 steps: each allowed
        pool.actors[0].dies = True
        assert pool.call("generate", share, 5.0, step=step) == {0: [(0, len(started) - 1, [1], 5)]}
    assert len(pool.restarts) == 3


def test_the_first_start_waits_for_launched_engines_and_replacements_start_anew(monkeypatch):
    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    # Killing a stand-in is a no-op: a real ray.kill would first start Ray, or join whatever cluster
    # /tmp/ray/ray_current_cluster names (a `ray start` of an earlier test, maybe gone: a hang).
    monkeypatch.setattr(engines.ray, "kill", lambda actor, no_restart: None)
    cfg = load_config(None, ["generation.num_engines=2"])
    launched = [FakeEngine(0, "launched"), FakeEngine(1, "launched")]
    pool = engines.EnginePool.start(cfg, "model", ReadyPolicy(), launched=launched)
    assert pool.actors == launched and started == []
    assert log == [("wait", [0, 1]), ("connect", [(0, "launched"), (1, "launched")])]
    outcome = pool.replace(1, RuntimeError("gone"), step=1)
    assert pool.actors[0] is launched[0] and pool.actors[1] is started[0]
    assert log[2:] == [("start", [1]), ("connect", [(0, "launched"), (1, 0)]), ("sync",), ("probe",)]
    assert outcome.probe.error == 1.0 and outcome.probe_s >= 0.0


def test_a_sync_returns_its_probe_and_how_long_the_probe_took(monkeypatch):
    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    pool = engines.EnginePool.start(load_config(None, []), "model", ReadyPolicy())
    outcome = pool.sync_weights(step=1)
    assert isinstance(outcome, engines.SyncOutcome)
    assert outcome.probe.error == 1.0 and outcome.probe_s >= 0.0
    assert log[-2:] == [("sync",), ("probe",)]


def test_engines_without_a_policy_have_no_weight_sync(monkeypatch):
    import ray

    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: None)
    pool = engines.EnginePool.start(load_config(None, []), "model")  # megagrpo eval: weights from disk
    assert log == [("start", [0])]
    assert pool.replace(0, RuntimeError("gone"), step=0) is None  # restarted; nothing sent or probed
    assert log == [("start", [0]), ("start", [0])]
    with pytest.raises(RuntimeError, match="load their weights from disk"):
        pool.sync_weights(step=0)


def test_a_stuck_engine_is_killed_and_replaced(monkeypatch):
    import ray

    killed = []

    def get(ref, timeout):
        engine, answer = ref
        if engine.dies:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout}s")
        return answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))
    started = []
    engines = fake_engines(monkeypatch, [], started)
    pool = engines.EnginePool.start(load_config(None, []), "model", ReadyPolicy())
    stuck = pool.actors[0]
    stuck.dies = True
    assert pool.call("generate", {0: ([[5]], None, [3])}, 1.0, step=1) == {0: [(0, 1, [5], 3)]}
    assert killed == [stuck] and pool.actors[0] is started[1]


def test_a_rank_stuck_in_a_sync_past_its_deadline_stops_the_run_instead_of_a_replacement(monkeypatch):
    """A trainer rank still inside a sync 1.5 x generation.sync_timeout_s later did not give up by itself:
    a replacement's groups would queue behind its call, so the pool stops the run (a RankFailure)."""
    import ray

    from megagrpo.runtime.faults import RankFailure
    from megagrpo.weight_sync.sync import WeightSync, WeightSyncError

    # The engine answered (it died), rank 1 did not.
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (["engine 0", "rank 0"], ["rank 1"]))
    monkeypatch.setattr(ray, "get", lambda ref: None)
    weights = object.__new__(WeightSync)
    weights.timeout_s = 10.0
    with pytest.raises(WeightSyncError) as err:
        weights._wait(["engine 0"], ["rank 0", "rank 1"], "weight sync")
    assert err.value.ranks == (1,) and err.value.engine is None
    assert str(err.value).startswith("weight sync: trainer rank(s) 1 still inside it after 15s")

    class StuckSync(FakeSync):
        def sync(self):
            raise err.value

    log, started = [], []
    engines = fake_engines(monkeypatch, log, started)
    monkeypatch.setattr(engines, "WeightSync", lambda cfg, policy, actors, vocab_size: StuckSync(actors, log))
    pool = engines.EnginePool.start(load_config(None, []), "model", ReadyPolicy())
    with pytest.raises(
        RankFailure, match=r"policy rank\(s\) stuck in a weight sync: weight sync: trainer rank"
    ):
        pool.sync_weights(step=1)
    assert len(started) == 1 and pool.restarts == []  # no replacement started


class TrainedSoFar:
    """The trainer surface the skeleton's checkpoints read: what the policy holds."""

    save_method = staticmethod(PolicyWorker.save)

    def __init__(self, step, position):
        self.now = Trained(step, position)

    def trained(self):
        return self.now

    def checkpoint_files(self):
        return None

    def before_save(self):
        pass


def test_engines_failing_past_their_restarts_checkpoint_what_was_trained(tmp_path):
    from megagrpo.runtime.faults import EngineFailure
    from megagrpo.trainers.run import engine_failures_checkpointed

    cfg = load_config(None, [f"checkpoint.dir={tmp_path}"])
    trainer = TrainedSoFar(4, 64)
    with pytest.raises(EngineFailure) as err, engine_failures_checkpointed(cfg, FakePolicy(), trainer):
        trainer.now = Trained(5, 80)
        raise EngineFailure("vLLM engine 0 failed after 2 engine restart(s); last error: gone", 0)
    assert str(err.value).endswith(f"; saved {tmp_path / 'step_5'}, continue with --resume")
    state = ckpt.load_driver_state(tmp_path / "step_5")
    assert (state.step, state.data_position, err.value.engine) == (5, 80, 0)
    manifest.verify(tmp_path / "step_5")


# --------------------------------------------------------------------------------- local Ray, ports


def test_sweep_stops_the_processes_of_a_session_whose_driver_is_gone(tmp_path):
    from megagrpo.runtime import watchdog

    orphan_dir, live_dir = tmp_path / "session_a", tmp_path / "session_b"
    holders = {}
    for session, owner in ((orphan_dir, 999_999_999), (live_dir, os.getpid())):
        (session / "logs").mkdir(parents=True)
        log = session / "logs" / "agent.out"
        holders[session] = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            stdout=log.open("w"),
            start_new_session=True,
        )
        started = watchdog.start_time(owner)
        marker = {"pid": owner, "start_time": started}
        (session / watchdog.MARKER).write_text(json.dumps(marker))
    try:
        assert holders[orphan_dir].pid in watchdog.session_processes(orphan_dir)
        assert watchdog.sweep_orphans(tmp_path) == ["session_a"]
        assert holders[orphan_dir].wait(timeout=10) == -signal.SIGTERM
        assert not (orphan_dir / watchdog.MARKER).exists()
        assert holders[live_dir].poll() is None  # its driver (this process) is alive
    finally:
        for proc in holders.values():
            proc.kill()
            proc.wait()


def test_stores_listen_on_their_host_only():
    import datetime
    import importlib

    import psutil

    from megagrpo.compat.torch_store import bound_tcp_store, stores_listen_on_their_host

    timeout = datetime.timedelta(seconds=10)
    store = bound_tcp_store("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    store.set("k", "v")
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = rendezvous._create_c10d_store
    with stores_listen_on_their_host() as patched:  # what init_process_group's env:// and tcp:// use
        rdzv = rendezvous._create_c10d_store("127.0.0.1", 0, 0, 1, timeout)
    assert patched and rendezvous._create_c10d_store is original
    listening = [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    for port in (store.port, rdzv.port):
        mine = [c for c in listening if c.laddr.port == port]
        assert mine and all(c.laddr.ip == "127.0.0.1" for c in mine), mine


# ------------------------------------------------------------------------------------- supervisor


def _stand_in(tmp_path: Path, statuses: list[int]) -> Path:
    """A command that records its arguments, then exits with the next of ``statuses`` (a status
    above 128 as death by that signal)."""
    script = tmp_path / "megagrpo"
    script.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path}/calls\n'
        f"n=$(wc -l < {tmp_path}/calls)\n"
        f"codes=({' '.join(map(str, statuses))})\n"
        "code=${codes[$((n - 1))]}\n"
        'if [ "$code" -gt 128 ]; then kill -$((code - 128)) $$; fi\n'
        'exit "$code"\n'
    )
    script.chmod(0o755)
    return script


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_supervisor_relaunches_faults_with_resume(tmp_path):
    stand_in = _stand_in(tmp_path, [75, 137, 0])
    env = dict(os.environ, SUPERVISE_DELAY_S="0")
    cmd = [str(REPO / "launch" / "supervise.sh"), "--max-restarts", "2", str(stand_in), "train", "x=1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _calls(tmp_path) == ["train x=1", "train x=1 --resume", "train x=1 --resume"]
    assert "exit status 75; relaunching with --resume (1 of 2)" in done.stderr


@pytest.mark.parametrize(
    ("statuses", "max_restarts", "want"), [([1], 3, 1), ([130], 3, 130), ([75, 75], 1, 75)]
)
def test_supervisor_stops_on_errors_ctrl_c_and_its_limit(statuses, max_restarts, want, tmp_path):
    stand_in = _stand_in(tmp_path, statuses)
    env = dict(os.environ, SUPERVISE_DELAY_S="0")
    cmd = [str(REPO / "launch" / "supervise.sh"), "--max-restarts", str(max_restarts), str(stand_in)]
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == want
    assert len(_calls(tmp_path)) == len(statuses)


def test_ray_head_takes_the_supervisor_option(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _stand_in(tmp_path, [75, 0]).rename(venv / "bin" / "megagrpo")
    (venv / "bin" / "ray").write_text("#!/usr/bin/env bash\nexit 0\n")
    (venv / "bin" / "ray").chmod(0o755)
    # HOME of its own: the head makes its token there (a token a local Ray left in this HOME, mode 644,
    # would be refused, as launch/ray_auth.sh must).
    env = dict(os.environ, VENV=str(venv), SUPERVISE_DELAY_S="0", HOME=str(tmp_path))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    cmd = [str(REPO / "launch" / "ray_head.sh"), "--max-restarts", "1", "train", "--config", "f.yaml"]
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert _calls(tmp_path) == [
        "train --config f.yaml cluster.ray_address=auto",
        "train --config f.yaml cluster.ray_address=auto --resume",
    ]


def test_train_exits_75_on_a_fault(monkeypatch, capsys):
    from megagrpo import cli
    from megagrpo.runtime.faults import FAULT_EXIT, RankFailure
    from megagrpo.trainers import grpo

    def fail(cfg):
        raise RankFailure("policy rank 1 on 127.0.0.1 (pid 5) died: boom")

    monkeypatch.setattr(grpo, "train", fail)
    assert cli.main(["train"]) == FAULT_EXIT == 75
    assert "megagrpo train: stopped: policy rank 1 on 127.0.0.1 (pid 5) died" in capsys.readouterr().err
