"""Prompt sources for GRPO and ``megagrpo eval``: the embedded arithmetic task, or datasets (JSONL, JSON
arrays, Parquet; ``megagrpo.data.records``) with a tokenizer.

A source hands out token-id prompts with their reference answers, deterministically by position
(``batch(position, n)``), so a resumed run continues with exactly the prompts it would have seen.
Datasets are read and validated up front (file, row and key named in errors) before any worker
starts: a bad row stops the run or is skipped and counted (``data.on_bad_row``); a prompt too long
for the stage's context (``model.seq_length`` less the response budget) is skipped and counted.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config
from megagrpo.data.arithmetic import EOS_ID, ArithmeticTask, CharTokenizer, Problem
from megagrpo.data.errors import DataError
from megagrpo.data.fields import chars_per_token, string_field
from megagrpo.data.records import BadRows, read_records

# The arithmetic validation stream is seeded far from the training one: no overlap by construction.
_VAL_SEED = 7_919_011


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    answer: str
    """Reference answer handed to the reward function."""
    task: dict | None = None
    """Multi-turn episodes: the task an environment opens the episode from (a dataset row, or one the
    environment generated); its token_ids are then [] (the engine renders the environment's opening)."""


class PromptSource:
    """Training prompts by stream position, fixed validation prompts, and text decoding."""

    def __init__(
        self,
        train: list[Prompt] | None,
        val: list[Prompt],
        *,
        decode,
        stop_token_ids,
        seed: int,
        task=None,
        generate=None,
    ):
        """``train``: a dataset's prompts (reshuffled per epoch), or None for a generated stream: the
        arithmetic ``task``'s problems, or ``generate(index) -> Prompt``."""
        self._train, self.val, self.decode, self.stop_token_ids = train, val, decode, tuple(stop_token_ids)
        self._seed, self._task, self._generate = seed, task, generate
        self.counts: dict[str, int] = {}
        """Data metrics logged every step (rows skipped, prompts too long); empty for the synthetic task."""

    def batch(self, position: int, count: int) -> list[Prompt]:
        """Prompts ``position`` .. ``position + count - 1`` of the (endless, reshuffled per epoch) stream."""
        return [self._at(position + i) for i in range(count)]

    def _at(self, index: int) -> Prompt:
        if self._generate is not None:
            return self._generate(index)
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


def read_prompt_rows(cfg: Config, path: str | Path, bad, tokenizer=None, max_tokens: int = 0) -> list:
    """(row number, question, reference answer) of every usable row of a JSONL, JSON or Parquet file
    (``megagrpo.data.records``); the fields are ``data.prompt_key`` (a string) and ``data.answer_key`` (a
    string or a number). A row without them, with an empty one or one of another type, or (with a
    ``tokenizer``) a question longer in characters than ``max_tokens`` of it can hold
    (:func:`megagrpo.data.fields.chars_per_token`: checked before anything is tokenized) goes to ``bad``
    (``data.on_bad_row``: stop naming file and row, or skip and count)."""
    data, rows = cfg.data, []
    limit = max_tokens * chars_per_token(tokenizer) if tokenizer is not None else None
    budget = (
        f"that the {max_tokens} prompt tokens (model.seq_length less the new tokens) can hold with this "
        "tokenizer (not tokenized)"
    )
    for row, record in read_records(path, bad):
        try:
            text = string_field(record, data.prompt_key, limit=limit, tokens=budget)
            answer = _answer(record, data.answer_key)
        except ValueError as err:
            bad.bad(path, row, str(err))
            continue
        rows.append((row, text, answer))
    if not rows:
        raise DataError(f"{path}: no usable rows" + (f" ({bad.skipped} skipped)" if bad.skipped else ""))
    return rows


def _answer(record: dict, key: str) -> str:
    """The reference answer as the reward receives it: a string, or a number written as one."""
    value = record.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return string_field(record, key, limit=_MAX_ANSWER_CHARS, tokens="a reference answer may have")


_MAX_ANSWER_CHARS = 1 << 20
"""A reference answer is compared, not tokenized: this only keeps a runaway row out of memory."""


def encode_prompt(cfg: Config, tokenizer, text: str) -> list[int]:
    """``data.template`` around ``text``, in the chat template as one user turn when
    ``data.apply_chat_template``, as token ids."""
    content = cfg.data.template.replace("{prompt}", text)
    if cfg.data.apply_chat_template:
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(out["input_ids"])
    return list(tokenizer.encode(content))


def encode_prompts(cfg: Config, tokenizer, path, rows, max_new_tokens: int) -> tuple[list[Prompt], int]:
    """(prompts, how many were left out): a prompt whose ids leave fewer than ``max_new_tokens`` of
    ``model.seq_length`` for the response is skipped and counted (the stage's context is too short for it),
    not fatal; a file with none that fits is a DataError."""
    prompts, too_long = [], 0
    for _row, text, answer in rows:
        ids = encode_prompt(cfg, tokenizer, text)
        if len(ids) + max_new_tokens > cfg.model.seq_length:
            too_long += 1
            continue
        prompts.append(Prompt(ids, answer))
    if not prompts:
        raise DataError(
            f"{path}: all {too_long} prompts are too long for model.seq_length={cfg.model.seq_length} with "
            f"{max_new_tokens} new tokens"
        )
    return prompts, too_long


def dataset_source(cfg: Config, tokenizer) -> PromptSource:
    """Prompts of ``data.train_path`` (and ``data.val_path``) rendered with ``data.template`` (and the chat
    template), tokenized once; bad rows and over-long prompts are counted in ``source.counts``."""
    data, new = cfg.data, cfg.generation.max_new_tokens
    bad = BadRows(data.on_bad_row)
    budget = cfg.model.seq_length - new
    train, long_train = encode_prompts(
        cfg, tokenizer, data.train_path, read_prompt_rows(cfg, data.train_path, bad, tokenizer, budget), new
    )
    val, long_val = [], 0
    if data.val_path and data.num_val_prompts:
        val, long_val = encode_prompts(
            cfg, tokenizer, data.val_path, read_prompt_rows(cfg, data.val_path, bad, tokenizer, budget), new
        )
        val = val[: data.num_val_prompts]
    source = PromptSource(
        train, val, decode=_decoder(tokenizer), stop_token_ids=_stops(tokenizer), seed=cfg.grpo.seed
    )
    source.counts = {
        "data/skipped_rows": bad.skipped,
        "data/skipped_long_prompts": long_train,
        "data/skipped_long_val_prompts": long_val,
    }
    for example in bad.examples:
        print(f"data: skipped {example}", flush=True)
    if long_train or long_val:
        print(
            f"data: skipped {long_train} training and {long_val} validation prompt(s) too long for "
            f"model.seq_length={cfg.model.seq_length} with generation.max_new_tokens={new}",
            flush=True,
        )
    return source


def _decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _stops(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def eval_prompts(cfg: Config, model_dir: str) -> tuple[list[Prompt], object, tuple[int, ...]]:
    """(prompts, decode, stop token ids) of ``megagrpo eval``: the problems of ``eval.path`` (default
    ``data.val_path``; the first ``eval.num_problems`` of them when set) in the tokenizer of
    ``model_dir``; over-long prompts are skipped and reported."""
    from transformers import AutoTokenizer

    path = cfg.eval.path or cfg.data.val_path
    if cfg.env.enabled:
        return _eval_tasks(cfg, path), _decoder(AutoTokenizer.from_pretrained(model_dir)), ()
    if path is None:
        raise DataError("megagrpo eval needs problems: set eval.path or data.val_path")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    new = cfg.eval.max_new_tokens or cfg.generation.max_new_tokens
    rows = read_prompt_rows(cfg, path, BadRows(cfg.data.on_bad_row), tokenizer, cfg.model.seq_length - new)
    if cfg.eval.num_problems:
        rows = rows[: cfg.eval.num_problems]
    prompts, too_long = encode_prompts(cfg, tokenizer, path, rows, new)
    if too_long:
        print(f"eval: skipped {too_long} problem(s) too long for model.seq_length={cfg.model.seq_length}")
    return prompts, _decoder(tokenizer), tuple(_stops(tokenizer))


def task_source(cfg: Config) -> PromptSource:
    """Multi-turn episodes' tasks (``env.*``): every row of ``data.train_path`` (``data.val_path``) as a
    task dict, or, without a dataset, the environment's own generated tasks (``Environment.tasks``,
    validation from a seed far from the training stream's). Rows are read and checked here, before any
    worker starts."""
    from megagrpo.envs.runner import load_environment

    data, env = cfg.data, cfg.env
    try:  # imported in a child at load already (megagrpo.rewards.user): this is the second import
        cls = load_environment(env.spec)
    except ValueError as err:
        raise DataError(f"env.environment: {err}") from None

    def prompt(task: dict) -> Prompt:
        return Prompt([], str(task.get(data.answer_key, "")), dict(task))

    def generated(count: int, seed: int) -> list[dict]:
        try:
            return cls.tasks(count, seed, **env.args)
        except NotImplementedError as err:
            raise DataError(f"env.environment {env.environment}: {err}") from None

    bad = BadRows(data.on_bad_row)

    def rows(path) -> list[Prompt]:
        if not Path(path).is_file():
            raise DataError(f"{path}: dataset file not found")
        out = [prompt(record) for _row, record in read_records(path, bad)]
        if not out:
            raise DataError(f"{path}: no usable rows")
        return out

    val: list[Prompt] = []
    if data.num_val_prompts:
        if data.val_path:
            val = rows(data.val_path)[: data.num_val_prompts]
        elif data.train_path is None:
            val = [prompt(t) for t in generated(data.num_val_prompts, _VAL_SEED)]
    if data.train_path is not None:
        source = PromptSource(rows(data.train_path), val, decode=str, stop_token_ids=(), seed=cfg.grpo.seed)
    else:
        generated(1, cfg.grpo.seed)  # an environment without generated tasks fails here, not mid-run
        seed = cfg.grpo.seed * 1_000_003

        def at(index: int) -> Prompt:
            return prompt(generated(1, seed + index)[0])

        source = PromptSource(None, val, decode=str, stop_token_ids=(), seed=cfg.grpo.seed, generate=at)
    source.counts = {"data/skipped_rows": bad.skipped} if data.train_path is not None else {}
    return source


def _eval_tasks(cfg: Config, path) -> list[Prompt]:
    """``megagrpo eval`` of multi-turn episodes: the tasks of ``path`` (eval.path or data.val_path), or
    the environment's validation tasks (``eval.num_problems`` of them, else ``data.num_val_prompts``)."""
    count = cfg.eval.num_problems or cfg.data.num_val_prompts
    if path is None and not count:
        raise DataError(
            "megagrpo eval of episodes needs tasks: set eval.path, or eval.num_problems for generated ones"
        )
    data = dataclasses.replace(cfg.data, val_path=path, num_val_prompts=count or 1 << 30)
    tasks = task_source(dataclasses.replace(cfg, data=data)).val
    return tasks[: cfg.eval.num_problems] if cfg.eval.num_problems else tasks


def build_source(cfg: Config) -> PromptSource:
    if cfg.env.enabled:
        return task_source(cfg)
    if cfg.data.train_path is None and cfg.data.synthetic_task == "math":
        raise DataError(
            "data.synthetic_task 'math' generates SFT data only; GRPO reads its prompts from data.train_path "
            "(write a file of generated problems with megagrpo.data.math_problems)"
        )
    if cfg.data.train_path is None:
        return arithmetic_source(cfg)
    from transformers import AutoTokenizer

    if cfg.model.hf_dir is None:
        raise DataError("data.train_path needs a tokenizer: set model.hf_dir (or model.init_from)")
    for path in (cfg.data.train_path, cfg.data.val_path if cfg.data.num_val_prompts else None):
        if path is not None and not Path(path).is_file():  # the cheap check first: before the tokenizer
            raise DataError(f"{path}: dataset file not found")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    except (OSError, ValueError) as err:
        raise DataError(f"model.hf_dir {cfg.model.hf_dir}: no tokenizer could be loaded ({err})") from err
    return dataset_source(cfg, tokenizer)
