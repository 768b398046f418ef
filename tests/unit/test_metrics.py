import io
import json
import math
import re
import struct
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megagrpo.metrics import MetricsLogger, read_metrics

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def strict_lines(path):
    """Parse every line as strict JSON: a NaN/Infinity token would raise."""

    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def png_height(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">I", data[20:24])[0]  # IHDR: width at 16..20, height at 20..24


def quiet(tmp_path, **kwargs):
    kwargs = {"tensorboard": False, "progress": False, "total_steps": 10, **kwargs}
    return MetricsLogger(tmp_path, **kwargs)


def test_jsonl_one_line_per_step_non_finite_as_null(tmp_path):
    with quiet(tmp_path) as log:
        log.log(1, {"reward/mean": 0.5, "train/tokens": 12})
        log.log(2, {"reward/mean": math.nan, "train/grad_norm": math.inf})
        # Visible before close: a crash after a step keeps that step.
        assert [r["step"] for r in strict_lines(tmp_path / "metrics.jsonl")] == [1, 2]
        log.log(3, {"reward/mean": -math.inf})
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(isinstance(r["time"], float) for r in lines)
    assert lines[0]["reward/mean"] == 0.5 and lines[0]["train/tokens"] == 12
    assert lines[1]["reward/mean"] is None and lines[1]["train/grad_norm"] is None
    assert lines[2]["reward/mean"] is None


def test_reserved_keys_rejected(tmp_path):
    with quiet(tmp_path) as log, pytest.raises(ValueError, match="reserved"):
        log.log(1, {"step": 3})


@pytest.mark.parametrize("kwargs", [{"total_steps": 0}, {"start_step": 11}, {"start_step": -1}])
def test_bad_step_range_rejected(tmp_path, kwargs):
    with pytest.raises(ValueError, match="must be"):
        quiet(tmp_path, **kwargs)


