"""The benchmark harness (``benchmarks/``): the measurement record and its targets, the options every
benchmark takes, the interleaved timer, the suite's commands (every one parsed by its benchmark),
the runs a suite makes once, and the README table's generic renderer. No benchmark is run here."""

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

from benchmarks import readme, suite
from benchmarks.common import record, timing
from benchmarks.common.record import Measurement

pytestmark = pytest.mark.unit


def test_a_measurement_needs_samples_and_a_valid_target():
    with pytest.raises(ValueError, match="no samples"):
        Measurement("x", [], "s")
    with pytest.raises(ValueError, match="target '~1'"):
        Measurement("x", [1.0], "s", target="~1")
    m = Measurement("x", [3, 1, 2], "s", {"tp": 2})
    assert m.samples == (3.0, 1.0, 2.0) and m.median == 2.0 and m.label() == "x (tp=2)"


@pytest.mark.parametrize(
    "samples, target, verdict",
    [
        ([1.1, 1.3], "> 1", "met"),
        ([0.8, 1.2, 1.3], "> 1", "missed in 1 of 3"),  # a median that meets it is not enough
        ([0.9], ">= 1.25", "missed"),
        ([0.86, 1.1], "0.85..1.15", "met"),
        ([0.8], "0.85..1.15", "missed"),
        ([0.001], "<= 0.001", "met"),
        ([5.0], None, ""),
    ],
)
def test_a_target_is_met_only_when_every_sample_meets_it(samples, target, verdict):
    assert Measurement("x", samples, "x", target=target).verdict() == verdict


def test_ratio_is_per_repetition():
    m = record.ratio("a / b", [2.0, 3.0], [1.0, 2.0], settings={"tp": 1}, headline=True)
    assert m.samples == (2.0, 1.5) and m.unit == "x" and m.headline
    with pytest.raises(ValueError, match="2 against 1"):
        record.ratio("a / b", [2.0, 3.0], [1.0])


def test_quick_replaces_defaults_but_not_options_given():
    p = record.parser("demo", "demo.", repeat=3)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    quick = {"size": 8, "tp": [1]}
    full = record.parse(p, [], quick)
    assert (full.size, full.tp, full.repeat, full.quick) == (100, [1, 2], 3, False)
    small = record.parse(p, ["--quick"], quick)
    assert (small.size, small.tp, small.repeat) == (8, [1], 1)
    mixed = record.parse(p, ["--quick", "--size", "16", "--repeat", "2"], quick)
    assert (mixed.size, mixed.repeat) == (16, 2)
    assert mixed.command == "python -m benchmarks.demo --quick --size 16 --repeat 2"
    with pytest.raises(SystemExit):
        record.parse(p, ["--repeat", "0"], quick)


