"""Rank groups name worker methods by reference: only methods of the hosted class pass."""

import pytest

from megagrpo.cluster import method_name

pytestmark = pytest.mark.unit


class Worker:
    def train(self):
        return "base"

    def save(self):
        return "saved"


class TimedWorker(Worker):
    def train(self):
        return "timed"


class Other:
    def train(self):
        return "other"


def test_methods_of_the_class_and_its_bases_are_called_by_name():
    assert method_name(Worker, Worker.train) == "train"
    assert method_name(TimedWorker, Worker.save) == "save"  # inherited
    # A base method on a subclass runs the override: the actor calls it by name.
    name = method_name(TimedWorker, Worker.train)
    assert getattr(TimedWorker(), name)() == "timed"


@pytest.mark.parametrize(
    "method",
    ["train", Other.train, Worker().train, TimedWorker.train, len],
    ids=["string", "other-class", "bound", "subclass-method-on-base", "builtin"],
)
def test_anything_else_is_a_type_error(method):
    with pytest.raises(TypeError, match="is not a method of Worker"):
        method_name(Worker, method)
