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


@pytest.mark.parametrize(
    ("overrides", "ranks", "cores", "want"),
    [
        ([], 1, 2, 2),  # sequential loop: the engines wait while the rank trains
        ([], 2, 2, 1),
        ([], 3, 16, 5),
        ([], 4, 2, 1),  # never below one
        (["grpo.max_staleness=1"], 1, 2, 1),  # engines generate during training: its reserved CPUs
        (["grpo.max_staleness=1", "cluster.cpus_per_worker=3"], 1, 8, 3),
        (["cluster.cpu_threads=4"], 2, 2, 4),  # as configured
    ],
)
def test_cpu_ranks_get_the_threads_their_cores_allow(overrides, ranks, cores, want):
    from megagrpo.cluster import rank_cpu_threads
    from megagrpo.config import load_config

    cfg = load_config(None, overrides)
    assert rank_cpu_threads(cfg, ranks, cores) == want


def test_cpu_threads_must_be_positive():
    from megagrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"cluster\.cpu_threads"):
        load_config(None, ["cluster.cpu_threads=0"])
