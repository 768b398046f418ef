"""SFT examples and DPO pairs: records rendered into token ids with a mask of the tokens that are trained.

An SFT record is a conversation (``data.messages_key``: a list of ``{role, content}``) or a prompt and a
response (``data.prompt_key``, ``data.response_key``). A DPO record is a prompt and two responses
(``data.chosen_key``, ``data.rejected_key``); each is a string or a list of messages. With
``data.apply_chat_template`` the tokenizer's chat template renders them and only assistant tokens are
trained (scored, for DPO: only the response after the prompt); otherwise the prompt is encoded as plain
text (with the tokenizer's special tokens) followed by the response and EOS.

The assistant mask comes from transformers (``return_assistant_tokens_mask``) when the template marks
assistant turns with ``{% generation %}``; most published templates do not, and then each assistant turn is
found by rendering the conversation up to it (with the generation prompt) and up to its end: the turn is the
tokens in between. Both give the same mask (tested); a template whose renderings are not prefixes of each
other is reported instead of guessed.

Sources hand out examples by step, deterministically, so a resumed run sees what it would have seen:
a dataset as an endless stream reshuffled every epoch, the synthetic task as problems seeded by step.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megagrpo.config import Config
from megagrpo.data.arithmetic import ArithmeticTask, Problem
from megagrpo.data.errors import DataError
from megagrpo.data.fields import chars_per_token, check_messages, string_field, text_chars
from megagrpo.data.records import BadRows, read_records

__all__ = [
    "Example",
    "Pair",
    "PreferenceSource",
    "SFTSource",
    "build_preference_source",
    "build_sft_source",
    "prompt_ids",
    "render_conversation",
    "render_response",
]

# Held-out synthetic problems come from a seed stream far from the training one (no overlap by construction).
VAL_SEED_OFFSET = 1_000_003
_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Example:
    """One tokenized sequence and which of its tokens are trained (or scored)."""

    input_ids: tuple[int, ...]
    """[N] token ids."""
    loss_mask: tuple[bool, ...]
    """[N] True for an assistant (response) token: position t - 1 is trained to predict it."""


@dataclass(frozen=True)
class Pair:
    """A preference pair: the same prompt with the chosen and the rejected response."""

    chosen: Example
    rejected: Example


# ------------------------------------------------------------------------------------------- rendering


def _chat_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def render_conversation(tok, messages: list[dict], *, chat_template: bool) -> Example:
    """A conversation's ids with its assistant-token mask (ValueError when the template cannot be split)."""
    if not chat_template:
        raise ValueError("a messages conversation needs data.apply_chat_template=true")
    if _GENERATION_MARK.search(tok.chat_template or ""):
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return Example(tuple(out["input_ids"]), tuple(bool(m) for m in out["assistant_masks"]))
    ids = _chat_ids(tok, messages)
    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _chat_ids(tok, messages[:i], add_generation_prompt=True) if i else []
        through = _chat_ids(tok, messages[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(
                "the chat template does not render the conversation up to an assistant turn as a prefix "
                "of the whole; mark assistant turns with {% generation %} in the template"
            )
        mask[len(before) : len(through)] = [True] * (len(through) - len(before))
    return Example(tuple(ids), tuple(mask))


def prompt_ids(tok, prompt: str | list[dict], *, chat_template: bool) -> list[int]:
    """The ids a completion of ``prompt`` starts from (with the chat template's generation prompt)."""
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return _chat_ids(tok, messages, add_generation_prompt=True)
    return list(tok.encode(prompt))


def render_response(
    tok, prompt: str | list[dict], response: str | list[dict], *, chat_template: bool
) -> Example:
    """Prompt + response ids with the response tokens masked in (the prompt's own turns are not)."""
    if chat_template:
        prompt_msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        reply = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
        head = prompt_ids(tok, prompt_msgs, chat_template=True)
        ids = _chat_ids(tok, prompt_msgs + reply)
        if ids[: len(head)] != head:
            raise ValueError(
                "the chat template does not render the prompt (with the generation prompt) as a prefix "
                "of the prompt and response"
            )
        return Example(tuple(ids), tuple(i >= len(head) for i in range(len(ids))))
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ValueError("message lists need data.apply_chat_template=true")
    head = list(tok.encode(prompt))
    tail = [*tok.encode(response, add_special_tokens=False), tok.eos_token_id]
    return Example(tuple(head + tail), tuple([False] * len(head) + [True] * len(tail)))


# ------------------------------------------------------------------------------------ record checks


def _text(record: dict, key: str, limit: int) -> str | list[dict]:
    """A string or message-list field; ValueError naming the key when missing, empty, malformed or longer
    than ``limit`` characters (checked before anything is tokenized)."""
    if key not in record or record[key] is None:
        raise ValueError(f"missing key {key!r} (keys: {sorted(record)})")
    value = record[key]
    tokens = "that model.seq_length tokens can hold with this tokenizer (not tokenized)"
    if isinstance(value, str):
        return string_field(record, key, limit=limit, tokens=tokens)
    if isinstance(value, list):
        check_messages(value, key, limit=limit, tokens=tokens)
        return value
    raise ValueError(f"{key!r} must be a string or a list of messages, got {type(value).__name__}")


def _char_limit(tok, cfg: Config, *texts) -> int:
    """The most characters a record's texts can have and still fit model.seq_length tokens; ValueError
    when ``texts`` (already read) together have more."""
    limit = cfg.model.seq_length * chars_per_token(tok)
    total = sum(text_chars(t) for t in texts)
    if total > limit:
        raise ValueError(
            f"the texts have {total:,} characters, more than the {limit:,} that model.seq_length="
            f"{cfg.model.seq_length} tokens can hold with this tokenizer (not tokenized)"
        )
    return limit


def sft_example(tok, record: dict, cfg: Config) -> Example:
    """The example of one SFT record (ValueError: why the row is bad)."""
    data, limit = cfg.data, _char_limit(tok, cfg)
    if data.messages_key in record:
        messages = _text(record, data.messages_key, limit)
        if isinstance(messages, str) or not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{data.messages_key!r} must be a list of messages with an assistant turn")
        example = render_conversation(tok, messages, chat_template=data.apply_chat_template)
    else:
        prompt, response = _text(record, data.prompt_key, limit), _text(record, data.response_key, limit)
        _char_limit(tok, cfg, prompt, response)
        example = render_response(tok, prompt, response, chat_template=data.apply_chat_template)
    _check_length(example, cfg)
    if not any(example.loss_mask[1:]):
        raise ValueError("no assistant token to train on")
    return example


def preference_pair(tok, record: dict, cfg: Config) -> Pair:
    """The pair of one DPO record (ValueError: why the row is bad)."""
    data, limit = cfg.data, _char_limit(tok, cfg)
    prompt = _text(record, data.prompt_key, limit)
    chosen, rejected = _text(record, data.chosen_key, limit), _text(record, data.rejected_key, limit)
    _char_limit(tok, cfg, prompt, chosen)
    _char_limit(tok, cfg, prompt, rejected)
    if chosen == rejected:
        raise ValueError(f"{data.chosen_key!r} equals {data.rejected_key!r}")
    pair = Pair(
        render_response(tok, prompt, chosen, chat_template=data.apply_chat_template),
        render_response(tok, prompt, rejected, chat_template=data.apply_chat_template),
    )
    if pair.chosen.input_ids == pair.rejected.input_ids:
        raise ValueError(f"{data.chosen_key!r} and {data.rejected_key!r} give the same tokens")
    _check_length(pair.chosen, cfg, repr(data.chosen_key))
    _check_length(pair.rejected, cfg, repr(data.rejected_key))
    return pair


def _check_length(example: Example, cfg: Config, what: str = "the sequence") -> None:
    if len(example.input_ids) > cfg.model.seq_length:
        raise ValueError(
            f"{what} has {len(example.input_ids)} tokens, more than model.seq_length={cfg.model.seq_length}"
        )


def _read(path: str, tok, cfg: Config, make, bad: BadRows, limit: int | None = None) -> list:
    out = []
    for row, record in read_records(path, bad):
        if limit is not None and len(out) >= limit:
            break
        try:
            out.append(make(tok, record, cfg))
        except ValueError as err:
            bad.bad(path, row, str(err))
        except Exception as err:
            if type(err) is not Exception:
                raise
            # The tokenizers library's errors are plain Exceptions (e.g. a character outside a vocabulary
            # without an unknown token, as the tiny model's): the row's text, not a bug of ours.
            bad.bad(path, row, f"cannot be tokenized: {err}")
    if not out:
        raise DataError(f"{path}: no usable rows" + (f" ({bad.skipped} skipped)" if bad.skipped else ""))
    return out


# ------------------------------------------------------------------------------------------- sources


class _Stream:
    """Items by position of an endless stream, reshuffled every epoch (deterministic per seed)."""

    def __init__(self, items: Sequence, seed: int):
        self.items, self.seed = list(items), seed

    def take(self, position: int, count: int) -> list:
        out = []
        for index in range(position, position + count):
            epoch, offset = divmod(index, len(self.items))
            order = list(range(len(self.items)))
            random.Random(self.seed * 7_777 + epoch).shuffle(order)
            out.append(self.items[order[offset]])
        return out


class SFTSource:
    """Training examples by step, validation examples, and (synthetic task) held-out problems to score."""

    def __init__(self, cfg: Config, tok, *, train=None, val=(), task=None, skipped: int = 0):
        self.cfg, self.tok, self.task = cfg, tok, task
        self.val: list[Example] = list(val)
        self.skipped_rows = skipped
        self._stream = _Stream(train, cfg.sft.seed) if train is not None else None
        self._cache: dict[Problem, Example] = {}
        self.val_problems: list[Problem] = []
        if task is not None:
            self.val_problems = task.problems(cfg.sft.num_val_examples, seed=cfg.sft.seed + VAL_SEED_OFFSET)
            self.val = [self.problem_example(p) for p in self.val_problems]

    def batch(self, step: int, size: int) -> list[Example]:
        """The ``size`` examples of optimizer step ``step`` (1-based)."""
        if self.task is not None:
            problems = self.task.problems(size, seed=self.cfg.sft.seed * 1_000_000 + step)
            return [self.problem_example(p) for p in problems]
        return self._stream.take((step - 1) * size, size)

    def problem_example(self, problem: Problem) -> Example:
        """A synthetic problem as a user turn and its answer as the assistant turn (rendered once)."""
        if problem not in self._cache:
            record = {
                self.cfg.data.messages_key: [
                    {"role": "user", "content": problem.prompt},
                    {"role": "assistant", "content": problem.answer},
                ]
            }
            data = self.cfg.data
            if not data.apply_chat_template:
                record = {data.prompt_key: problem.prompt, data.response_key: problem.answer}
            try:
                example = sft_example(self.tok, record, self.cfg)
            except ValueError as err:
                raise DataError(f"synthetic problem {problem.prompt}{problem.answer}: {err}") from err
            # One shape for every step: rows padded to the task's longest (BOS, "a op b =", the widest
            # answer, EOS) + 1, untrained; the shapes the warm-up has always trained with.
            digits = len(str(self.task.max_operand))
            width = max(len(example.input_ids), 1 + 2 * digits + 2 + 2 * digits + 1 + 1)
            if width > self.cfg.model.seq_length:
                raise DataError(
                    f"synthetic problems need {width} tokens, more than "
                    f"model.seq_length={self.cfg.model.seq_length}"
                )
            pad = width - len(example.input_ids)
            self._cache[problem] = Example(
                example.input_ids + (self.tok.pad_token_id,) * pad, example.loss_mask + (False,) * pad
            )
        return self._cache[problem]


def build_sft_source(cfg: Config, tok) -> SFTSource:
    """Read and check the SFT data before any worker starts (DataError names file and row)."""
    data = cfg.data
    if data.train_path is None and data.synthetic_task == "math":
        return _math_sft_source(cfg, tok)
    if data.train_path is None and data.synthetic_task == "agent":
        return _agent_sft_source(cfg, tok)
    if data.train_path is None:
        task = ArithmeticTask(max_operand=data.arithmetic_max_operand, ops=data.arithmetic_ops)
        return SFTSource(cfg, tok, task=task)
    bad = BadRows(data.on_bad_row)
    train = _read(data.train_path, tok, cfg, sft_example, bad)
    val = []
    if data.val_path and cfg.sft.num_val_examples:
        val = _read(data.val_path, tok, cfg, sft_example, bad, limit=cfg.sft.num_val_examples)
    return SFTSource(cfg, tok, train=train, val=val, skipped=bad.skipped)


def _math_sft_source(cfg: Config, tok) -> SFTSource:
    """Generated math problems (``data.template`` around each) with their worked solutions: as many
    training records as the run's steps consume (at most 20,000, then reshuffled per epoch), and
    ``sft.num_val_examples`` held-out ones from a seed stream far away."""
    from megagrpo.data.math_problems import math_records

    data = cfg.data

    def examples(records: list[dict], what: str) -> list[Example]:
        out = []
        for i, r in enumerate(records, 1):
            record = {
                data.prompt_key: data.template.replace("{prompt}", r["problem"]),
                data.response_key: r["solution"],
            }
            try:
                out.append(sft_example(tok, record, cfg))
            except ValueError as err:
                raise DataError(f"generated math {what} record {i}: {err}") from err
        return out

    count = min(cfg.sft.num_steps * cfg.sft.batch_size, 20_000)
    styles = {"terse_frac": data.math_terse_frac, "unboxed_frac": data.math_unboxed_frac}
    train = examples(math_records(count, cfg.sft.seed, **styles), "training")
    val = examples(math_records(cfg.sft.num_val_examples, cfg.sft.seed + VAL_SEED_OFFSET), "validation")
    return SFTSource(cfg, tok, train=train, val=val)


def _agent_sft_source(cfg: Config, tok) -> SFTSource:
    """Generated tool-use conversations (``data.agent_tool_frac`` of them call the python tool): as many
    as the run's steps consume (at most 20,000), and ``sft.num_val_examples`` held-out ones."""
    from megagrpo.envs.code_tool import tool_use_records

    def examples(records: list[dict], what: str) -> list[Example]:
        out = []
        for i, record in enumerate(records, 1):
            try:
                out.append(sft_example(tok, {cfg.data.messages_key: record["messages"]}, cfg))
            except ValueError as err:
                raise DataError(f"generated tool-use {what} record {i}: {err}") from err
        return out

    frac, count = cfg.data.agent_tool_frac, min(cfg.sft.num_steps * cfg.sft.batch_size, 20_000)
    train = examples(tool_use_records(count, cfg.sft.seed, frac), "training")
    val = examples(
        tool_use_records(cfg.sft.num_val_examples, cfg.sft.seed + VAL_SEED_OFFSET, frac), "validation"
    )
    return SFTSource(cfg, tok, train=train, val=val)


class PreferenceSource:
    """Training pairs by step and validation pairs."""

    def __init__(self, cfg: Config, train: list[Pair], val: list[Pair], skipped: int = 0):
        self.val, self.skipped_rows = val, skipped
        self._stream = _Stream(train, cfg.dpo.seed)

    def batch(self, step: int, size: int) -> list[Pair]:
        return self._stream.take((step - 1) * size, size)


def build_preference_source(cfg: Config, tok, train_path: str | None = None) -> PreferenceSource:
    """Read and check the DPO pairs (``train_path`` defaults to data.train_path)."""
    data = cfg.data
    bad = BadRows(data.on_bad_row)
    train = _read(train_path or data.train_path, tok, cfg, preference_pair, bad)
    val = []
    if data.val_path and cfg.dpo.num_val_pairs:
        val = _read(data.val_path, tok, cfg, preference_pair, bad, limit=cfg.dpo.num_val_pairs)
    return PreferenceSource(cfg, train, val, skipped=bad.skipped)


def write_records(path: Path, records: list[dict]) -> None:
    """Records as JSONL, atomically (the synthetic DPO pairs a run generates)."""
    from megagrpo.ckpt.durable import atomic_write

    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))
