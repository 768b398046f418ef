"""Colocated placement on CPU: engine 0 shares trainer rank 0's bundle and takes that rank's buckets
from shared slots (the CUDA IPC protocol over /dev/shm), rank 1's by broadcast, and the trainer parks
its optimizer, gradients and weights in host memory while the engine runs (``policy.offload: all``),
handing the GPU over in the order of ``megagrpo.runtime.colocated``.
The run syncs in delta mode (``generation.sync_mode: delta``: each bucket's changed elements, the
engine rebuilding its bytes from the last ones, also after its sleep discarded the weights) and repeats
the disaggregated, full-sync reference run step for step, with every tensor's digest checked on every
sync."""

from __future__ import annotations

import json

import pytest
from _grpo_runs import assert_same_steps, metrics, reuse_warmup, run_overrides

from megagrpo.config import load_config

pytestmark = pytest.mark.e2e


def test_a_colocated_run_repeats_the_disaggregated_one(undisturbed, tmp_path, capsys):
    from megagrpo.trainers.grpo import train

    root = undisturbed.root
    reuse_warmup(root, "colocated")
    extra = ["generation.placement=colocated", "policy.offload=all", "generation.sync_mode=delta"]
    overrides = run_overrides(root, "colocated", tmp_path / "ckpt", extra=extra)
    with pytest.warns(UserWarning, match="buys little"):  # the tiny demo is fp32
        cfg = load_config(None, overrides)
    run_dir = train(cfg)
    said = capsys.readouterr().out
    assert (
        "weight sync transport: colocated: engine(s) 0 take the buckets of the trainer rank on their device"
        in said
    )
    assert "the other links by gloo broadcast" in said  # trainer rank 1's shards
    got = metrics(run_dir)
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert got[step]["sync/probe_error"] <= 1.001
        # Both links' buckets (rank 0's by handoff, rank 1's by broadcast), digested on arrival.
        assert got[step]["sync/verified_buckets"] >= 2
        assert got[step]["memory/offloaded_gib"] > 0 and got[step]["timing/reload_s"] >= 0
        # Delta sync: the engines' bytes were known from the sync before (the wake-up syncs after a
        # checkpoint sent headers alone); the steps repeat the full-sync reference exactly (below).
        assert 0 < got[step]["sync/changed_fraction"] <= 1 and got[step]["sync/bytes"] > 0
    assert_same_steps(got, undisturbed.metrics, (1, 2, 3, 4))
    # The GPUs' hand-overs, as the controller made them (runtime.colocated): the engines wake their
    # weights, the sync, the trainer parks, the engines wake their KV cache, then generate; they sleep
    # before the trainer's states come back and before every checkpoint (so the next step wakes them
    # through a sync). On CPU their sleep discards the weights as on a GPU (NaN): the probe checks
    # that every sync refilled them.
    events: dict[int, list[str]] = {}
    for line in (run_dir / "colocated.jsonl").read_text().splitlines():
        row = json.loads(line)
        events.setdefault(row["step"], []).append(row["event"])
    sync = [
        "trainer parks (sync)",
        "engines wake weights",
        "weights synced",
        "trainer parks (generation)",
        "engines wake kv_cache",
    ]
    assert events[0] == ["engines sleep", *sync, "engines generate"]  # validation before step 1
    for step in (1, 2, 3, 4):
        validated = ["engines generate"] if step % 2 == 0 else []
        want = [*(sync if step > 1 else []), "engines generate", "engines sleep", "trainer reloads", *sync]
        want += [*validated, "engines sleep", "checkpoint"]
        assert events[step][: len(want)] == want, (step, events[step])
        assert events[step][len(want) :] in ([], ["engines sleep", "checkpoint"])  # the final save
