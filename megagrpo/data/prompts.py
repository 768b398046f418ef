"""Prompt sources for GRPO: the embedded arithmetic task, or JSONL datasets with a tokenizer.

A source hands out token-id prompts with their reference answers, deterministically by position
(``batch(position, n)``), so a resumed run continues with exactly the prompts it would have seen.
Datasets are read and validated up front (file, row and key named in errors) before any worker
starts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config
from megagrpo.data.arithmetic import EOS_ID, ArithmeticTask, CharTokenizer, Problem

# The arithmetic validation stream is seeded far from the training one: no overlap by construction.
_VAL_SEED = 7_919_011


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    answer: str
    """Reference answer handed to the reward function."""


class DataError(ValueError):
    """A dataset file is missing or malformed; the message names the file, row and key."""


class PromptSource:
    """Training prompts by stream position, fixed validation prompts, and text decoding."""

    def __init__(
        self, train: list[Prompt] | None, val: list[Prompt], *, decode, stop_token_ids, seed: int, task=None
    ):
        self._train, self.val, self.decode, self.stop_token_ids = train, val, decode, tuple(stop_token_ids)
        self._seed, self._task = seed, task

    def batch(self, position: int, count: int) -> list[Prompt]:
        """Prompts ``position`` .. ``position + count - 1`` of the (endless, reshuffled per epoch) stream."""
        return [self._at(position + i) for i in range(count)]

    def _at(self, index: int) -> Prompt:
        if self._task is not None:
            tok, (prob,) = CharTokenizer(), self._task.problems(1, seed=self._seed * 1_000_003 + index)
            return Prompt(tok.encode(prob.prompt, bos=True), prob.answer)
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(self._seed * 7_777 + epoch).shuffle(order)
        return self._train[order[offset]]


def arithmetic_val_problems(cfg: Config) -> list[Problem]:
    """The held-out problems GRPO validates on (``data.num_val_prompts``; DPO's greedy accuracy too)."""
    data = cfg.data
    task = ArithmeticTask(max_operand=data.arithmetic_max_operand, ops=data.arithmetic_ops)
    return task.problems(data.num_val_prompts, _VAL_SEED)


def arithmetic_source(cfg: Config) -> PromptSource:
    data = cfg.data
    task = ArithmeticTask(max_operand=data.arithmetic_max_operand, ops=data.arithmetic_ops)
    tok = CharTokenizer()
    if tok.vocab_size > (cfg.model.tiny.vocab_size if cfg.model.tiny else 1 << 30):
        raise DataError(f"model.tiny.vocab_size is smaller than the arithmetic vocabulary ({tok.vocab_size})")
    val = [Prompt(tok.encode(p.prompt, bos=True), p.answer) for p in arithmetic_val_problems(cfg)]
    return PromptSource(None, val, decode=tok.decode, stop_token_ids=[EOS_ID], seed=cfg.grpo.seed, task=task)


def _read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(
            f"{path}: unsupported dataset format {path.suffix!r} (use JSONL: one JSON object per line)"
        )
    rows = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise DataError(f"{path}:{lineno}: missing key {key!r} (keys: {sorted(row)})")
            rows.append((str(row[prompt_key]), str(row[answer_key])))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def dataset_source(cfg: Config, tokenizer, train_rows, val_rows) -> PromptSource:
    """JSONL prompts rendered with ``data.template`` (and the chat template), tokenized once."""
    data = cfg.data

    def encode(rows: list[tuple[str, str]]) -> list[Prompt]:
        out = []
        for text, answer in rows:
            content = data.template.replace("{prompt}", text)
            if data.apply_chat_template:
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
                )
            else:
                ids = tokenizer.encode(content)
            out.append(Prompt(list(ids), answer))
        return out

    train = encode(train_rows)
    val = encode(val_rows)[: data.num_val_prompts] if data.num_val_prompts else []
    too_long = [
        i
        for i, p in enumerate(train)
        if len(p.token_ids) + cfg.generation.max_new_tokens > cfg.model.seq_length
    ]
    if too_long:
        raise DataError(
            f"{data.train_path}: row {too_long[0] + 1} (and {len(too_long) - 1} more) is too long for "
            f"model.seq_length={cfg.model.seq_length} with "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}"
        )
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return PromptSource(
        train,
        val,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        stop_token_ids=stops,
        seed=cfg.grpo.seed,
    )


def build_source(cfg: Config) -> PromptSource:
    if cfg.data.train_path is None:
        return arithmetic_source(cfg)
    from transformers import AutoTokenizer

    data = cfg.data
    train_rows = _read_jsonl(Path(data.train_path), data.prompt_key, data.answer_key)
    val_rows = _read_jsonl(Path(data.val_path), data.prompt_key, data.answer_key) if data.val_path else []
    if cfg.model.hf_dir is None:
        raise DataError("data.train_path needs a tokenizer: set model.hf_dir")
    return dataset_source(cfg, AutoTokenizer.from_pretrained(cfg.model.hf_dir), train_rows, val_rows)
