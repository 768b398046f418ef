"""The benchmark suite's pure parts (``python -m benchmarks``): options, selection, the command of
each benchmark, summary statistics, the Markdown report, the metrics read from the committed
results; and README.md's "Measured" table against what the generator writes from those results."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import readme_table, suite
from benchmarks.common import RESULTS

pytestmark = pytest.mark.unit


def test_suite_is_required_and_checked():
    with pytest.raises(SystemExit):
        suite.parse_args([])
    with pytest.raises(SystemExit):
        suite.parse_args(["--suite", "tpu"])


def test_default_out_depends_on_suite_and_quick():
    assert suite.parse_args(["--suite", "cpu"]).out == RESULTS / "suite_cpu"
    assert suite.parse_args(["--suite", "gpu", "--quick"]).out == RESULTS / "suite_gpu_quick"
    assert suite.parse_args(["--suite", "cpu", "--out", "/x/y"]).out == Path("/x/y")


def test_only_keeps_suite_order_and_rejects_names_outside_the_suite():
    args = suite.parse_args(["--suite", "cpu", "--only", "sync", "reward"])
    assert [b.name for b in args.benchmarks] == ["reward", "sync"]  # suite order, not the order given
    assert {b.name for b in suite.parse_args(["--suite", "gpu"]).benchmarks} == {"logprob_memory", "train"}
    with pytest.raises(SystemExit, match="rollout: not in the gpu suite"):
        suite.parse_args(["--suite", "gpu", "--only", "rollout"])
    with pytest.raises(SystemExit, match="nosuch"):
        suite.parse_args(["--suite", "cpu", "--only", "train", "nosuch"])


def test_repeat_must_be_positive():
    with pytest.raises(SystemExit):
        suite.parse_args(["--suite", "cpu", "--repeat", "0"])


def test_every_benchmark_has_arguments_for_each_of_its_suites():
    for bench in suite.BENCHMARKS:
        assert (suite.HERE / bench.script).is_file(), bench.script
        for name in bench.suites:
            assert name in bench.args and name in bench.quick_args, (bench.name, name)


def test_command_repetitions_and_output_path(tmp_path):
    train, reward = suite.BY_NAME["train"], suite.BY_NAME["reward"]
    quick = train.command("cpu", True, None, tmp_path)
    assert quick[0] == sys.executable and quick[1].endswith("train_bench.py")
    assert quick[quick.index("--iters") + 1] == "1"
    assert quick[quick.index("--out") + 1] == f"{tmp_path / 'train'}.json"
    full = train.command("cpu", False, None, tmp_path)
    assert full[full.index("--iters") + 1] == str(train.repeat_default["cpu"])
    gpu = train.command("gpu", False, None, tmp_path)  # repetitions per suite
    iters = gpu[gpu.index("--iters") + 1]
    assert iters == str(train.repeat_default["gpu"]) != full[full.index("--iters") + 1]
    assert full[full.index("--seq") + 1] == "256" != gpu[gpu.index("--seq") + 1]  # args per suite
    override = reward.command("cpu", True, 4, tmp_path)
    assert override[override.index("--repeat") + 1] == "4"
    assert override[override.index("--output") + 1] == str(tmp_path / "reward")  # --output takes no .json


def test_summarize():
    assert suite.summarize([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert suite.summarize([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0, "n": 1}
    with pytest.raises(ValueError):
        suite.summarize([])


def test_fmt():
    assert suite.fmt(0.123456) == "0.1235"
    assert suite.fmt(12345.6) == "12346"
    assert suite.fmt(4.5e6) == "4.5e+06"
    assert suite.fmt(0.0) == "0"


def test_render_markdown_lists_each_benchmark_and_its_metrics():
    report = {
        "suite": "cpu",
        "quick": True,
        "wall_s": 12.0,
        "machine": {"date": "d", "host": "h", "cpu": "c", "cpus_usable": 2, "memory_bytes": 2**31},
        "benchmarks": {
            "train": {
                "what": "train vs bare",
                "command": ["python", "train_bench.py"],
                "wall_s": 3.25,
                "returncode": 0,
                "metrics": {
                    "tp1 train/bare": {"median": 0.9, "min": 0.8, "max": 1.0, "n": 3, "unit": "ratio"}
                },
            },
            "sync": {
                "what": "sync",
                "command": ["x"],
                "wall_s": 1.0,
                "returncode": 1,
                "error": "exited with 1",
            },
        },
    }
    md = suite.render_markdown(report)
    assert "# Benchmark suite `cpu` (quick)" in md
    assert "| tp1 train/bare | ratio | 0.9 | 0.8 | 1 | 3 |" in md
    assert "## sync: sync" in md and "exit status 1: exited with 1" in md
    assert "2.0 GiB" in md


@pytest.mark.parametrize(
    "name, source",
    [
        ("train", "train"),
        ("rollout", "rollout"),
        ("sync", "sync"),
        ("convert", "convert"),
        ("logprob_memory", "logprob_memory"),
        ("sft_dpo", "sft_dpo"),
        ("faults", "faults"),
        ("reward", "reward"),
        ("shard_sync", "shard_sync"),
    ],
)
def test_metrics_of_the_committed_reports(name, source):
    report = json.loads((RESULTS / f"{source}.json").read_text())
    samples = suite.BY_NAME[name].metrics(report)
    assert samples
    for metric, (values, unit) in samples.items():
        assert values and unit, metric
        assert all(isinstance(v, (int, float)) for v in values), metric


def test_metric_samples_are_the_repetitions_the_script_recorded():
    report = json.loads((RESULTS / "train.json").read_text())
    run = report["runs"][0]
    values, _ = suite.BY_NAME["train"].metrics(report)[f"tp{run['tp']} train tokens/s"]
    assert len(values) == len(run["train"]["step_s_all"])
    # tokens per step over each recorded step time: the fastest step is the highest rate
    assert max(values) == pytest.approx(run["tokens_per_step"] / min(run["train"]["step_s_all"]), rel=1e-12)


def test_sft_and_dpo_keep_their_own_bare_step():
    report = json.loads((RESULTS / "sft_dpo.json").read_text())
    samples = suite.BY_NAME["sft_dpo"].metrics(report)
    sft_bare, dpo_bare = samples["tp1 sft: bare s"][0], samples["tp1 dpo: bare s"][0]
    assert sft_bare == report["runs"][0]["sft"]["bare"]["wall"]
    assert dpo_bare == report["runs"][0]["dpo"]["bare"]["wall"]


def test_readme_measured_table_is_the_generated_one():
    """A number edited by hand in README's generated table, or a results file changed without
    `python -m benchmarks readme`, fails here."""
    text = readme_table.README.read_text()
    block = readme_table.render_table(readme_table.load_results())
    assert readme_table.replace_block(text, block) == text


def test_replace_block_needs_both_markers():
    block = f"{readme_table.BEGIN}\nnew\n{readme_table.END}"
    text = f"a\n{readme_table.BEGIN}\nold\n{readme_table.END}\nb\n"
    assert readme_table.replace_block(text, block) == f"a\n{block}\nb\n"
    with pytest.raises(ValueError, match="markers"):
        readme_table.replace_block("no markers here", block)


def test_a_changed_result_changes_the_table():
    results = readme_table.load_results()
    before = readme_table.render_table(results)
    results["train"]["runs"][0]["ratio_train_over_bare"] = 0.123
    after = readme_table.render_table(results)
    assert "0.12 (TP=" in after and before != after


def test_out_placeholder_names_the_suite_output_directory(tmp_path):
    scaling = suite.BY_NAME["scaling"].command("cpu", False, None, tmp_path)
    assert scaling[scaling.index("--sync-from") + 1] == f"{tmp_path}/sync.json"
    assert not any("{out}" in a for a in scaling)


def _script_module(name: str):
    """A benchmark script as a module (its siblings import as top-level ``common``, ``step_bench``)."""
    import importlib

    here = str(Path(suite.__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def test_peer_m25_run_is_step_bench_setup_so_a_suite_makes_it_once():
    peer, step = _script_module("peer_bench"), _script_module("step_bench")
    assert peer.ours_overrides("m25", 1, 2) == step.setup_overrides("m25_tp1")
    assert "generation.ignore_eos=true" in peer.ours_overrides("m25", 1, 2)
    # At tiny the peer's run keeps its own config: TRL's advantage, one micro-batch, validation.
    tiny = peer.ours_overrides("tiny", 1, 10)
    assert "grpo.baseline=mean" in tiny and "logging.val_every=10" in tiny


def test_scaling_sync_point_read_back_only_for_the_same_size(tmp_path):
    scaling = _script_module("scaling_bench")
    row = {"engines": 1, "bucket_mb": 512, "total_bytes": 2**28, "sync_s": 0.5, "flat_s": 0.1}
    other = {**row, "engines": 2}
    report = {"args": {"size_mb": 256}, "variants": {"default": {"results": [other, row]}}}
    path = tmp_path / "sync.json"
    path.write_text(json.dumps(report))
    assert scaling.measured_sync_row(path, 256) == row
    assert scaling.measured_sync_row(path, 400) is None  # another size: measured by the curve
    assert scaling.measured_sync_row(tmp_path / "missing.json", 256) is None
    (point,) = scaling.sync_curve(tmp_path, [256], path)
    assert point["from"] == str(path) and point["s_per_gb"] == 0.5 / (2**28 / 1e9)


def test_quick_step_scaling_and_peer_ask_for_one_run():
    from megagrpo.config import config_to_dict, load_config

    peer, step = _script_module("peer_bench"), _script_module("step_bench")
    scaling = ["logging.val_every=0", "parallel.tensor_model_parallel_size=1", "grpo.num_prompts_per_step=64"]
    scaling += ["policy.mini_batch_size=256", *suite.QUICK_RUN]  # scaling_bench's 64-prompt point

    def config(overrides):
        return config_to_dict(load_config(None, overrides))

    run = config(step.setup_overrides("tiny_tp1", list(suite.QUICK_RUN)))
    assert run == config(peer.ours_overrides("tiny", 1, 5, 10)) == config(scaling)
    quick = {b.name: b.command("cpu", True, None, Path("/x")) for b in suite.BENCHMARKS}
    assert quick["step"][quick["step"].index("--steps") + 1] == "5"
    assert quick["peer"][quick["peer"].index("--steps") + 1] == "tiny=5"
    assert quick["peer"][quick["peer"].index("--warmup-steps") + 1] == "10"
