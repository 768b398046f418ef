"""The chat side of a multi-turn episode: turning turns into tokens and tool calls out of text.

An episode is token-in/token-out. Its first prompt is the opening rendered with the chat template
(:meth:`ChatRenderer.prompt_ids`); every later prompt is exactly the previous prompt + the tokens the engine
sampled (ending with the template's end-of-turn token, the engine's stop token) + the observation's tokens
(:meth:`ChatRenderer.observation_ids`). Nothing is re-tokenized from decoded text: a model's sampled tokens
need not be the tokenizer's own tokenization of their text, and the trainer must score the tokens that
were sampled. The loss mask is the sampled tokens.

The observation's tokens are a delta: the template renders a fixed conversation, then the same
conversation + the observation's messages + the next generation prompt, and the text after the first
rendering's end-of-turn token is tokenized on its own. That is sound because the end-of-turn token is an
added token, at which the tokenizer splits text before anything else, so the text after it tokenizes the
same whatever came before. Templates that render earlier turns differently once messages follow (some
drop the reasoning of earlier assistant turns) are refused: no delta exists for them.

Tool calls are read from the turn's text in a named format (:data:`TOOL_CALL_FORMATS`); a malformed call
gives an error sentence for the environment to send back, never an exception.

:func:`tool_chat_tokenizer` builds small in-memory tokenizers with tool-calling chat templates in the
styles of Qwen2.5 and Llama 3.1, for tests and the agent demo.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LLAMA3_TOOL_TEMPLATE",
    "QWEN_TOOL_TEMPLATE",
    "TOOL_CALL_FORMATS",
    "TOOL_CHAT_STYLES",
    "ChatRenderer",
    "ToolCall",
    "ToolCallParse",
    "check_tool_call_format",
    "format_tool_call",
    "parse_tool_calls",
    "tool_chat_tokenizer",
    "tool_result_messages",
]

# The conversation ChatRenderer renders to find the end-of-turn token and to take observation deltas from.
_PROBE_USER = "Probe question."
_PROBE_REPLY = "Probe reply."
_PROBE = ({"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY})


def _describe(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the tokenizer {name!r}" if name else f"an in-memory tokenizer ({type(tokenizer).__name__})"


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class ChatRenderer:
    """The token ids of an episode's prompts and observations, rendered with ``tokenizer``'s chat
    template. Construction finds the token that closes an assistant turn; ValueError naming the
    tokenizer when it has no chat template or that token cannot be told."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._name = _describe(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{self._name} has no chat template: multi-turn episodes render their turns with it"
            )
        text = self._render(list(_PROBE), generation_prompt=False)
        at = text.rfind(_PROBE_REPLY)
        if at < 0:
            raise ValueError(
                f"the chat template of {self._name} does not write an assistant turn's content as it is "
                f"({_PROBE_REPLY!r} is not in its rendering {text!r})"
            )
        after = at + len(_PROBE_REPLY)
        self.end_of_turn = self._end_of_turn_marker(text[after:])
        """The added token the template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``)."""
        self.residue = text[after + len(self.end_of_turn) :]
        """What the template writes after the end-of-turn token at the end of a conversation (ChatML:
        "\\n"); the next observation's tokens begin with it."""
        self._head = text[: after + len(self.end_of_turn)]
        self._end_of_turn_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes BOS itself where the model wants one; the tokenizer must not add another
        # (this is how apply_chat_template tokenizes too).
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _end_of_turn_marker(self, tail: str) -> str:
        """The EOS or other added token that ``tail`` (the rendering after an assistant's content)
        starts with; the longest if several do."""
        tok = self.tokenizer
        added = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values()}
        candidates = [c for c in {tok.eos_token, *added} if c and tail.startswith(c)]
        if not candidates:
            raise ValueError(
                f"cannot tell how the chat template of {self._name} ends an assistant turn: after the "
                f"assistant's content it writes {tail[:40]!r}, which starts with neither the EOS token "
                f"{tok.eos_token!r} nor another added token; multi-turn episodes need a turn closed by one "
                "token (the engine's stop token)"
            )
        marker = max(candidates, key=len)
        if tok.encode(marker, add_special_tokens=False) != [tok.convert_tokens_to_ids(marker)]:
            raise ValueError(f"{self._name} does not encode its end-of-turn token {marker!r} as one id")
        return marker

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn: the engine's stop tokens for a turn."""
        return (self._end_of_turn_id,)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The episode's first prompt: the opening ``messages`` (system/user) and the generation prompt;
        ``tools``: the tool schemas for templates that render them (into the system turn)."""
        return self._encode(self._render(messages, generation_prompt=True, tools=tools))

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The tokens after a closed assistant turn: the template's residue after the end-of-turn token,
        ``messages`` (roles "tool" or "user") and the generation prompt of the next assistant turn.
        ValueError when the template renders the earlier turns differently once ``messages`` follow."""
        if not messages:
            raise ValueError("an observation needs at least one message")
        full = self._render([*_PROBE, *messages], generation_prompt=True)
        if not full.startswith(self._head):
            cut = _first_difference(full, self._head)
            raise ValueError(
                f"the chat template of {self._name} renders earlier turns differently when messages are "
                f"appended (with roles {[m.get('role') for m in messages]}): where the conversation alone "
                f"reads {self._head[max(0, cut - 30) : cut + 30]!r}, followed by them it reads "
                f"{full[max(0, cut - 30) : cut + 30]!r}. Token-in/token-out episodes append each observation "
                "to the tokens already sampled, so every turn must render the same whatever follows; some "
                "templates drop or rewrite earlier turns (e.g. the reasoning of earlier assistant turns, as "
                "Qwen3's does): use a template without that rewrite"
            )
        return self._encode(full[len(self._head) :])

    def closed(self, sampled_ids: Sequence[int]) -> bool:
        """Whether a turn's sampled tokens end with the end-of-turn token (a turn cut by the per-turn
        token limit is not closed: the episode ends there, truncated)."""
        return len(sampled_ids) > 0 and int(sampled_ids[-1]) in self.stop_token_ids

    def turn_text(self, sampled_ids: Sequence[int]) -> str:
        """The decoded text of a turn without its end-of-turn token, what the environment reads; added
        tokens that are part of the text (``<tool_call>``) are kept."""
        ids = list(sampled_ids[:-1] if self.closed(sampled_ids) else sampled_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class ToolCall:
    """One call the policy made."""

    name: str
    """The function's name."""
    arguments: dict
    """Argument name -> value, as the call's JSON gave them."""


@dataclass(frozen=True)
class ToolCallParse:
    """The tool calls of one turn's text."""

    calls: list[ToolCall]
    """The well-formed calls, in the order the text makes them."""
    errors: list[str]
    """One sentence per malformed call, saying what is wrong (for the tool result the policy reads)."""


_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _call_from_json(body: str, number: int, args_keys: tuple[str, ...]) -> ToolCall | str:
    """The call that ``body`` (one call's JSON text) makes, or an error sentence; ``args_keys``: the
    keys its arguments may come under, the first the format's own."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return f"tool call {number} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
    shape = f'{{"name": <function name>, "{args_keys[0]}": <object of arguments>}}'
    if not isinstance(value, dict):
        return f"tool call {number} is {_JSON_TYPES[type(value)]}, not a JSON object {shape}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f'tool call {number} has no "name" (the function\'s name as a string): write {shape}'
    key = next((k for k in args_keys if k in value), args_keys[0])
    arguments = value.get(key, {})
    if not isinstance(arguments, dict):
        kind = _JSON_TYPES[type(arguments)]
        return (
            f'tool call {number} ({name}): "{key}" is {kind}, not a JSON object of argument names and values'
        )
    return ToolCall(name, arguments)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_TAG = re.compile("</?tool_call>")


def _parse_hermes(text: str) -> ToolCallParse:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them; the text
    around them is the turn's prose."""
    calls, errors = [], []
    number, body_start = 0, None
    for tag in _HERMES_TAG.finditer(text):
        if tag.group() == _HERMES_OPEN:
            if body_start is not None:
                errors.append(f"tool call {number} is not closed: end it with {_HERMES_CLOSE}")
            number, body_start = number + 1, tag.end()
        elif body_start is None:
            errors.append(f"a {_HERMES_CLOSE} has no {_HERMES_OPEN} before it")
        else:
            result = _call_from_json(text[body_start : tag.start()].strip(), number, ("arguments",))
            (calls if isinstance(result, ToolCall) else errors).append(result)
            body_start = None
    if body_start is not None:
        errors.append(f"tool call {number} is not closed: end it with {_HERMES_CLOSE}")
    return ToolCallParse(calls, errors)


def _parse_llama3_json(text: str) -> ToolCallParse:
    """A turn that is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1's JSON tool
    calls; "arguments" is read too, as vLLM's parser does); any other text is an answer, no call."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ToolCallParse([], [])
    result = _call_from_json(body, 1, ("parameters", "arguments"))
    return ToolCallParse([result], []) if isinstance(result, ToolCall) else ToolCallParse([], [result])


# ensure_ascii=False: as the templates' tojson writes a call's arguments (and as models write them).
def _format_hermes(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{_HERMES_OPEN}\n{body}\n{_HERMES_CLOSE}"


def _format_llama3_json(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


_FORMATS: dict[str, tuple[Callable[[str], ToolCallParse], Callable[[ToolCall], str]]] = {
    "hermes": (_parse_hermes, _format_hermes),
    "llama3_json": (_parse_llama3_json, _format_llama3_json),
}
TOOL_CALL_FORMATS = tuple(_FORMATS)
"""How a policy writes tool calls: "hermes" (Qwen2.5, Qwen3, Hermes: ``<tool_call>`` tags around JSON),
"llama3_json" (Llama 3.1: the turn is one JSON object)."""


def check_tool_call_format(fmt: str) -> None:
    """ValueError listing the formats when ``fmt`` is none of them."""
    if fmt not in _FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; the formats are: {', '.join(TOOL_CALL_FORMATS)}")


def parse_tool_calls(text: str, fmt: str) -> ToolCallParse:
    """The tool calls that a turn's ``text`` makes in format ``fmt`` and an error per malformed one."""
    check_tool_call_format(fmt)
    return _FORMATS[fmt][0](text)


def format_tool_call(call: ToolCall, fmt: str) -> str:
    """The text of ``call`` in format ``fmt`` as a policy writes it (what :func:`parse_tool_calls`
    reads back); for scripted turns and SFT data."""
    check_tool_call_format(fmt)
    return _FORMATS[fmt][1](call)


def tool_result_messages(results: list[str], fmt: str) -> list[dict]:
    """The observation messages for a turn's tool results, one "tool" message each (in order); the
    chat template decides how they read (Qwen2.5: grouped in one user turn, Llama 3.1: "ipython" turns)."""
    check_tool_call_format(fmt)
    return [{"role": "tool", "content": result} for result in results]


QWEN_TOOL_TEMPLATE = r"""
{%- set ns = namespace(system=none) %}
{%- if messages and messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if ns.system is not none %}{{- ns.system + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nThese are the functions you can call, one JSON signature a line, ' }}
    {{- 'between <tools> and </tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nTo call one, write a JSON object with its name and arguments between the tags:' }}
    {{- '\n<tool_call>\n{"name": <function name>, "arguments": <object of arguments>}\n</tool_call>' }}
    {{- '<|im_end|>\n' }}
{%- elif ns.system is not none %}
    {{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
            {{- message.content or '' }}
            {%- for call in message.tool_calls or [] %}
                {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
                {%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
                {{- call.arguments if call.arguments is string else call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
"""ChatML in the way of Qwen2.5: ``<|im_start|>role\\n`` + text + ``<|im_end|>\\n``; ``tools`` are listed in
the system turn; an assistant's ``tool_calls`` are written as ``<tool_call>`` JSON; tool results go into
a user turn as ``<tool_response>`` blocks, consecutive ones grouped in one turn. Assistant content and its
``<|im_end|>`` are marked with ``{% generation %}`` (the assistant token mask of transformers)."""

LLAMA3_TOOL_TEMPLATE = r"""
{{- bos_token }}
{%- set ns = namespace(system=none) %}
{%- if messages and messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}{%- endif %}
{%- if tools or ns.system is not none %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if ns.system is not none %}{{- ns.system }}{%- endif %}
    {%- if tools %}
        {%- if ns.system is not none %}{{- '\n\n' }}{%- endif %}
        {{- 'To call a function, answer with nothing but a JSON object ' }}
        {{- '{"name": <function name>, "parameters": <object of arguments>}. The functions:' }}
        {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- generation %}
            {%- if message.tool_calls %}
                {%- if message.tool_calls | length > 1 %}
                    {{- raise_exception('one tool call per assistant turn') }}
                {%- endif %}
                {%- set call = message.tool_calls[0] %}
                {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
                {{- '{"name": "' + call.name + '", "parameters": ' }}
                {{- call.arguments if call.arguments is string else call.arguments | tojson }}
                {{- '}' }}
            {%- else %}
                {{- message.content }}
            {%- endif %}
            {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {%- set role = 'ipython' if message.role == 'tool' else message.role %}
        {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
"""In the way of Llama 3.1: ``<|begin_of_text|>``, then per turn
``<|start_header_id|>role<|end_header_id|>\\n\\n`` + text + ``<|eot_id|>``; ``tools`` are listed in the
system turn; an assistant's one ``tool_calls`` entry is written as the JSON object ``{"name", "parameters"}``;
tool results are "ipython" turns. Assistant content and its ``<|eot_id|>`` are marked with
``{% generation %}``."""

# The pre-tokenizer splits of the two families: words, numbers (Qwen2: digit by digit; Llama 3: runs of
# up to three digits), punctuation runs, newlines, spaces. Here, not in megagrpo.data.tokenizer (which
# uses Qwen2's too): config validation imports this module, and data.tokenizer imports the config.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_STYLES: dict[str, dict[str, Any]] = {
    "qwen": {
        "specials": [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ],
        "tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "template": QWEN_TOOL_TEMPLATE,
        "format": "hermes",
        "split": QWEN2_SPLIT,
    },
    "llama3": {
        "specials": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "tokens": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "pad_token": "<|end_of_text|>",
        },
        "template": LLAMA3_TOOL_TEMPLATE,
        "format": "llama3_json",
        "split": _LLAMA3_SPLIT,
    },
}
TOOL_CHAT_STYLES = {style: spec["format"] for style, spec in _STYLES.items()}
"""The styles of :func:`tool_chat_tokenizer` -> the tool call format their template writes."""
TOOL_CORPUS_SEED = 7_919
"""Seed of the generated text the tool chat tokenizers are trained on (fixed: one tokenizer per style)."""


def _tool_corpus(fmt: str, count: int) -> list[str]:
    """Arithmetic questions answered with calculator tool calls in format ``fmt``, their results and
    final answers, and the role names the templates write."""
    rng = random.Random(TOOL_CORPUS_SEED)
    ops = (
        ("+", "add", lambda a, b: a + b),
        ("-", "subtract", lambda a, b: a - b),
        ("*", "multiply", lambda a, b: a * b),
    )
    schemas = [
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"{name} a and b ({sign}).",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                        "required": ["a", "b"],
                    },
                },
            }
        )
        for sign, name, _ in ops
    ]
    corpus = ["system\nuser\nassistant\ntool\nipython\n"] * 50 + schemas * 50
    for _ in range(count):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        sign, name, op = rng.choice(ops)
        call = format_tool_call(ToolCall(name, {"a": a, "b": b}), fmt)
        # Added tokens are no training text: the tags around a call are left out.
        call = call.removeprefix(f"{_HERMES_OPEN}\n").removesuffix(f"\n{_HERMES_CLOSE}")
        ask = rng.choice(("What is", "Compute", "Please work out", "Tell me the value of"))
        plan = rng.choice(
            ("I will call the calculator.", "Let me use the tool first.", "To be sure, I check it.")
        )
        result = op(a, b)
        corpus.append(
            f"{ask} {a} {sign} {b}?\n{plan}\n{call}\n{result}\n"
            f"The result is {result}, so the answer is {result}."
        )
    return corpus


def tool_chat_tokenizer(style: str, vocab_size: int = 512):
    """A byte-level BPE of ``vocab_size`` tokens (added tokens included) trained with ``tokenizers`` on
    generated calculator conversations, as a ``PreTrainedTokenizerFast`` with the tool-calling chat template
    of ``style`` (:data:`TOOL_CHAT_STYLES`): "qwen" (ChatML, EOS ``<|im_end|>``, hermes tool calls) or
    "llama3" (BOS ``<|begin_of_text|>``, EOS ``<|eot_id|>``, llama3_json tool calls). Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if style not in _STYLES:
        raise ValueError(f"unknown tool chat style {style!r}; the styles are: {', '.join(_STYLES)}")
    spec = _STYLES[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_tool_corpus(spec["format"], 1000), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=spec["template"],
        clean_up_tokenization_spaces=False,
        **spec["tokens"],
    )
