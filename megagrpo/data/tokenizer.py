"""The tokenizer of a job: the HF tokenizer of ``model.hf_dir``, or, for a tiny model, the arithmetic task's
character vocabulary as a real HF tokenizer (built in memory with the ``tokenizers`` library, with a chat
template), so SFT and DPO run the same chat-template code on both.

The character tokenizer gives the ids of :class:`megagrpo.data.arithmetic.CharTokenizer` (PAD 0, BOS 1, EOS 2,
then one id per character); ``encode`` prepends BOS, as the arithmetic prompts have it. Its chat template
renders a conversation as ``<s>`` + each turn's text, an assistant turn followed by ``</s>``, and marks the
assistant turns with ``{% generation %}`` so transformers returns their token mask.
"""

from __future__ import annotations

from pathlib import Path

from megagrpo.config import Config, ConfigError
from megagrpo.data.arithmetic import _CHARS, _FIRST_CHAR_ID, BOS_ID, EOS_ID, PAD_ID

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


def load_tokenizer(cfg: Config):
    """The job's tokenizer; a chat template is required when ``data.apply_chat_template`` is set.

    Raises ConfigError (before any worker starts) when the template is missing.
    """
    if cfg.model.tiny is not None:
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
