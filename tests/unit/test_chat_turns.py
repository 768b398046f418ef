"""Multi-turn episodes token by token: prompt + sampled turns + observation deltas are the chat template's
rendering of the whole conversation, the loss mask is exactly its assistant spans, and tool calls are
read from a turn's text in both formats (malformed ones give error sentences)."""

import pytest

from megagrpo.envs.chat import (
    QWEN_TOOL_TEMPLATE,
    TOOL_CALL_FORMATS,
    TOOL_CHAT_STYLES,
    ChatRenderer,
    ToolCall,
    check_tool_call_format,
    format_tool_call,
    parse_tool_calls,
    tool_chat_tokenizer,
    tool_result_messages,
)

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} a and b.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
    for name in ("add", "multiply")
]
ADD, MULTIPLY = ToolCall("add", {"a": 12, "b": 7}), ToolCall("multiply", {"a": 19, "b": 3})


@pytest.fixture(scope="module", params=sorted(TOOL_CHAT_STYLES))
def style(request):
    """(style, its tokenizer, its tool call format)."""
    return request.param, tool_chat_tokenizer(request.param), TOOL_CHAT_STYLES[request.param]


def _conversation(fmt: str) -> list[dict]:
    """System + user; two assistant turns with a tool call each and their results; the final answer."""
    # Hermes turns may have prose before the call; a Llama 3.1 tool-call turn is the JSON object alone.
    lead = "I will add first.\n" if fmt == "hermes" else ""
    return [
        {"role": "system", "content": "You are a careful calculator. Use the tools."},
        {"role": "user", "content": "What is (12 + 7) * 3?"},
        {"role": "assistant", "content": lead + format_tool_call(ADD, fmt)},
        *tool_result_messages(["19"], fmt),
        {"role": "assistant", "content": format_tool_call(MULTIPLY, fmt)},
        *tool_result_messages(["57"], fmt),
        {"role": "assistant", "content": "The answer is 57."},
    ]


def _sampled(tokenizer, renderer: ChatRenderer, text: str) -> list[int]:
    """What an engine stopped at the end-of-turn token samples for ``text``."""
    return [*tokenizer.encode(text, add_special_tokens=False), renderer.stop_token_ids[0]]


def _episode(tokenizer, renderer: ChatRenderer, conversation: list[dict]) -> tuple[list[int], list[bool]]:
    """The episode's token ids and loss mask, built as the episode runner does: the opening's prompt, then
    per assistant turn its sampled ids and the ids of the observation that follows it."""
    ids = renderer.prompt_ids(conversation[:2], tools=TOOLS)
    mask = [False] * len(ids)
    rest = conversation[2:]
    while rest:
        turn, rest = rest[0], rest[1:]
        assert turn["role"] == "assistant"
        sampled = _sampled(tokenizer, renderer, turn["content"])
        ids, mask = ids + sampled, mask + [True] * len(sampled)
        count = next((i for i, m in enumerate(rest) if m["role"] == "assistant"), len(rest))
        if count:
            observation = renderer.observation_ids(rest[:count])
            ids, mask = ids + observation, mask + [False] * len(observation)
        rest = rest[count:]
    return ids, mask


def test_episode_tokens_are_the_templates_rendering_of_the_conversation(style):
    name, tokenizer, fmt = style
    conversation = _conversation(fmt)
    renderer = ChatRenderer(tokenizer)
    ids, mask = _episode(tokenizer, renderer, conversation)

    rendered = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    # The episode ends with the last turn's end-of-turn token; the template then writes its residue (ChatML:
    # "\n"), which nothing samples or trains.
    ids = ids + tokenizer.encode(renderer.residue, add_special_tokens=False)
    mask = mask + [False] * (len(ids) - len(mask))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for i, (got, want) in enumerate(zip(ids, rendered["input_ids"], strict=False)):
        assert got == want, f"{name}: token {i}: episode {tokens[i]!r}, template {tokenizer.decode([want])!r}"
    assert len(ids) == len(rendered["input_ids"])
    # The template marks each assistant turn's content and end-of-turn token ({% generation %}).
    for i, (got, want) in enumerate(zip(mask, rendered["assistant_masks"], strict=False)):
        assert got == bool(want), f"{name}: mask at token {i} ({tokens[i]!r}): episode {got}, template {want}"
    assert len(mask) == len(rendered["assistant_masks"])

    # The masked spans read as the assistant texts, each closed by the end-of-turn token.
    spans, current = [], []
    for token_id, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token_id)
        elif current:
            spans, current = [*spans, current], []
    spans += [current] if current else []
    texts = [m["content"] for m in conversation if m["role"] == "assistant"]
    eot = renderer.end_of_turn
    assert [tokenizer.decode(s, skip_special_tokens=False) for s in spans] == [t + eot for t in texts]


