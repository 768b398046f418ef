"""launch/ray_auth.sh, sourced by the multinode launch scripts: Ray's token authentication is on unless
switched off, the head creates a private token when none exists, a worker without one stops, a token
others may read is refused (by the script and by the driver's ``start_ray`` when it joins a cluster)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from megagrpo.config import ConfigError
from megagrpo.runtime.ray_session import check_ray_token_file

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
    (tmp_path / "shared" / "token").chmod(0o600)
    joined = _source("worker", tmp_path, RAY_AUTH_TOKEN_PATH=str(tmp_path / "shared" / "token"))
    assert joined.returncode == 0 and "mode=token" in joined.stdout


def test_a_token_in_the_environment_or_auth_switched_off_creates_nothing(tmp_path):
    given = _source("worker", tmp_path, RAY_AUTH_TOKEN="cd" * 32)
    assert given.returncode == 0 and "mode=token path=\n" in given.stdout
    off = _source("worker", tmp_path, RAY_AUTH_MODE="disabled")
    assert off.returncode == 0 and "mode=disabled" in off.stdout
    assert not (tmp_path / ".ray").exists()


@pytest.mark.parametrize("role", ["head", "worker"])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_others_may_read_or_write_is_refused_with_the_reason(tmp_path, role, mode):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("ef" * 32)  # as Ray's own `ray start` leaves it: 644
    token.chmod(mode)
    done = _source(role, tmp_path)
    assert done.returncode == 1
    assert f"the Ray token {token} has mode {mode:o}: group or others may read or replace it" in done.stderr
    assert "refused" in done.stderr and f"chmod 600 {token}" in done.stderr
    assert stat.S_IMODE(token.stat().st_mode) == mode and token.read_text() == "ef" * 32  # left as it was
    with pytest.raises(ConfigError, match=rf"RAY_AUTH_TOKEN_PATH: the Ray token {token} has mode {mode:o}"):
        check_ray_token_file({"RAY_AUTH_MODE": "token", "HOME": str(tmp_path)})
    token.chmod(0o600)
    assert _source(role, tmp_path).returncode == 0
    check_ray_token_file({"RAY_AUTH_MODE": "token", "HOME": str(tmp_path)})


def test_execute_bits_for_others_are_cleared_and_a_read_only_token_is_kept(tmp_path):
    token = tmp_path / "token"
    token.write_text("01" * 32)
    token.chmod(0o711)
    done = _source("worker", tmp_path, RAY_AUTH_TOKEN_PATH=str(token))
    assert done.returncode == 0 and "had mode 711" in done.stdout
    assert stat.S_IMODE(token.stat().st_mode) == 0o700
    token.chmod(0o400)
    assert _source("worker", tmp_path, RAY_AUTH_TOKEN_PATH=str(token)).returncode == 0
    assert stat.S_IMODE(token.stat().st_mode) == 0o400


def test_the_driver_checks_only_a_token_file_ray_would_read(tmp_path):
    token = tmp_path / "token"
    token.write_text("01" * 32)
    token.chmod(0o644)
    env = {"RAY_AUTH_TOKEN_PATH": str(token), "HOME": str(tmp_path)}
    with pytest.raises(ConfigError, match="group or others may read"):
        check_ray_token_file(env | {"RAY_AUTH_MODE": "token"})
    check_ray_token_file(env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "cd" * 32})  # the file is unused
    check_ray_token_file(env | {"RAY_AUTH_MODE": "disabled"})
    check_ray_token_file(
        {"RAY_AUTH_MODE": "token", "HOME": str(tmp_path / "nobody")}
    )  # Ray reports a missing one