def test_resume_drops_steps_after_start_step(tmp_path):
    with quiet(tmp_path) as log:
        for step in range(1, 6):
            log.log(step, {"reward/mean": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # torn by a crash mid-write

    with quiet(tmp_path, start_step=3, resume=True) as log:
        assert [r["step"] for r in strict_lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        log.log(4, {"reward/mean": 40.0})
    records = strict_lines(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 40.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left behind


def test_fresh_run_starts_a_new_file(tmp_path):
    with quiet(tmp_path) as log:
        log.log(1, {"reward/mean": 1.0})
    with quiet(tmp_path) as log:
        log.log(1, {"reward/mean": 2.0})
    assert [r["reward/mean"] for r in strict_lines(tmp_path / "metrics.jsonl")] == [2.0]


def scalars(run_dir, key):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def test_tensorboard_scalars(tmp_path):
    with quiet(tmp_path, tensorboard=True) as log:
        log.log(1, {"reward/mean": 0.25, "timing/generation_s": 3.0})
        log.log(2, {"reward/mean": 0.75, "timing/generation_s": 2.0})
    assert scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.75)]
    assert scalars(tmp_path, "timing/generation_s") == [(1, 3.0), (2, 2.0)]


def test_tensorboard_resume_purges_rerun_steps(tmp_path):
    with quiet(tmp_path, tensorboard=True) as log:
        for step in range(1, 5):
            log.log(step, {"reward/mean": float(step)})
    with quiet(tmp_path, tensorboard=True, start_step=2, resume=True) as log:
        for step in (3, 4):
            log.log(step, {"reward/mean": 10.0 * step})
    assert scalars(tmp_path, "reward/mean") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def full_step(step):
    return {
        "reward/mean": 0.1 * step,
        "response/length_mean": 10.0 + step,
        "train/kl_mean": math.nan if step == 2 else 0.01 * step,
        **({"val/accuracy": 0.2 * step} if step % 2 == 0 else {}),
    }


def test_write_curves_png(tmp_path):
    with quiet(tmp_path) as log:
        for step in range(1, 5):
            log.log(step, full_step(step))
        path = log.write_curves()
    assert path == tmp_path / "curves.png"
    assert path.stat().st_size > 5000
    three_panels = png_height(path)

    other = tmp_path / "other"
    with quiet(other) as log:
        log.log(1, {"reward/mean": 0.5})
        one_panel = png_height(log.write_curves(other / "custom.png"))
    assert three_panels == 3 * one_panel  # panels without data (length, KL) are left out
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_write_curves_after_resume_reads_history_from_file(tmp_path):
    with quiet(tmp_path) as log:
        for step in range(1, 5):
            log.log(step, full_step(step))
    with quiet(tmp_path, start_step=2, resume=True) as log:
        # Nothing logged by this logger yet: every panel's data comes from the kept steps 1-2.
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
        path = log.write_curves()
    with quiet(tmp_path / "empty") as empty:
        one_panel = png_height(empty.write_curves())
    assert png_height(path) == 3 * one_panel


def test_non_tty_prints_compact_line(tmp_path, capsys):
    with quiet(tmp_path, progress=True, total_steps=20) as log:
        shown = {"reward/mean": 0.41, "val/accuracy": 0.35, "response/length_mean": 4.2}
        shown["timing/step_s"] = 12.3
        log.log(3, {**shown, "train/grad_norm": 0.9})
        log.log(4, {"reward/mean": math.nan, "train/grad_norm": 1.0})  # absent and non-finite keys skipped
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 3/20  reward 0.41  acc 0.35  len 4.2  12.3s"
    assert re.fullmatch(r"step 4/20  \d+\.\ds", lines[1])


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_tty_shows_progress_bar_instead(tmp_path, monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr(sys, "stdout", out)
    with quiet(tmp_path, progress=True, total_steps=5, start_step=1) as log:
        log.log(2, {"reward/mean": 0.41, "timing/step_s": 1.5})
    text = out.getvalue()
    assert "2/5" in text and "reward 0.41" in text and "1.5s" in text
    assert "step 2/5" not in text


def test_print_every_thins_the_printed_line_not_the_records(tmp_path, capsys):
    with quiet(tmp_path, progress=True, total_steps=7, print_every=3) as log:
        for step in range(1, 8):
            log.log(step, {"reward/mean": step / 10, "timing/step_s": 1.0})
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["3/7", "6/7", "7/7"]  # every third step, and the last
    assert [r["step"] for r in strict_lines(tmp_path / "metrics.jsonl")] == list(range(1, 8))


def test_print_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="print_every must be >= 1"):
        quiet(tmp_path, print_every=0)


def test_wandb_offline_run_records_the_logged_steps(tmp_path, monkeypatch):
    """logging.wandb with wandb_mode offline: the run is written under the run directory."""
    from megagrpo.metrics import WandbSettings  # wandb itself comes with the dev extra

    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = WandbSettings(project="megagrpo-test", name="offline", mode="offline", config={"lr": 0.1})
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, total_steps=3, wandb=settings) as log:
        for step in (1, 2, 3):
            log.log(step, {"train/loss": 1.0 / step, "val/accuracy": 0.25 * step})
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    (record,) = run.glob("run-*.wandb")  # what `wandb sync` uploads
    # wandb's own service process writes the file; its last blocks may land just after finish() returns.
    deadline = time.monotonic() + 60
    while len(history := _wandb_history(record.read_bytes())) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert [h["val/accuracy"] for h in history] == [0.25, 0.5, 0.75]
    assert (tmp_path / "wandb_run_id").read_text().strip() in run.name


def _wandb_history(data: bytes) -> list[dict]:
    """History rows of a W&B run file: a LevelDB-style log (7-byte file header, 32 KiB blocks, records
    of [crc32, length, type] + payload, types FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows, pos, payload, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_requested_but_missing_is_a_config_error(monkeypatch):
    import sys

    from megagrpo.config import ConfigError, load_config
    from megagrpo.trainers.run import wandb_settings

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"logging\.wandb.*pip install 'megagrpo\[wandb\]'"):
        wandb_settings(load_config(None, ["logging.wandb=true"]))
    assert wandb_settings(load_config(None)) is None