def test_end_of_turn_and_observation_text(style):
    name, tokenizer, fmt = style
    renderer = ChatRenderer(tokenizer)
    two_results = renderer.observation_ids(tool_result_messages(["1", "2"], fmt))
    text = tokenizer.decode(two_results, skip_special_tokens=False)
    if name == "qwen":
        assert (renderer.end_of_turn, renderer.residue) == ("<|im_end|>", "\n")
        # Qwen2.5's way: consecutive tool results are grouped in one user turn.
        assert text == (
            "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        assert (renderer.end_of_turn, renderer.residue) == ("<|eot_id|>", "")
        head = "<|start_header_id|>{}<|end_header_id|>\n\n"
        assert (
            text
            == f"{head.format('ipython')}1<|eot_id|>{head.format('ipython')}2<|eot_id|>"
            + head.format("assistant")
        )
    assert renderer.stop_token_ids == (tokenizer.convert_tokens_to_ids(renderer.end_of_turn),)
    user = tokenizer.decode(
        renderer.observation_ids([{"role": "user", "content": "Go on."}]), skip_special_tokens=False
    )
    assert "Go on." in user and user.startswith(renderer.residue)


def test_prompt_writes_bos_once():
    tokenizer = tool_chat_tokenizer("llama3")
    ids = ChatRenderer(tokenizer).prompt_ids([{"role": "user", "content": "Hi."}])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_closed_and_turn_text(style):
    _, tokenizer, fmt = style
    renderer = ChatRenderer(tokenizer)
    text = "Let me check.\n" + format_tool_call(ADD, fmt) if fmt == "hermes" else format_tool_call(ADD, fmt)
    sampled = _sampled(tokenizer, renderer, text)
    assert renderer.closed(sampled)
    assert renderer.turn_text(sampled) == text  # added tokens such as <tool_call> stay in the text
    assert parse_tool_calls(renderer.turn_text(sampled), fmt) == parse_tool_calls(text, fmt)
    assert parse_tool_calls(text, fmt).calls == [ADD]
    cut = sampled[:-3]  # stopped by the per-turn token limit
    assert not renderer.closed(cut)
    assert renderer.turn_text(cut) == tokenizer.decode(cut, skip_special_tokens=False)
    assert not renderer.closed([])
    # Another special token at the end (here the end of text) does not close the turn.
    assert tokenizer.pad_token_id not in renderer.stop_token_ids
    assert not renderer.closed([*sampled[:-1], tokenizer.pad_token_id])


def test_tool_calls_field_renders_as_the_calls_text(style):
    """A conversation written with OpenAI-style ``tool_calls`` (SFT data) renders as the text a policy
    writes for the same calls."""
    _, tokenizer, fmt = style
    for made in (ADD, ToolCall("convert", {"amount": 3, "to": "€", "rounding": None})):
        as_text = [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": format_tool_call(made, fmt)},
        ]
        call = {"type": "function", "function": {"name": made.name, "arguments": made.arguments}}
        as_field = [as_text[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
        assert tokenizer.apply_chat_template(as_field, tokenize=False) == tokenizer.apply_chat_template(
            as_text, tokenize=False
        )


def test_tokenizer_is_deterministic_and_refuses_unknown_styles():
    assert tool_chat_tokenizer("qwen").get_vocab() == tool_chat_tokenizer("qwen").get_vocab()
    with pytest.raises(ValueError, match="unknown tool chat style 'mistral'; the styles are: qwen, llama3"):
        tool_chat_tokenizer("mistral")


def test_parse_hermes_calls():
    text = (
        "First both sums.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "\n</tool_call>\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 3, "b": 4}}'
        "\n</tool_call>"
    )
    assert parse_tool_calls(text, "hermes").calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("add", {"a": 3, "b": 4}),
    ]
    assert parse_tool_calls(text, "hermes").errors == []
    assert parse_tool_calls("The answer is 3.", "hermes").calls == []
    assert parse_tool_calls("The answer is 3.", "hermes").errors == []
    for call in (ADD, ToolCall("now", {})):
        assert parse_tool_calls(format_tool_call(call, "hermes"), "hermes").calls == [call]


