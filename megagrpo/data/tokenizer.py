"""The tokenizer of a job: the HF tokenizer of ``model.hf_dir``, or, for a tiny model, one built in memory
with the ``tokenizers`` library as a real HF tokenizer with a chat template, so SFT and DPO run the same
chat-template code on both: the arithmetic task's character vocabulary, or (``data.synthetic_task: math``)
a byte-level BPE trained on generated math problems and solutions (:func:`math_bpe_tokenizer`).

The character tokenizer gives the ids of :class:`megagrpo.data.arithmetic.CharTokenizer` (PAD 0, BOS 1, EOS 2,
then one id per character); ``encode`` prepends BOS, as the arithmetic prompts have it. Its chat template
renders a conversation as ``<s>`` + each turn's text, an assistant turn followed by ``</s>``, and marks the
assistant turns with ``{% generation %}`` so transformers returns their token mask.
"""

from __future__ import annotations

from pathlib import Path

from megagrpo.config import Config, ConfigError
from megagrpo.config.errors import require
from megagrpo.data.arithmetic import _CHARS, _FIRST_CHAR_ID, BOS_ID, EOS_ID, PAD_ID
from megagrpo.envs.chat import QWEN2_SPLIT

CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
"""Every turn's text after one BOS; assistant turns end with EOS and are marked for the assistant mask."""


def char_tokenizer(chat_template: str | None = CHAR_CHAT_TEMPLATE):
    """The arithmetic vocabulary as a ``PreTrainedTokenizerFast`` (``save_pretrained`` writes a normal
    tokenizer directory)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab = {**specials, **{ch: _FIRST_CHAR_ID + i for i, ch in enumerate(_CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML as Qwen2's instruct models render it (without their default system turn): every turn is
``<|im_start|>role\\n`` + text + ``<|im_end|>\\n``; the generation prompt opens an assistant turn."""

MATH_CORPUS_SEED = 104_729
"""Seed of the generated records the math tokenizer is trained on (fixed: one tokenizer per vocab size)."""


def math_bpe_tokenizer(vocab_size: int, template: str = "{prompt}", num_records: int = 4000):
    """A byte-level BPE of ``vocab_size`` tokens (ChatML specials included) trained with ``tokenizers`` on
    ``num_records`` generated math problems (rendered with ``template``) and their worked solutions, as a
    ``PreTrainedTokenizerFast`` with Qwen2's ChatML template; EOS ``<|im_end|>``, PAD ``<|endoftext|>``.
    Deterministic: the same arguments give the same vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megagrpo.data.math_problems import math_records

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Qwen2's split (single digits: numbers are spelt digit by digit), then byte-level.
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    records = math_records(num_records, MATH_CORPUS_SEED)
    # The role names of the chat template are text too: "user\n" and "assistant\n" get tokens of their own.
    corpus = ["user\nassistant\n"] * 100 + [
        template.replace("{prompt}", r["problem"]) + "\n" + r["solution"] for r in records
    ]
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(cfg: Config):
    """The job's tokenizer; a chat template is required when ``data.apply_chat_template`` is set.

    Raises ConfigError (before any worker starts) when the template is missing.
    """
    if cfg.model.tiny is not None and cfg.data.synthetic_task == "math":
        tok = math_bpe_tokenizer(cfg.model.tiny.vocab_size, cfg.data.template)
        where = "the built-in math BPE tokenizer"
    elif cfg.model.tiny is not None and cfg.data.synthetic_task == "agent":
        from megagrpo.envs.chat import tool_chat_tokenizer

        tok, where = (
            tool_chat_tokenizer("qwen", cfg.model.tiny.vocab_size),
            "the built-in tool chat tokenizer",
        )
    elif cfg.model.tiny is not None:
        tok, where = char_tokenizer(), "the built-in character tokenizer"
        if tok.vocab_size > cfg.model.tiny.vocab_size:
            raise ConfigError(
                "model.tiny.vocab_size",
                f"{cfg.model.tiny.vocab_size} is smaller than the character tokenizer's {tok.vocab_size}",
            )
    else:
        from transformers import AutoTokenizer

        tok, where = AutoTokenizer.from_pretrained(cfg.model.hf_dir), f"the tokenizer of {cfg.model.hf_dir}"
    if cfg.data.apply_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError(
            ("data.apply_chat_template", "model.hf_dir"),
            f"is true but {where} has no chat template (add one to its tokenizer_config.json / "
            "chat_template.jinja, or set data.apply_chat_template=false)",
        )
    if tok.eos_token_id is None:
        raise ConfigError("model.hf_dir", f"{where} has no EOS token: responses could never end")
    return tok


def save_tokenizer(tokenizer, out: Path) -> None:
    """Write the tokenizer files into an existing directory (an HF export, a checkpoint's hf/)."""
    tokenizer.save_pretrained(str(out))


def check_same_tokenizer(cfg: Config) -> None:
    """``megagrpo distill``: token ids mean the same to student and teacher (``distill.teacher_hf_dir``):
    every student token has the same id in the teacher, the same EOS, and the teacher's embedding covers
    the ids. ConfigError naming both tokenizers; the trainer calls it before any process starts."""
    import json

    from transformers import AutoTokenizer

    teacher_dir = Path(cfg.distill.teacher_hf_dir)
    teacher_json = json.loads((teacher_dir / "config.json").read_text())  # read by the config check already
    student = load_tokenizer(cfg)
    student_where = cfg.model.hf_dir or "the built-in tokenizer of model.tiny"
    try:
        teacher = AutoTokenizer.from_pretrained(str(teacher_dir))
    except (OSError, ValueError) as err:
        raise ConfigError(
            "distill.teacher_hf_dir", f"cannot load the tokenizer of {teacher_dir}: {err}"
        ) from None
    keys = ("distill.teacher_hf_dir", "model.hf_dir" if cfg.model.hf_dir else "model.tiny")
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    # Every token the student knows has the same id in the teacher (a saved tokenizer may list special
    # tokens the in-memory one keeps apart: extra teacher tokens on ids of their own are harmless).
    differ = sorted(
        ((tok, i, t_vocab.get(tok)) for tok, i in s_vocab.items() if t_vocab.get(tok) != i), key=str
    )
    if differ:
        raise ConfigError(
            keys,
            f"the teacher's tokenizer ({teacher_dir}) and the student's ({student_where}) differ: "
            f"{len(differ)} of the student's {len(s_vocab)} tokens have another id in the teacher, e.g. "
            f"(token, student id, teacher id) {differ[:3]}; distillation compares their logprobs of the "
            "same token ids",
        )
    require(
        student.eos_token_id == teacher.eos_token_id,
        keys,
        f"EOS differs: id {teacher.eos_token_id} in {teacher_dir}, {student.eos_token_id} in {student_where}",
    )
    vocab_size = int(teacher_json.get("vocab_size", 0))
    require(
        vocab_size >= len(s_vocab),
        keys,
        f"{teacher_dir}/config.json vocab_size {vocab_size} is smaller than the tokenizer's "
        f"{len(s_vocab)} ids",
    )
