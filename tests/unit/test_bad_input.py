"""Bad input, one clear error each, before any worker starts: every row of the "Bad input" table of
docs/faults.md names its test here (tests/unit/test_docs.py checks that each one exists).

Datasets (GRPO and distillation prompts, eval problems, SFT examples, DPO pairs, episode tasks): bytes that
are not UTF-8, fields of the wrong type, texts too long in characters to fit their token budget (refused
before anything is tokenized), nesting too deep to parse. Config YAML: repeated keys, alias bombs,
self-containing aliases. User modules named by the config: a module that raises, exits or hangs at import.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from megagrpo.cli import main
from megagrpo.config import ConfigError, load_config
from megagrpo.config.yaml_text import MAX_VALUES
from megagrpo.data.errors import DataError
from megagrpo.data.fields import chars_per_token
from megagrpo.data.prompts import dataset_source, read_prompt_rows, task_source
from megagrpo.data.records import BadRows, read_records
from megagrpo.data.supervised import build_preference_source, build_sft_source
from megagrpo.data.tokenizer import char_tokenizer

pytestmark = pytest.mark.unit

GOOD_PROMPT = {"problem": "1+2=", "answer": "3"}
GOOD_SFT = {"problem": "3+4=", "response": "7"}
GOOD_PAIR = {"problem": "3+4=", "chosen": "7", "rejected": "8"}


def _write(path: Path, rows: list) -> Path:
    """Rows as the file's format: JSONL lines (a bytes row is written as is), a JSON array or Parquet."""
    if path.suffix == ".jsonl":
        path.write_bytes(
            b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)
        )
    elif path.suffix == ".json":
        path.write_bytes(
            b"[" + b", ".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows) + b"]"
        )
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {k: [r[k] for r in rows] for k in rows[0]}
        # Parquet writers need not check UTF-8: a string column viewed from bytes holds what it was given.
        table = pa.table({k: pa.array(v, type=pa.binary()).view(pa.string()) for k, v in columns.items()})
        pq.write_table(table, path)
    return path


def _cfg(*extra: str, trainer: str = "grpo"):
    return load_config(None, ["model.seq_length=64", "generation.max_new_tokens=16", *extra], trainer=trainer)


def _grpo(path: Path, *extra: str):
    cfg = _cfg(f"data.train_path={path}", "data.num_val_prompts=0", "logging.val_every=0", *extra)
    return dataset_source(cfg, char_tokenizer())


def _sft(path: Path, *extra: str):
    cfg = _cfg(f"data.train_path={path}", "data.apply_chat_template=true", *extra, trainer="sft")
    return build_sft_source(cfg, char_tokenizer())


def _dpo(path: Path, *extra: str):
    cfg = _cfg(f"data.train_path={path}", "data.apply_chat_template=true", *extra, trainer="dpo")
    return build_preference_source(cfg, char_tokenizer())


# ------------------------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_bytes_that_are_not_utf8_are_a_bad_row_named_by_offset(tmp_path, suffix):
    rows = [{"problem": b"1+1=", "answer": b"2"}, {"problem": b"2+\xff2=", "answer": b"4"}]
    if suffix != ".parquet":  # JSON text: the bytes go into the file as they are
        rows = [b'{"problem": "1+1=", "answer": "2"}', b'{"problem": "2+\xff2=", "answer": "4"}']
    path = _write(tmp_path / f"data{suffix}", rows)
    with pytest.raises(DataError) as err:
        list(read_records(path, BadRows("error")))
    offset = {".jsonl": 35 + 15, ".json": 1 + 34 + 2 + 15, ".parquet": 2}[suffix]
    where = "of the value" if suffix == ".parquet" else "of the file"
    assert f"{path}: row 2: " in str(err.value)
    assert f"not valid UTF-8: byte 0xff at byte offset {offset} {where}" in str(err.value)
    skipped = BadRows("skip")
    assert [row for row, _ in read_records(path, skipped)] == [1] and skipped.skipped == 1


