"""SFT/DPO data: JSONL / JSON / Parquet records, chat-template assistant masks, every kind of bad row
under both policies, and the chat-template config check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.config import ConfigError, load_config
from megagrpo.data.errors import DataError
from megagrpo.data.supervised import (
    build_preference_source,
    build_sft_source,
    render_conversation,
    render_response,
)
from megagrpo.data.tokenizer import CHAR_CHAT_TEMPLATE, char_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

# Character ids: PAD 0, BOS 1, EOS 2, "0".."9" 3..12, "+" 13, "-" 14, "*" 15, "=" 16, " " 17
BOS, EOS = 1, 2


def _ids(text: str) -> list[int]:
    return [3 + "0123456789+-*= ".index(ch) for ch in text]


CONVERSATION = [
    {"role": "user", "content": "37+45="},
    {"role": "assistant", "content": "82"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
]


def _expected_multi_turn():
    # <s> 37+45= 82 </s> 1+1= 2 </s>; assistant tokens: "82</s>" and "2</s>".
    ids = [BOS, *_ids("37+45="), *_ids("82"), EOS, *_ids("1+1="), *_ids("2"), EOS]
    mask = [False] * 7 + [True] * 3 + [False] * 4 + [True] * 2
    return tuple(ids), tuple(mask)


@pytest.mark.parametrize("marked", [True, False], ids=["generation-marks", "prefix-rendering"])
def test_assistant_mask_of_a_multi_turn_conversation_matches_the_hand_built_one(marked):
    template = CHAR_CHAT_TEMPLATE
    if not marked:  # a template without {% generation %}: turns found by rendering prefixes
        template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    example = render_conversation(char_tokenizer(template), CONVERSATION, chat_template=True)
    assert (example.input_ids, example.loss_mask) == _expected_multi_turn()


def test_plain_prompt_response_without_chat_template():
    example = render_response(char_tokenizer(), "2+2=", "4", chat_template=False)
    assert example.input_ids == (BOS, *_ids("2+2="), *_ids("4"), EOS)
    assert example.loss_mask == (False,) * 5 + (True, True)


def _cfg(tmp_path: Path, *extra: str):
    return load_config(None, ["model.seq_length=32", "sft.num_val_examples=4", *extra])


def _write(path: Path, rows: list) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD_SFT = [
    {"messages": CONVERSATION},
    {"messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_sft_records_from_each_format(tmp_path, suffix):
    path = _write(tmp_path / f"train{suffix}", GOOD_SFT)
    cfg = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true")
    source = build_sft_source(cfg, load_tokenizer(cfg))
    examples = source.batch(1, 2)
    assert sorted(e.input_ids for e in examples) == sorted(
        [_expected_multi_turn()[0], (BOS, *_ids("3+4="), *_ids("7"), EOS)]
    )
    assert source.skipped_rows == 0


def test_prompt_response_records(tmp_path):
    path = _write(tmp_path / "train.jsonl", [{"problem": "5+5=", "response": "10"}])
    cfg = _cfg(tmp_path, f"data.train_path={path}")
    (example,) = build_sft_source(cfg, load_tokenizer(cfg)).batch(1, 1)
    assert example.input_ids == (BOS, *_ids("5+5="), *_ids("10"), EOS)


BAD_SFT = [
    ({"response": "4"}, r"missing key 'problem'"),
    ({"problem": "2+2=", "response": "  "}, r"'response' is empty"),
    (
        {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": ""}]},
        r"messages\[1\]\.content is empty",
    ),
    (
        {"problem": "1+1=", "response": "2" * 40},
        r"the sequence has 46 tokens, more than model\.seq_length=32",
    ),
    ("{not json", r"not valid JSON"),
]


@pytest.mark.parametrize(
    ("row", "message"), BAD_SFT, ids=["missing", "empty", "empty-turn", "too-long", "json"]
)
def test_bad_sft_rows_are_named_or_skipped_and_counted(tmp_path, row, message):
    good = {"problem": "3+4=", "response": "7"}
    path = _write(tmp_path / "train.jsonl", [good, row, good])
    cfg = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true")
    with pytest.raises(DataError, match=rf"train\.jsonl: row 2: {message}"):
        build_sft_source(cfg, load_tokenizer(cfg))
    skip = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true", "data.on_bad_row=skip")
    source = build_sft_source(skip, load_tokenizer(skip))
    assert source.skipped_rows == 1
    assert len({e.input_ids for e in source.batch(1, 4)}) == 1  # only the good rows remain


BAD_PAIRS = [
    ({"problem": "2+2=", "chosen": "4"}, r"missing key 'rejected'"),
    ({"problem": "", "chosen": "4", "rejected": "5"}, r"'problem' is empty"),
    ({"problem": "2+2=", "chosen": "4", "rejected": "4"}, r"'chosen' equals 'rejected'"),
    (
        {"problem": "2+2=", "chosen": "4", "rejected": "5" * 40},
        r"'rejected' has \d+ tokens, more than model\.seq_length=32",
    ),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize(("row", "message"), BAD_PAIRS, ids=["missing", "empty", "equal", "too-long"])
def test_bad_pairs_are_named_or_skipped_and_counted(tmp_path, suffix, row, message):
    good = {"problem": "3+4=", "chosen": "7", "rejected": "8"}
    path = _write(tmp_path / f"pairs{suffix}", [good, {**good, "chosen": "07"}, row])
    cfg = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true")
    with pytest.raises(DataError, match=rf"pairs\{suffix}: row 3: {message}"):
        build_preference_source(cfg, load_tokenizer(cfg))
    skip = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true", "data.on_bad_row=skip")
    source = build_preference_source(skip, load_tokenizer(skip))
    assert source.skipped_rows == 1
    pair = next(p for p in source.batch(1, 2) if p.chosen.input_ids[-2] == _ids("7")[0])
    assert pair.chosen.input_ids == (BOS, *_ids("3+4="), *_ids("7"), EOS)
    assert pair.rejected.input_ids == (BOS, *_ids("3+4="), *_ids("8"), EOS)
    assert pair.rejected.loss_mask == (False,) * 5 + (True, True)


def test_pairs_as_message_lists(tmp_path):
    row = {
        "problem": [{"role": "user", "content": "3+4="}],
        "chosen": [{"role": "assistant", "content": "7"}],
        "rejected": [{"role": "assistant", "content": "8"}],
    }
    path = _write(tmp_path / "pairs.jsonl", [row])
    cfg = _cfg(tmp_path, f"data.train_path={path}", "data.apply_chat_template=true")
    (pair,) = build_preference_source(cfg, load_tokenizer(cfg)).batch(1, 1)
    assert pair.chosen.input_ids == (BOS, *_ids("3+4="), *_ids("7"), EOS)


def test_unknown_file_and_format_errors_name_the_file(tmp_path):
    cfg = _cfg(tmp_path, f"data.train_path={tmp_path / 'missing.jsonl'}")
    with pytest.raises(DataError, match=r"missing\.jsonl: dataset file not found"):
        build_sft_source(cfg, load_tokenizer(cfg))
    (tmp_path / "data.csv").write_text("a,b\n")
    cfg = _cfg(tmp_path, f"data.train_path={tmp_path / 'data.csv'}")
    with pytest.raises(DataError, match=r"data\.csv: unsupported dataset format"):
        build_sft_source(cfg, load_tokenizer(cfg))


def test_tokenizer_without_chat_template_is_a_config_error_before_any_rank(tmp_path):
    from hf_models import make_tiny_hf

    from megagrpo.trainers.sft import run_sft

    hf = make_tiny_hf("qwen2", tmp_path / "model")
    char_tokenizer(chat_template=None).save_pretrained(str(hf))
    path = _write(tmp_path / "train.jsonl", GOOD_SFT)
    cfg = load_config(
        None,
        [
            "model.tiny=null",
            f"model.hf_dir={hf}",
            "model.seq_length=64",
            f"data.train_path={path}",
            "data.apply_chat_template=true",
            f"logging.dir={tmp_path / 'runs'}",
            f"checkpoint.dir={tmp_path / 'runs' / 'checkpoints'}",  # not the demo's, which `make demo` fills
        ],
        trainer="sft",
    )
    with pytest.raises(ConfigError, match=r"data\.apply_chat_template.*has no chat template"):
        run_sft(cfg)
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written
