import pytest

from megagrpo.cli import main

pytestmark = pytest.mark.unit


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for sub in ("train", "eval", "plan", "export", "warmup"):
        assert sub in out


@pytest.mark.parametrize("argv", [["eval"]])
def test_unlanded_subcommands_say_so_and_fail(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "not implemented" in captured.err
    assert captured.out == ""


def test_plan_validates_the_default(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks = DP 1 x TP 2 x PP 1 x CP 1" in out
    assert "config OK" in out


def test_plan_reports_bad_override_by_key(capsys):
    assert main(["plan", "grpo.num_generationz=8"]) == 1
    err = capsys.readouterr().err
    assert "grpo.num_generationz" in err and "num_generations" in err


def test_train_reports_impossible_layout_before_starting(capsys):
    assert main(["train", "parallel.pipeline_model_parallel_size=3"]) == 1
    err = capsys.readouterr().err
    assert "parallel.pipeline_model_parallel_size" in err and "num_layers" in err