def test_bytes_that_are_not_utf8_are_named_by_every_dataset_reader(tmp_path):
    bad = b'{"problem": "3+\xc34=", "response": "7", "chosen": "7", "rejected": "8", "answer": "7"}'
    good = json.dumps({**GOOD_SFT, **GOOD_PAIR, **GOOD_PROMPT}).encode()
    path = _write(tmp_path / "data.jsonl", [good, bad])
    message = rf"data\.jsonl: row 2: not valid UTF-8: byte 0xc3 at byte offset {len(good) + 1 + 15}"
    for read in (_grpo, _sft, _dpo):  # GRPO's prompts are distillation's and eval's too
        with pytest.raises(DataError, match=message):
            read(path)
    episodes = ["env.environment=guess_number", "env.max_episode_tokens=32", "env.max_new_tokens=16"]
    cfg = _cfg(f"data.train_path={path}", *episodes)
    with pytest.raises(DataError, match=message):
        task_source(cfg)  # episode tasks


def test_a_prompt_that_is_not_a_string_is_refused(tmp_path):
    cases = [
        ({"problem": {"text": "1+1="}, "answer": "2"}, "'problem' must be a string, got dict"),
        ({"problem": ["1+1="], "answer": "2"}, "'problem' must be a string, got list"),
        ({"problem": 12, "answer": "2"}, "'problem' must be a string, got int"),
        ({"problem": "1+1=", "answer": {"value": 2}}, "'answer' must be a string, got dict"),
    ]
    for row, message in cases:
        path = _write(tmp_path / "prompts.jsonl", [GOOD_PROMPT, row])
        with pytest.raises(DataError, match=rf"prompts\.jsonl: row 2: {message}"):
            read_prompt_rows(_cfg(), path, BadRows("error"))
    # A number is an answer (the reward receives it as text).
    path = _write(tmp_path / "prompts.jsonl", [{"problem": "1+1=", "answer": 2}])
    assert read_prompt_rows(_cfg(), path, BadRows("error")) == [(1, "1+1=", "2")]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "user", "content": {"text": "1+1="}}],
            r"messages\[0\]\.content must be a string, got dict",
        ),
        ([{"role": 1, "content": "1+1="}], r"messages\[0\]\.role must be a string, got int"),
        (["1+1="], r"messages\[0\] must be an object with 'role' and 'content'"),
        ({"role": "user", "content": "1+1="}, r"'messages' must be a string or a list of messages, got dict"),
    ],
    ids=["content-dict", "role-int", "bare-string", "not-a-list"],
)
def test_messages_must_be_lists_of_role_and_content_strings(tmp_path, messages, message):
    turn = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    path = _write(tmp_path / "sft.jsonl", [{"messages": turn}, {"messages": messages}])
    with pytest.raises(DataError, match=rf"sft\.jsonl: row 2: {message}"):
        _sft(path)
    pairs = _write(tmp_path / "pairs.jsonl", [GOOD_PAIR, {**GOOD_PAIR, "problem": messages}])
    with pytest.raises(DataError, match=rf"pairs\.jsonl: row 2: .*{message.split(' ', 1)[1]}"):
        _dpo(pairs)


def test_a_lone_surrogate_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(GOOD_PROMPT) + "\n" + '{"problem": "1+\\ud800", "answer": "1"}\n')
    with pytest.raises(
        DataError, match=r"row 2: 'problem' holds a lone surrogate \(U\+D800\) at character 2"
    ):
        read_prompt_rows(_cfg(), path, BadRows("error"))


