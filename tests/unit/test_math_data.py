"""Generated math records, the math BPE tokenizer, and GRPO's prompt readers (JSONL, JSON, Parquet)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from megagrpo.config import ConfigError, load_config
from megagrpo.data.errors import DataError
from megagrpo.data.math_problems import math_records, write_math_dataset
from megagrpo.data.prompts import build_source, read_prompt_rows
from megagrpo.data.records import BadRows

pytestmark = pytest.mark.unit

TEMPLATE = "{prompt} Let's think step by step and output the final answer within \\boxed{}."


def test_records_are_deepscaler_shaped_and_reproducible():
    records = math_records(200, seed=3)
    assert records == math_records(200, seed=3)
    assert records[:50] == math_records(50, seed=3)  # record i depends on (seed, i) only
    assert records != math_records(200, seed=4)
    kinds = set()
    for r in records:
        assert set(r) == {"problem", "answer", "solution"}
        assert r["solution"].endswith(f"$\\boxed{{{r['answer']}}}$.")
        kinds.add(
            "fraction" if "\\frac" in r["answer"] else "negative" if r["answer"].startswith("-") else "int"
        )
    assert kinds == {"fraction", "negative", "int"}
    families = {r["problem"].split()[0] for r in records}
    assert {"Compute", "What", "Solve"} <= families


def test_worked_answers_are_right():
    for r in math_records(300, seed=5):
        p, answer = r["problem"], r["answer"]
        if answer.lstrip("-").startswith("\\frac"):
            num, den = answer.lstrip("-")[6:-1].split("}{")
            value = Fraction(int(num), int(den)) * (-1 if answer.startswith("-") else 1)
        else:
            value = Fraction(int(answer))
        if p.startswith("Solve"):  # "Solve for $x$: $ax + b = c$."
            lhs, c = p.split(": $")[1].rstrip("$.").split(" = ")
            a, b = lhs.split("x + ")
            assert int(a) * value + int(b) == int(c)
        elif p.startswith("What is"):  # "What is $p\\%$ of $n$?"
            pct = int(p.split("$")[1].split("\\")[0])
            n = int(p.split("$")[3])
            assert value == Fraction(pct * n, 100)
        elif "\\frac" in p:
            expr = p.split("$")[1].replace("\\frac{", "Fraction(").replace("}{", ",").replace("}", ")")
            assert value == eval(expr)
        else:
            expr = p.split("$")[1].replace("\\times", "*")
            assert value == eval(expr)


def test_math_tokenizer_is_a_normal_hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from megagrpo.data.tokenizer import math_bpe_tokenizer

    tok = math_bpe_tokenizer(512, TEMPLATE)
    assert len(tok) <= 512
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    text = loaded.apply_chat_template(
        [{"role": "user", "content": "Compute $1 + 2$."}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nCompute $1 + 2$.<|im_end|>\n<|im_start|>assistant\n"
    solution = math_records(1, seed=9)[0]["solution"]
    ids = loaded.encode(solution)
    assert loaded.decode(ids) == solution
    digits = [loaded.decode([i]) for i in loaded.encode("12345")]
    assert digits == ["1", "2", "3", "4", "5"]  # numbers are spelt digit by digit, as in Qwen2
    assert math_bpe_tokenizer(512, TEMPLATE).get_vocab() == tok.get_vocab()  # deterministic


def _cfg(tmp_path, train, *extra):
    from megagrpo.data.tokenizer import math_bpe_tokenizer

    model = tmp_path / "model"
    if not model.exists():
        model.mkdir()
        math_bpe_tokenizer(512, TEMPLATE).save_pretrained(model)
    return load_config(
        None,
        [
            "model.tiny=null",
            f"model.hf_dir={model}",
            "model.seq_length=96",
            "generation.max_new_tokens=48",
            f"data.train_path={train}",
            "data.num_val_prompts=0",
            "logging.val_every=0",
            f"data.template={TEMPLATE}",
            "data.apply_chat_template=true",
            *extra,
        ],
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_each_format_reads_with_configured_field_names(tmp_path, suffix):
    records = [{"question": r["problem"], "gold": r["answer"]} for r in math_records(5, seed=1)]
    path = write_math_dataset(tmp_path / f"train{suffix}", records)
    cfg = _cfg(tmp_path, path, "data.prompt_key=question", "data.answer_key=gold")
    source = build_source(cfg)
    prompts = source.batch(0, 5)
    assert sorted(p.answer for p in prompts) == sorted(r["gold"] for r in records)
    assert source.counts == {
        "data/skipped_rows": 0,
        "data/skipped_long_prompts": 0,
        "data/skipped_long_val_prompts": 0,
    }
    # the chat template around the template around the problem
    text = source.decode(prompts[0].token_ids)
    assert text.startswith("user\n") and "within \\boxed{}." in text and text.endswith("assistant\n")


def _bad_files(tmp_path):
    good = math_records(3, seed=2)
    rows = [good[0], {"answer": "3"}, {**good[1], "problem": "  "}, good[2]]  # rows 2 and 3 are bad
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:2]) + "{not json\n" + json.dumps(rows[3]) + "\n"
    )
    return {
        "jsonl": (jsonl, [2, 3]),
        "json": (write_math_dataset(tmp_path / "bad.json", rows), [2, 3]),
        "parquet": (write_math_dataset(tmp_path / "bad.parquet", rows), [2, 3]),
    }


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_bad_rows_stop_the_run_naming_file_and_row(tmp_path, kind):
    path, (first_bad, _) = _bad_files(tmp_path)[kind]
    cfg = _cfg(tmp_path, path)
    with pytest.raises(DataError) as info:
        read_prompt_rows(cfg, path, BadRows("error"))
    assert f"{path}: row {first_bad}:" in str(info.value)
    assert "data.on_bad_row=skip" in str(info.value)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
def test_bad_rows_are_skipped_and_counted(tmp_path, kind):
    path, bad_rows = _bad_files(tmp_path)[kind]
    cfg = _cfg(tmp_path, path, "data.on_bad_row=skip")
    source = build_source(cfg)
    assert source.counts["data/skipped_rows"] == len(bad_rows)
    assert len(source._train) == 2


def test_an_overlong_prompt_is_skipped_and_counted(tmp_path):
    records = math_records(4, seed=3)
    records[1] = {**records[1], "problem": records[1]["problem"] + " Think hard." * 20}
    path = write_math_dataset(tmp_path / "train.jsonl", records)
    source = build_source(_cfg(tmp_path, path))
    assert source.counts["data/skipped_long_prompts"] == 1
    assert sorted(p.answer for p in source._train) == sorted(
        r["answer"] for i, r in enumerate(records) if i != 1
    )
    assert all(len(p.token_ids) + 48 <= 96 for p in source._train)


def test_a_file_of_only_overlong_prompts_is_an_error(tmp_path):
    records = [{**r, "problem": r["problem"] + " Think hard." * 20} for r in math_records(2, seed=3)]
    path = write_math_dataset(tmp_path / "train.jsonl", records)
    with pytest.raises(DataError, match=r"all 2 prompts are too long for model\.seq_length=96"):
        build_source(_cfg(tmp_path, path))


def test_synthetic_math_is_for_sft_only(tmp_path):
    cfg = load_config(None, ["data.synthetic_task=math"])
    with pytest.raises(DataError, match="SFT data only"):
        build_source(cfg)


def test_a_share_of_terse_solutions_keeps_the_problems():
    full = math_records(400, seed=3)
    mixed = math_records(400, seed=3, terse_frac=0.5)
    terse = [m for f, m in zip(full, mixed, strict=True) if m["solution"] != f["solution"]]
    assert [(m["problem"], m["answer"]) for m in mixed] == [(f["problem"], f["answer"]) for f in full]
    assert 150 <= len(terse) <= 250
    assert all(m["solution"] == f"The answer is $\\boxed{{{m['answer']}}}$." for m in terse)
    assert math_records(400, seed=3, terse_frac=0.5) == mixed


def test_terse_share_is_checked():
    with pytest.raises(ConfigError, match=r"data\.math_terse_frac"):
        load_config(None, ["data.math_terse_frac=1.5"])


def test_a_share_of_unboxed_solutions_keeps_the_steps_and_scores_zero():
    from megagrpo.rewards.math import math_verify_reward

    full = math_records(400, seed=3)
    mixed = math_records(400, seed=3, unboxed_frac=0.5)
    changed = [(f, m) for f, m in zip(full, mixed, strict=True) if m["solution"] != f["solution"]]
    assert [(m["problem"], m["answer"]) for m in mixed] == [(f["problem"], f["answer"]) for f in full]
    assert 150 <= len(changed) <= 250
    for f, m in changed:
        steps = f["solution"].removesuffix(f"The answer is $\\boxed{{{f['answer']}}}$.")
        assert m["solution"] == f"{steps}The answer is ${m['answer']}$."
    f, m = changed[0]
    assert math_verify_reward(f["solution"], f["answer"]) == 1.0
    assert math_verify_reward(m["solution"], m["answer"]) == 0.0
    with pytest.raises(ConfigError, match=r"data\.math_unboxed_frac"):
        load_config(None, ["data.math_unboxed_frac=-0.1"])
