"""Two Ray nodes for real, on one machine: a head and a second node started as separate ``ray start``
processes, each with a custom resource that labels it (``megagrpo_trainer_node`` / ``megagrpo_engine_node``),
and token authentication as a cluster on a network interface should have. A short GRPO run of the tiny
config joins through ``cluster.ray_address``, with ``cluster.policy_resource`` / ``engine_resource``
putting the policy ranks on the head and the vLLM engine on the other node. Its steps equal the
session's undisturbed single-node run (placement changes no number), and both nodes are stopped.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides

pytestmark = pytest.mark.e2e

_TRAINER, _ENGINE = "megagrpo_trainer_node", "megagrpo_engine_node"


def _ray(env: dict, *args: str) -> None:
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), *args], env=env, check=True, capture_output=True, timeout=300)


@pytest.fixture
def two_nodes(tmp_path):
    """(address, env a client needs, node id by label resource); both nodes stopped afterwards."""
    from ray._private.services import get_node_ip_address

    from megagrpo.parallel.local import free_port
    from megagrpo.runtime.watchdog import session_processes, stop_processes

    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)  # a token others may read is refused
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    temp = tempfile.mkdtemp(prefix="mgray", dir="/tmp")  # Ray's socket paths must stay short
    # `ray start --port` takes a number, not a socket: found free here, bound by the head just after
    # (the e2e tier runs one test at a time; a taken port fails the head's start, visibly).
    address = f"{get_node_ip_address()}:{free_port()}"
    common = ["--num-cpus", "2", "--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]
    try:
        _ray(env, "start", "--head", "--port", address.rsplit(":", 1)[1], "--temp-dir", temp,
             "--include-dashboard", "false", "--resources", json.dumps({_TRAINER: 1}), *common)  # fmt: skip
        _ray(env, "start", "--address", address, "--resources", json.dumps({_ENGINE: 1}), *common)
        listing = subprocess.run(
            [sys.executable, "-c", _LIST_NODES, address], env=env, check=True, capture_output=True, text=True
        )
        nodes = {
            label: node for node, labels in json.loads(listing.stdout.splitlines()[-1]) for label in labels
        }
        # A client without the token is turned away.
        stranger = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        refused = subprocess.run(
            [sys.executable, "-c", _LIST_NODES, address],
            env=stranger,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode != 0 and "auth" in refused.stderr.lower(), refused.stderr[-2000:]
        yield address, env, nodes
    finally:
        deadline = time.monotonic() + 60  # a SIGKILLed process holds its files until it is gone
        while (left := session_processes(temp)) and time.monotonic() < deadline:
            stop_processes(left)
            time.sleep(0.5)
        assert session_processes(temp) == []


_LIST_NODES = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
print(json.dumps([(n["NodeID"], [r for r in n["Resources"] if r.startswith("megagrpo_")])
                  for n in ray.nodes() if n["Alive"]]))
"""


def test_policy_on_one_node_engine_on_the_other(two_nodes, undisturbed):
    address, env, nodes = two_nodes
    assert set(nodes) == {_TRAINER, _ENGINE} and nodes[_TRAINER] != nodes[_ENGINE]
    reuse_warmup(undisturbed.root, "two_nodes")
    overrides = run_overrides(
        undisturbed.root,
        "two_nodes",
        undisturbed.root / "ckpt_two_nodes",
        steps=2,
        extra=[
            f"cluster.ray_address={address}",
            f"cluster.policy_resource={_TRAINER}",
            f"cluster.engine_resource={_ENGINE}",
        ],
    )
    done = subprocess.run(
        [sys.executable, "-m", "megagrpo.cli", "train", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = re.search(r"^placement: (.*)$", done.stdout, re.M)
    assert line is not None, done.stdout[-3000:]
    assert (
        line.group(1)
        == f"policy rank 0,1 on node {nodes[_TRAINER][:12]}; engine 0 on node {nodes[_ENGINE][:12]}"
    )
    got = metrics(undisturbed.root / "runs" / "two_nodes")
    assert sorted(got) == [0, 1, 2]
    assert got[0]["val/accuracy"] == undisturbed.metrics[0]["val/accuracy"]
    assert_same_steps(got, undisturbed.metrics, [1, 2])
    assert got[2]["sync/probe_error"] == pytest.approx(undisturbed.metrics[2]["sync/probe_error"], abs=1e-6)