def test_deeply_nested_json_is_a_bad_row(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(GOOD_PROMPT) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep\.jsonl: row 2: nested too deeply"):
        list(read_records(path, BadRows("error")))


def test_a_text_the_tokenizer_cannot_encode_is_a_bad_row(tmp_path):
    path = _write(tmp_path / "sft.jsonl", [GOOD_SFT, {"problem": "what is 3+4?", "response": "7"}])
    with pytest.raises(DataError, match=r"sft\.jsonl: row 2: cannot be tokenized: .*Missing \[UNK\] token"):
        _sft(path)  # the tiny model's character vocabulary has no letters and no unknown token
    pairs = _write(tmp_path / "pairs.jsonl", [GOOD_PAIR, {**GOOD_PAIR, "problem": "what is 3+4?"}])
    with pytest.raises(DataError, match=r"pairs\.jsonl: row 2: cannot be tokenized"):
        _dpo(pairs)


HUGE = 50 * 1024 * 1024
"""The 50 MB row of the report (tokenizing it in full held ~20 GB)."""


def _spy_on_tokenizing(monkeypatch, tok) -> list[int]:
    """The lengths of the texts ``tok`` is asked to tokenize (encode, chat template, call)."""
    seen: list[int] = []

    def spy(method):
        def call(*args, **kwargs):
            seen.extend(len(json.dumps(a)) for a in args if isinstance(a, (str, list)))
            return method(*args, **kwargs)

        return call

    for name in ("encode", "apply_chat_template", "__call__"):
        monkeypatch.setattr(tok, name, spy(getattr(tok, name)))
    return seen


@pytest.mark.parametrize("reader", ["grpo", "sft", "dpo"])
def test_a_huge_text_is_refused_before_tokenizing(tmp_path, monkeypatch, reader):
    huge = "1" * HUGE
    row = {"grpo": {"problem": huge, "answer": "1"}, "sft": {**GOOD_SFT, "response": huge}}
    row["dpo"] = {**GOOD_PAIR, "rejected": huge}
    good = {"grpo": GOOD_PROMPT, "sft": GOOD_SFT, "dpo": GOOD_PAIR}[reader]
    path = _write(tmp_path / "data.jsonl", [good, row[reader]])
    del huge
    tok = char_tokenizer()
    seen = _spy_on_tokenizing(monkeypatch, tok)
    bound = 64 * chars_per_token(tok)  # model.seq_length x the tokenizer's characters per token
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            if reader == "grpo":
                cfg = _cfg(f"data.train_path={path}", "data.num_val_prompts=0", "logging.val_every=0")
                dataset_source(cfg, tok)
            elif reader == "sft":
                build_sft_source(_cfg(f"data.train_path={path}", trainer="sft"), tok)
            else:
                build_preference_source(_cfg(f"data.train_path={path}", trainer="dpo"), tok)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"{path}: row 2: " in str(err.value)
    assert f"{HUGE:,} characters" in str(err.value) and "(not tokenized)" in str(err.value)
    assert all(n < bound for n in seen) and bound < HUGE  # at most the good row reached the tokenizer
    # The row is held a few times (bytes, text, parsed), never expanded: tokenizing it held ~20 GB.
    assert peak < 4 * HUGE


def test_the_character_bound_admits_every_text_that_fits(tmp_path):
    """The bound is the budget x the longest vocabulary entry x 2: a prompt of exactly the budget's tokens,
    each the longest entry of a byte-level BPE (the most characters a token can stand for), is read and
    tokenized, not refused by the bound."""
    from megagrpo.data.tokenizer import math_bpe_tokenizer

    tok = math_bpe_tokenizer(512)
    specials = {*tok.all_special_tokens, "<|im_start|>"}
    longest = max((entry for entry in tok.get_vocab() if entry not in specials), key=len)
    assert chars_per_token(tok) == 2 * max(len(entry) for entry in tok.get_vocab())
    budget = 48  # model.seq_length 64 less 16 new tokens
    text = tok.convert_tokens_to_string([longest]) * budget
    assert len(tok.encode(text)) == budget and len(text) == budget * len(longest)
    path = _write(tmp_path / "prompts.jsonl", [{"problem": text, "answer": "1"}])
    cfg = _cfg(f"data.train_path={path}", "data.num_val_prompts=0", "logging.val_every=0")
    source = dataset_source(cfg, tok)
    assert source._train[0].token_ids == tok.encode(text) and source.counts["data/skipped_rows"] == 0


# ------------------------------------------------------------------------------------------- YAML


def test_a_repeated_yaml_key_is_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("grpo:\n  num_steps: 3\n  seed: 1\n  num_steps: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: grpo.num_steps: duplicate key (lines 2 and 4): YAML would keep the last one silently; "
        "remove one"
    )
    with pytest.raises(ConfigError, match=r"env\.args\.high: duplicate key"):
        load_config(None, ["env.environment=guess_number", "env.args={high: 3, high: 4}"])


def _bomb(levels: int) -> str:
    lines = ["    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("env:\n  environment: guess_number\n  args:\n" + _bomb(9))  # 10^9 values expanded
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: env.args.l4: expands to 111,111 values through YAML aliases")
    assert f"at most {MAX_VALUES:,}" in str(err.value)
    # Aliases within the bound are YAML as usual (here in an override).
    args = "{low: &a 3, high: *a}"  # arguments guess_number takes (env.args are checked against them)
    fits = ["env.environment=guess_number", "env.max_episode_tokens=128", "env.max_new_tokens=16"]
    assert load_config(None, [*fits, f"env.args={args}"]).env.args == {"low": 3, "high": 3}


def test_a_yaml_node_that_contains_itself_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("env:\n  environment: guess_number\n  args:\n    loop: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"env\.args\.loop: contains itself through a YAML alias"):
        load_config(path)


def test_a_saved_run_config_is_read_with_the_same_checks(tmp_path):
    from megagrpo.trainers.checkpoints import run_result

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("checkpoint:\n  dir: a\n  dir: b\n")
    with pytest.raises(
        ConfigError, match=r"model\.init_from: .*config\.yaml: checkpoint\.dir: duplicate key"
    ):
        run_result(run, "model.init_from")
    (run / "config.yaml").write_text("checkpoint:\n  bomb:\n" + _bomb(9))
    with pytest.raises(ConfigError, match=r"model\.init_from: .*checkpoint\.bomb\.l4: expands to"):
        run_result(run, "model.init_from")


# ------------------------------------------------------------------------------------------- user modules

BAD_MODULES = {
    "sys-exit": ("import sys\nsys.exit(0)\n", r"importing '.*sys_exit\.py' called sys\.exit\(0\)"),
    "hangs": (
        "while True:\n    pass\n",
        r"importing '.*hangs\.py' did not finish within 2 s \(reward\.import_timeout_s\)",
    ),
    "raises": (
        "raise RuntimeError('no GPU here')\n",
        r"loading '.*raises\.py:reward' raised RuntimeError: no GPU",
    ),
    "os-exit": (
        "import os\nos._exit(3)\n",
        r"the process importing '.*os_exit\.py' ended with exit status 3",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_MODULES))
def test_a_reward_module_that_exits_hangs_or_raises_at_import_stops_plan(tmp_path, capsys, kind):
    code, message = BAD_MODULES[kind]
    module = tmp_path / f"{kind.replace('-', '_')}.py"
    module.write_text(code + "\ndef reward(response, answer):\n    return 1.0\n")
    overrides = ["reward.kind=python", f"reward.function={module}:reward", "reward.import_timeout_s=2"]
    assert main(["plan", *overrides]) == 1
    err = capsys.readouterr().err
    assert err.startswith("megagrpo plan: config error: ") and "reward.function: " in err
    assert len(err.splitlines()) == 1  # one line, no traceback
    import re

    assert re.search(message, err), err


@pytest.mark.parametrize("kind", ["sys-exit", "hangs"])
def test_an_environment_module_that_exits_or_hangs_at_import_is_refused(tmp_path, kind):
    code, message = BAD_MODULES[kind]
    module = tmp_path / f"{kind.replace('-', '_')}.py"
    module.write_text(code)
    overrides = [f"env.environment={module}:Env", "env.import_timeout_s=2"]
    with pytest.raises(ConfigError, match=r"env\.environment: " + message.replace("reward", "env")):
        load_config(None, overrides)


def test_an_in_process_import_that_exits_is_a_value_error_naming_the_module(tmp_path):
    """After the child's check, the driver's own imports (environment tasks) still turn sys.exit into an
    error naming the module, not the end of the process."""
    from megagrpo.rewards.user import load_function

    module = tmp_path / "exits_later.py"
    module.write_text("import sys\nsys.exit(4)\n")
    with pytest.raises(ValueError, match=r"importing '.*exits_later\.py' called sys\.exit\(4\)"):
        load_function(f"{module}:anything")
    # The driver's environment tasks: a data error naming the key (one line from the command).
    import dataclasses

    cfg = load_config(
        None, ["env.environment=guess_number", "env.max_episode_tokens=128", "env.max_new_tokens=16"]
    )
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, environment=f"{module}:Env"))
    with pytest.raises(DataError, match=r"^env\.environment: importing '.*exits_later\.py' called sys\.exit"):
        task_source(cfg)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its (new) parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_what_a_hanging_module_started_is_killed_with_it(tmp_path):
    import time

    marker = tmp_path / "pid"
    module = tmp_path / "starts_and_hangs.py"
    module.write_text(
        "import subprocess, pathlib, time\n"
        "p = subprocess.Popen(['sleep', '600'])\n"
        f"pathlib.Path({str(marker)!r}).write_text(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    overrides = ["reward.kind=python", f"reward.function={module}:reward", "reward.import_timeout_s=2"]
    with pytest.raises(ConfigError, match=r"did not finish within 2 s"):
        load_config(None, overrides)
    pid = int(marker.read_text())
    for _ in range(300):  # SIGKILL is delivered, not awaited: the process ends once it is scheduled
        if _dead(pid):
            break
        time.sleep(0.1)
    assert _dead(pid), f"the module's sleep {pid} outlived the check"