def test_results_file_round_trip_and_markdown(tmp_path):
    args = argparse.Namespace(out=tmp_path / "x.json", command="python -m benchmarks.x", repeat=2)
    ms = [
        Measurement("train / bare", [0.9, 0.8], "x", {"tp": 1}, target=">= 0.85", headline=True),
        Measurement("tiny", [4e-7], ""),
    ]
    record.write(args, "x", "what it measures", ms, notes=["a note"])
    back = record.read(tmp_path / "x.json")
    assert back["measurements"] == ms and back["command"] == "python -m benchmarks.x"
    md = (tmp_path / "x.md").read_text()
    assert "| train / bare | tp=1 | 0.85 x (0.8-0.9, n=2) | >= 0.85: missed in 1 of 2 |" in md
    assert "| tiny |  | 4e-07 |  |" in md and "- a note" in md
    (tmp_path / "old.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match=r"old\.json: not a benchmark results file"):
        record.read(tmp_path / "old.json")


def test_find_matches_name_and_settings():
    ms = [
        Measurement("sync", [1.0], "s", {"engines": 1, "bucket_mb": 512.0}),
        Measurement("sync", [2.0], "s", {"engines": 2}),
    ]
    assert record.find(ms, "sync", engines=1, bucket_mb=512).samples == (1.0,)
    with pytest.raises(KeyError):
        record.find(ms, "sync")


def test_interleave_alternates_the_order_and_keeps_warmups_out():
    calls, cleaned = [], []
    steps = {name: (lambda n=name: calls.append(n) or n) for name in "abc"}
    times = timing.interleave(steps, 2, warmup=1, before=cleaned.append)
    assert calls == list("abccbaabc")  # warm-up round, then the timed ones, each reversed in turn
    assert cleaned == calls
    assert [t.value for t in times["c"]] == ["c", "c"] and all(t.seconds >= 0 for t in times["a"])


def test_slowest_rank_takes_each_rounds_longest_call():
    t = timing.Timed
    ranks = [[t(1.0, 0.5, 0.0), t(2.0, 1.0, 0.0)], [t(1.5, 0.4, 1.0), t(1.0, 1.2, 1.0)]]
    rounds = timing.slowest_rank(ranks)
    assert [r.seconds for r in rounds] == [1.5, 2.0] and [r.cpu_s for r in rounds] == [0.5, 1.2]


# ------------------------------------------------------------------------------------------ suite


def test_suite_options():
    with pytest.raises(SystemExit):
        suite.parse_args([])
    assert suite.parse_args(["--suite", "cpu"]).out == suite.RESULTS / "suite_cpu"
    assert suite.parse_args(["--suite", "gpu", "--quick"]).out == suite.RESULTS / "suite_gpu_quick"
    args = suite.parse_args(["--suite", "cpu", "--only", "sync", "reward"])
    assert [b.name for b in args.benchmarks] == ["reward", "sync"]  # suite order
    assert {b.name for b in suite.parse_args(["--suite", "gpu"]).benchmarks} == {
        "logprob_memory",
        "train",
        "train_torch",
        "ipc_handoff",
        "probe_bf16",
        "moe",
    }
    with pytest.raises(SystemExit, match="rollout: not in the gpu suite"):
        suite.parse_args(["--suite", "gpu", "--only", "rollout"])
    with pytest.raises(SystemExit):
        suite.parse_args(["--suite", "cpu", "--repeat", "0"])


def _parsed(command: list[str]) -> argparse.Namespace:
    """A suite command's arguments as its benchmark parses them."""
    assert command[:2] == [sys.executable, "-m"]
    module = importlib.import_module(command[2])
    return module.parse_args(command[3:])


@pytest.mark.parametrize("quick", [False, True])
def test_every_command_of_every_suite_is_accepted_by_its_benchmark(tmp_path, quick):
    for bench in suite.BENCHMARKS:
        for name in bench.suites:
            args = _parsed(bench.command(name, quick, None, tmp_path))
            assert args.out == tmp_path / f"{bench.name}.json" and args.quick == quick
            assert "{out}" not in " ".join(map(str, vars(args).values()))
    again = _parsed(suite.BY_NAME["reward"].command("cpu", True, 4, tmp_path))
    assert again.repeat == 4  # the suite's --repeat wins over --quick's single repetition


def _numbers(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for key, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = max(values)
    return out


def test_the_full_cpu_suite_is_the_quick_one_scaled_up(tmp_path):
    """A full run differs from its quick run by sizes and repetitions only, each at least as large."""
    for bench in suite.select("cpu", None):
        quick = _numbers(_parsed(bench.command("cpu", True, None, tmp_path)))
        full = _numbers(_parsed(bench.command("cpu", False, None, tmp_path)))
        for key, small in quick.items():
            if key in ("warmup", "timeout", "min_len_frac", "prompt_len"):
                continue
            if key == "warmup_steps":  # peer's full run: None, the demo's own warm-up
                assert full.get(key) is None or full[key] >= small
                continue
            assert full[key] >= small, (bench.name, key, full[key], small)


def test_quick_step_scaling_and_peer_ask_for_one_run():
    from benchmarks import peer, scaling, step
    from megagrpo.config import config_to_dict, load_config

    def config(overrides):
        return config_to_dict(load_config(None, overrides))

    quick = scaling.parse_args(["--quick"])
    point = ["logging.val_every=0", "parallel.tensor_model_parallel_size=1", "grpo.num_prompts_per_step=64"]
    point += ["policy.mini_batch_size=256", *quick.extra]  # scaling's 64-prompt point
    run = config(step.setup_overrides("tiny_tp1", list(step.QUICK_RUN)))
    assert run == config(peer.ours_overrides("tiny", 1, 5, 10)) == config(point)
    steps = step.parse_args(["--quick"])
    assert step.SKIP["tiny"] + steps.measured["tiny"] == scaling.SKIP + quick.repeat == 5
    assert peer.parse_args(["--quick"]).run_steps["tiny"] == 5


def test_peer_m25_run_is_steps_setup_so_a_suite_makes_it_once():
    from benchmarks import peer, step

    assert peer.ours_overrides("m25", 1, 2) == step.setup_overrides("m25_tp1")
    assert "generation.ignore_eos=true" in peer.ours_overrides("m25", 1, 2)


def test_scaling_reads_the_sync_point_of_the_suites_sync_run_back(tmp_path):
    from benchmarks import scaling

    args = argparse.Namespace(out=tmp_path / "sync.json", command="c", size_mb=256.0)
    s = {"size_mb": 256.0, "engines": 1, "bucket_mb": 512.0, "bytes": 2 * 10**8}
    ms = [
        Measurement("sync", [0.5, 0.7], "s", s),
        Measurement("flat broadcast of the same bytes", [0.1], "s", s),
    ]
    record.write(args, "sync", "w", ms)
    sync, flat = scaling.sync_point(256, args.out, tmp_path)
    assert sync.samples == (0.5, 0.7) and flat.samples == (0.1,)
    curve = scaling.sync_curve(tmp_path, argparse.Namespace(sizes_mb=[256], sync_from=args.out))
    assert curve[0].name == "sync time per GB" and curve[0].samples == pytest.approx((2.5, 3.5))


# ----------------------------------------------------------------------------------------- README


def _results(root: Path, suite_dir: str, name: str, ms: list[Measurement]) -> None:
    args = argparse.Namespace(out=root / suite_dir / f"{name}.json", command=f"python -m benchmarks.{name}")
    record.write(args, name, "w", ms)


def test_readme_table_holds_the_headline_measurements_in_suite_order(tmp_path):
    _results(
        tmp_path, "suite_cpu", "train", [Measurement("train / bare", [0.9], "x", {"tp": 1}, ">= 0.85", True)]
    )
    _results(
        tmp_path,
        "suite_cpu",
        "reward",
        [Measurement("rate", [5.0], "1/s", headline=True), Measurement("no", [1], "")],
    )
    _results(tmp_path, "suite_gpu", "train", [Measurement("MFU", [0.1], "fraction", headline=True)])
    block = readme.render(tmp_path)
    assert block.startswith(readme.BEGIN) and block.endswith(readme.END)
    rows = [line for line in block.splitlines() if line.startswith("| [")]
    assert rows == [
        "| [reward](benchmarks/results/suite_cpu/reward.md) | rate | 5 1/s |  |",
        "| [train](benchmarks/results/suite_cpu/train.md) | train / bare (tp=1) | 0.9 x | >= 0.85: met |",
        "| [train](benchmarks/results/suite_gpu/train.md) | MFU | 0.1 fraction |  |",
    ]


def test_readme_block_is_replaced_between_the_markers_and_checked(tmp_path, monkeypatch):
    text = f"a\n{readme.BEGIN}\nold\n{readme.END}\nb\n"
    assert readme.replace_block(text, "NEW") == "a\nNEW\nb\n"
    old_marker = "a\n<!-- measured:begin (written by a tool) -->\nold\n<!-- measured:end -->\n"
    assert readme.replace_block(old_marker, "NEW") == "a\nNEW\n"
    with pytest.raises(ValueError, match="exactly one block"):
        readme.replace_block("no markers", "NEW")
    copy = tmp_path / "README.md"
    copy.write_text(text)
    monkeypatch.setattr(readme, "render", lambda: f"{readme.BEGIN}\nrows\n{readme.END}")
    assert readme.main(["--check", "--readme", str(copy)]) == 1 and copy.read_text() == text
    assert readme.main(["--readme", str(copy)]) == 0 and "rows" in copy.read_text()
    assert readme.main(["--check", "--readme", str(copy)]) == 0


def test_only_replaces_its_entries_of_an_earlier_suite(tmp_path):
    earlier = {
        "reward": {"wall_s": 1.0},
        "step": {"wall_s": 2.0, "error": "exited with 1"},
        "peer": {"wall_s": 3.0},
    }
    (tmp_path / "suite.json").write_text(json.dumps({"suite": "cpu", "quick": False, "benchmarks": earlier}))
    args = suite.parse_args(["--suite", "cpu", "--only", "step", "--out", str(tmp_path)])
    assert suite.earlier_entries(args) == earlier
    got = suite.merged(earlier, {"step": {"wall_s": 5.0}})
    assert list(got) == ["reward", "step", "peer"] and got["step"] == {"wall_s": 5.0}
    # another suite's (or a quick run's) results are not merged into
    assert (
        suite.earlier_entries(
            suite.parse_args(["--suite", "cpu", "--quick", "--only", "step", "--out", str(tmp_path)])
        )
        == {}
    )
    assert suite.earlier_entries(suite.parse_args(["--suite", "cpu", "--out", str(tmp_path)])) == {}


# ------------------------------------------------------------------------------- long-tail workload


def test_long_tail_budget_one_prompt_in_ten_asks_for_eight_times_the_tokens():
    from benchmarks.common.long_tail_engine import LONG_EVERY, budget, is_long
    from megagrpo.config import load_config
    from megagrpo.data.prompts import build_source

    prompts = [p.token_ids for p in build_source(load_config(None, [])).batch(0, 2000)]
    long = [p for p in prompts if is_long(p)]
    assert 0.08 <= len(long) / len(prompts) <= 0.12  # a hash: about 1 in LONG_EVERY
    assert LONG_EVERY == 10
    short = next(p for p in prompts if not is_long(p))
    assert budget(long[0], 128) == 128 and budget(short, 128) == 16 and budget(short, 100) == 13
    assert budget(short, 1) == budget(long[0], 1) == 1  # the probe's single token
    assert all(is_long(p) == is_long(list(p)) for p in prompts[:50])  # tuples (stream requests) alike


def test_long_tail_busy_seconds_are_clipped_to_the_window(tmp_path):
    from benchmarks.long_tail import busy_seconds

    calls = {0: [(0.0, 2.0), (3.0, 4.0)], 1: [(5.0, 12.0)]}
    for engine, spans in calls.items():
        lines = [json.dumps({"call": "generate", "start": a, "end": b}) for a, b in spans]
        (tmp_path / f"engine_busy_{engine}.jsonl").write_text("\n".join(lines) + "\n")
    assert busy_seconds(tmp_path, 1.0, 10.0) == (1.0 + 1.0 + 5.0, 2)


def test_train_compares_each_later_lora_rank_and_impl_with_the_first_runs_same_settings():
    from benchmarks.train import LORA_COMPARED, against_first

    def run(value: float, **extra) -> list[Measurement]:
        s = {"tp": 1, "impl": "local", **extra}
        return [
            Measurement("train step", [value, 2 * value], "tokens/s", s),
            Measurement("other", [1], "x", s),
        ]

    full, lora = run(100.0), run(150.0, lora_rank=8)
    [m] = against_first({0: full, 8: lora}, "lora_rank", LORA_COMPARED, lambda r, f: f"LoRA / {f or 'full'}")
    assert m.name == "train step, LoRA / full" and m.samples == (1.5, 1.5) and m.settings["lora_rank"] == 8
    # Several LoRA runs at two impls: each is matched with its own impl's first run, not the other's.
    torch_full, torch_lora = run(10.0, impl="torch"), run(30.0, impl="torch", lora_rank=8)
    by_lora = {0: [*full, *torch_full], 8: [*lora, *torch_lora]}
    got = against_first(by_lora, "lora_rank", LORA_COMPARED, lambda r, f: "x")
    assert [(m.settings["impl"], m.samples[0]) for m in got] == [("local", 1.5), ("torch", 3.0)]
    by_impl = {"local": [*full, *lora], "torch": [*torch_full, *torch_lora]}
    got = against_first(by_impl, "impl", ("train step",), lambda i, b: f"{i} / {b} layers")
    assert [m.name for m in got] == ["train step, torch / local layers"] * 2
    assert [m.samples[0] for m in got] == pytest.approx([0.1, 0.2])  # full with full, LoRA with LoRA
    with pytest.raises(KeyError, match="0 measurements 'train step'"):
        against_first({0: torch_full, 8: lora}, "lora_rank", LORA_COMPARED, lambda r, f: "x")


def test_train_lora_rank_option_reaches_the_config():
    from benchmarks import train
    from megagrpo.config.training import LORA_TARGETS

    args = train.parse_args(["--quick", "--lora-rank", "0", "8"])
    assert args.lora_rank == [0, 8]
    cfg = train.bench_config(args, 1, "local", 64, 2, lora=8)
    assert cfg.policy.lora.rank == 8 and set(cfg.policy.lora.targets) == set(LORA_TARGETS)
    assert not train.bench_config(args, 1, "local", 64, 2).policy.lora.enabled
    for bad in (["8", "8"], ["-1"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--lora-rank", *bad])
