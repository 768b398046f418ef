"""What the trainer-only jobs (SFT, DPO, the warm-up) share: resuming on every rank of an SPMD group, and
greedy exact-match accuracy on the synthetic task's held-out problems."""

from __future__ import annotations

from collections.abc import Callable

from megagrpo.ckpt import run as ckpt_io
from megagrpo.config import Config
from megagrpo.data.supervised import prompt_ids
from megagrpo.rewards.arithmetic import arithmetic_reward
from megagrpo.runtime.spmd import RankCalls
from megagrpo.trainers.checkpoints import verified_resume_point


def restore_checkpoint(cfg: Config, group: RankCalls, load: Callable) -> int:
    """The last completed step: from the newest checkpoint that verifies when ``checkpoint.resume``
    (the controller verifies, every rank loads what it chose), else 0."""
    if not cfg.checkpoint.resume:
        return 0
    chosen = group.from_controller(lambda: verified_resume_point(cfg))
    if chosen is None:
        return 0
    group.call_all(load, str(chosen))
    state = ckpt_io.load_driver_state(chosen)
    if group.is_controller:
        print(f"resume: continuing after step {state.step} from {chosen}", flush=True)
    return state.step


def greedy_accuracy(group: RankCalls, complete: Callable, tok, problems, cfg: Config) -> float:
    """Exact-match accuracy of greedy answers to the synthetic problems (``complete``: a worker method)."""
    prompts = [prompt_ids(tok, p.prompt, chat_template=cfg.data.apply_chat_template) for p in problems]
    answers = group.call_first(complete, prompts, max(len(p.answer) for p in problems) + 1)
    texts = [decode_answer(tok, ids) for ids in answers]
    return sum(arithmetic_reward(t, p.answer) for t, p in zip(texts, problems, strict=True)) / len(problems)


def decode_answer(tok, ids: list[int]) -> str:
    """Text of generated ids up to the first EOS; ids outside the tokenizer's vocabulary are dropped."""
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    return tok.decode([i for i in ids if i < len(tok)], skip_special_tokens=True)
