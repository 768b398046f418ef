import pytest

from megagrpo.data.arithmetic import EOS_ID, ArithmeticTask, CharTokenizer
from megagrpo.rewards.arithmetic import arithmetic_reward

pytestmark = pytest.mark.unit


def test_tokenizer_round_trip_and_eos_stop():
    tok = CharTokenizer()
    ids = tok.encode("37+45=", bos=True)
    assert ids[0] == tok.bos_id and len(ids) == 7
    assert tok.decode(ids) == "37+45="
    assert tok.decode([*tok.encode("82"), EOS_ID, *tok.encode("99")]) == "82"


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"\['x'\]"):
        CharTokenizer().encode("3x4")


def test_problems_are_reproducible_and_correct():
    task = ArithmeticTask(max_operand=20, ops="+-*")
    first, again = task.problems(50, seed=7), task.problems(50, seed=7)
    assert first == again
    assert first != task.problems(50, seed=8)
    for prob in first:
        assert eval(prob.prompt[:-1]) == int(prob.answer)


def test_reward_is_exact_integer_match():
    assert arithmetic_reward(" 82 ", "82") == 1.0
    assert arithmetic_reward("83", "82") == 0.0
    assert arithmetic_reward("8+2", "82") == 0.0
    assert arithmetic_reward("", "0") == 0.0
