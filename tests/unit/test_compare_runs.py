"""tools/compare_runs.py: the table of one metric by step, and the step each run reached a level."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_runs.py"


def _run(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_table_and_steps_to_reach_a_fraction_of_the_last_runs_final_value(tmp_path):
    fast = _run(tmp_path, "fast", [{"step": 0, "val/accuracy": 0.2}, {"step": 10, "val/accuracy": 0.6}])
    slow = _run(
        tmp_path,
        "slow",
        [
            {"step": 0, "val/accuracy": 0.2},
            {"step": 1, "reward/mean": 0.1},
            {"step": 25, "val/accuracy": 0.5},
            {"step": 50, "val/accuracy": 0.6},
        ],
    )
    out = subprocess.run(
        [sys.executable, str(TOOL), str(fast), str(slow), "--reach-fraction", "0.9", "--reach", "0.7"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| 10 | 0.600 |  |" in out and "| 25 |  | 0.500 |" in out and "| 1 |" not in out
    # 0.9 x 0.6 = 0.54: fast at step 10, slow at step 50
    assert "val/accuracy >= 0.700:\n  fast: not within its 10 steps\n  slow: not within its 50 steps" in out
    assert "val/accuracy >= 0.9 x 0.600 = 0.540:\n  fast: step 10\n  slow: step 50" in out


def test_common_steps_judge_the_levels_where_every_run_validated(tmp_path):
    dense = _run(
        tmp_path, "dense", [{"step": s, "val/accuracy": a} for s, a in ((0, 0.2), (5, 0.7), (10, 0.3))]
    )
    sparse = _run(tmp_path, "sparse", [{"step": 0, "val/accuracy": 0.2}, {"step": 10, "val/accuracy": 0.6}])
    args = [sys.executable, str(TOOL), str(dense), str(sparse), "--reach", "0.5"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "val/accuracy >= 0.500:\n  dense: step 5\n  sparse: step 10" in out
    # at the common steps 0 and 10 only, the dense run's draw at step 5 does not count
    out = subprocess.run([*args, "--common-steps"], capture_output=True, text=True, check=True).stdout
    assert "levels judged at the steps every run logged (to step 10): 0, 10" in out
    assert "val/accuracy >= 0.500:\n  dense: not within its 10 steps\n  sparse: step 10" in out
    assert "| 5 | 0.700 |  |" in out  # the table keeps every step
    # past the shorter run's last step, the longer run's own steps count
    longer = _run(
        tmp_path,
        "longer",
        [{"step": s, "val/accuracy": a} for s, a in ((0, 0.2), (5, 0.9), (10, 0.3), (15, 0.6))],
    )
    cmd = [sys.executable, str(TOOL), str(longer), str(sparse), "--reach", "0.5", "--common-steps"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "val/accuracy >= 0.500:\n  longer: step 15\n  sparse: step 10" in out


def test_a_missing_run_is_named(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nope")], capture_output=True, text=True)
    assert res.returncode != 0 and "nope/metrics.jsonl: not found" in res.stderr
