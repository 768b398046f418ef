import subprocess
import sys
import textwrap

import pytest

from megagrpo.cli import main, run

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _in_a_temporary_directory(tmp_path, monkeypatch):
    """Default output paths (``runs/<name>/checkpoints``) are relative: not this checkout's ``runs/``."""
    monkeypatch.chdir(tmp_path)


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for sub in ("train", "sft", "dpo", "eval", "plan", "export", "warmup"):
        assert sub in out


def test_eval_needs_a_model_or_a_checkpoint(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval"])
    assert exc.value.code == 2
    assert "one of the arguments --model --checkpoint is required" in capsys.readouterr().err


def test_eval_names_a_missing_model_before_starting_anything(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "nowhere: no config.json" in err


def test_eval_names_a_run_without_result(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), f"logging.dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "--checkpoint" in err and "neither an HF export" in err


def test_eval_of_a_peft_adapter_names_its_missing_base_before_starting_anything(tmp_path, capsys):
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "base_model_name_or_path": "gone/base"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert main(["eval", "--model", str(adapter), f"logging.dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "adapter_config.json: base_model_name_or_path 'gone/base'" in err and "--base" in err
    assert main(["eval", "--model", str(adapter), "--base", str(tmp_path / "nobase")]) == 1
    assert "--base" in capsys.readouterr().err and not (tmp_path / "eval").exists()
    assert main(["eval", "--checkpoint", str(tmp_path), "--base", str(tmp_path)]) == 1
    assert "--base needs --model of a PEFT adapter directory" in capsys.readouterr().err


def test_plan_validates_the_default(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks = DP 1 x TP 2 x PP 1 x CP 1" in out
    assert "local: sequence parallel no, context parallel no; micro-batches padded" in out
    assert "plan OK" in out


def test_plan_says_what_the_layers_support(capsys):
    assert main(["plan", "parallel.transformer_impl=torch", "parallel.sequence_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert "torch: sequence parallel yes, context parallel no" in out
    assert "micro-batches packed end to end (THD)" in out
    assert main(["plan", "parallel.transformer_impl=torch", 'policy.sequence_packing="off"']) == 0
    assert "micro-batches padded" in capsys.readouterr().out


def test_plan_reports_bad_override_by_key(capsys):
    assert main(["plan", "grpo.num_generationz=8"]) == 1
    err = capsys.readouterr().err
    assert "grpo.num_generationz" in err and "num_generations" in err


def test_train_reports_impossible_layout_before_starting(capsys):
    assert main(["train", "parallel.pipeline_model_parallel_size=3"]) == 1
    err = capsys.readouterr().err
    assert "parallel.pipeline_model_parallel_size" in err and "num_layers" in err


def _run_python(code: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    # A generous deadline: importing torch on two loaded cores takes tens of seconds.
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_exit_without_teardown_keeps_exit_handlers_output_and_status(tmp_path):
    marker = tmp_path / "atexit-ran"
    done = _run_python(
        f"""
        import atexit, pathlib, sys
        from megagrpo.cli import exit_without_teardown

        class Finalized:
            def __del__(self):
                print("teardown ran")  # interpreter teardown would print this; it must not run

        keep = Finalized()
        atexit.register(pathlib.Path({str(marker)!r}).write_text, "yes")
        print("result line")  # buffered: a pipe is not a terminal
        sys.stderr.write("note\\n")
        exit_without_teardown(3)
        """
    )
    assert done.returncode == 3
    assert done.stdout == "result line\n" and done.stderr == "note\n"
    assert marker.read_text() == "yes"


def test_exit_without_teardown_waits_for_a_running_thread():
    # The thread is still running when exit_without_teardown looks, whatever the machine's load: it waits
    # for an event set by threading's own shutdown hooks, which run in the interpreter's teardown (before
    # it joins the threads) and never when the process ends with os._exit.
    done = _run_python(
        """
        import threading
        from megagrpo.cli import exit_without_teardown

        teardown = threading.Event()
        threading._register_atexit(teardown.set)
        threading.Thread(target=lambda: (teardown.wait(), print("thread finished"))).start()
        exit_without_teardown(0)
        """
    )
    assert done.returncode == 0 and done.stdout == "thread finished\n"


def test_the_program_entry_point_exits_with_the_command_status(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        run(["eval", "--model", str(tmp_path)])
    assert exc.value.code == 1
    assert "no config.json" in capsys.readouterr().err


def test_dpo_reports_a_layout_it_cannot_run_before_starting(capsys, tmp_path):
    argv = ["dpo", f"logging.dir={tmp_path}", "policy.micro_batch_max_tokens=300"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "policy.micro_batch_max_tokens" in err and "2 * seq_length" in err
    assert not (tmp_path / "tiny-cpu").exists()  # no warm-up started


def test_sft_reports_a_missing_dataset_by_file(capsys, tmp_path):
    assert main(["sft", f"data.train_path={tmp_path / 'nope.jsonl'}"]) == 1
    assert "nope.jsonl: dataset file not found" in capsys.readouterr().err