@pytest.mark.parametrize(
    "body, error",
    [
        (
            '{"name": "add" "arguments": {}}',
            "tool call 1 is not valid JSON: Expecting ',' delimiter at line 1 column 16",
        ),
        ('{"arguments": {"a": 1}}', 'tool call 1 has no "name" (the function\'s name as a string)'),
        ('{"name": 3, "arguments": {}}', 'tool call 1 has no "name"'),
        (
            '{"name": "add", "arguments": "{\\"a\\": 1}"}',
            'tool call 1 (add): "arguments" is a string, not a JSON object',
        ),
        (
            '{"name": "add", "arguments": [1, 2]}',
            'tool call 1 (add): "arguments" is an array, not a JSON object',
        ),
        ('["add", 1, 2]', "tool call 1 is an array, not a JSON object"),
        ("", "tool call 1 is not valid JSON: Expecting value at line 1 column 1"),
    ],
)
def test_parse_hermes_malformed_calls(body, error):
    result = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", "hermes")
    assert result.calls == []
    assert len(result.errors) == 1 and result.errors[0].startswith(error), result.errors


def test_parse_hermes_unclosed_and_stray_tags():
    good = format_tool_call(ADD, "hermes")
    result = parse_tool_calls(f'<tool_call>\n{{"name": "add", "arguments": {{}}}}\n{good}', "hermes")
    assert result.calls == [ADD]
    assert result.errors == ["tool call 1 is not closed: end it with </tool_call>"]
    result = parse_tool_calls(f'{good}\n<tool_call>\n{{"name": "add"', "hermes")
    assert result.calls == [ADD] and result.errors == ["tool call 2 is not closed: end it with </tool_call>"]
    result = parse_tool_calls(f"done.</tool_call>{good}", "hermes")
    assert result.calls == [ADD] and result.errors == ["a </tool_call> has no <tool_call> before it"]


def test_parse_llama3_json_calls():
    text = format_tool_call(MULTIPLY, "llama3_json")
    assert text == '{"name": "multiply", "parameters": {"a": 19, "b": 3}}'
    assert parse_tool_calls(text, "llama3_json").calls == [MULTIPLY]
    assert parse_tool_calls(f"<|python_tag|>{text}\n", "llama3_json").calls == [MULTIPLY]
    # "arguments" is read too (vLLM's llama3_json parser does); "parameters" is the format's own key.
    assert parse_tool_calls('{"name": "add", "arguments": {"a": 12, "b": 7}}', "llama3_json").calls == [ADD]
    assert parse_tool_calls('{"name": "now"}', "llama3_json").calls == [ToolCall("now", {})]
    plain = parse_tool_calls("The answer is 57.", "llama3_json")
    assert plain.calls == [] and plain.errors == []


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"name": "add", "parameters": {"a": 1}', "tool call 1 is not valid JSON: Expecting ',' delimiter"),
        (
            '{"name": "add", "parameters": {}} and more',
            "tool call 1 is not valid JSON: Extra data at line 1 column 35",
        ),
        ('{"parameters": {}}', 'tool call 1 has no "name"'),
        (
            '{"name": "add", "parameters": 5}',
            'tool call 1 (add): "parameters" is a number, not a JSON object',
        ),
    ],
)
def test_parse_llama3_json_malformed_calls(text, error):
    result = parse_tool_calls(text, "llama3_json")
    assert result.calls == []
    assert len(result.errors) == 1 and result.errors[0].startswith(error), result.errors


def test_unknown_tool_call_format_lists_the_formats():
    assert TOOL_CALL_FORMATS == ("hermes", "llama3_json")
    for call in (
        lambda: parse_tool_calls("", "mistral"),
        lambda: tool_result_messages(["1"], "mistral"),
        lambda: check_tool_call_format("mistral"),
    ):
        with pytest.raises(
            ValueError, match="unknown tool call format 'mistral'; the formats are: hermes, llama3_json"
        ):
            call()
    assert tool_result_messages(["1", "2"], "hermes") == [
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]


# Like Qwen3's: the last assistant turn gets a (here empty) reasoning block, earlier ones lose it.
_REWRITING_TEMPLATE = QWEN_TOOL_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    1,
)


def test_template_that_rewrites_earlier_turns_is_refused():
    assert _REWRITING_TEMPLATE != QWEN_TOOL_TEMPLATE
    tokenizer = tool_chat_tokenizer("qwen")
    tokenizer.chat_template = _REWRITING_TEMPLATE
    tokenizer.name_or_path = "rewriting-chat"
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(
        ValueError, match=r"renders earlier turns differently when messages are appended"
    ) as err:
        renderer.observation_ids(tool_result_messages(["1"], "hermes"))
    assert "the tokenizer 'rewriting-chat'" in str(err.value) and "Qwen3" in str(err.value)
    assert "<think>" in str(err.value)  # the message shows where the renderings part


def test_tokenizer_without_a_usable_template_is_refused():
    tokenizer = tool_chat_tokenizer("qwen")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        ChatRenderer(tokenizer)
    # The assistant turn ends in plain text, not in a token of its own: no stop token to give the engine.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"cannot tell how the chat template of .* ends an assistant turn"):
        ChatRenderer(tokenizer)
