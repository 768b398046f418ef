"""launch/ray_auth.sh, sourced by the multinode launch scripts: Ray's token authentication is on unless
switched off, the head creates a private token when none exists, a worker without one stops."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "ray_auth.sh"


def _source(role: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run(
        ["bash", "-c", f'. "{SCRIPT}" {role} && echo "mode=$RAY_AUTH_MODE path=${{RAY_AUTH_TOKEN_PATH:-}}"'],
        env=base | {"HOME": str(home)} | env,
        capture_output=True,
        text=True,
    )


def test_the_head_creates_a_private_token_once(tmp_path):
    first = _source("head", tmp_path)
    token = tmp_path / ".ray" / "auth_token"
    assert first.returncode == 0, first.stderr
    assert f"mode=token path={token}" in first.stdout and "created a Ray token" in first.stdout
    value = token.read_text()
    assert len(value) == 64 and int(value, 16) >= 0
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    again = _source("head", tmp_path)
    assert again.returncode == 0 and "created" not in again.stdout and token.read_text() == value


def test_a_worker_without_the_token_stops_naming_the_path(tmp_path):
    done = _source("worker", tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "shared" / "token"))
    assert done.returncode == 1
    assert f"no Ray token at RAY_AUTH_TOKEN_PATH={tmp_path / 'shared' / 'token'}" in done.stderr
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "token").write_text("ab" * 32)
    joined = _source("worker", tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "shared" / "token"))
    assert joined.returncode == 0 and "mode=token" in joined.stdout


def test_a_token_in_the_environment_or_auth_switched_off_creates_nothing(tmp_path):
    given = _source("worker", tmp_path, RAY_AUTH_TOKEN="cd" * 32)
    assert given.returncode == 0 and "mode=token path=\n" in given.stdout
    off = _source("worker", tmp_path, RAY_AUTH_MODE="disabled")
    assert off.returncode == 0 and "mode=disabled" in off.stdout
    assert not (tmp_path / ".ray").exists()
