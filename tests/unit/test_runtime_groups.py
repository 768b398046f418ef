"""Rank groups: both implement the ``RankCalls`` surface trainers use, and name worker methods by
reference (only methods of the hosted class pass)."""

import inspect
import subprocess
import sys

import pytest

from megagrpo.runtime.groups import LocalGroup, RankCalls, RankGroup, method_name

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
    from megagrpo.config import load_config
    from megagrpo.runtime.groups import rank_cpu_threads

    cfg = load_config(None, overrides)
    assert rank_cpu_threads(cfg, ranks, cores) == want


def test_cpu_threads_must_be_positive():
    from megagrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"cluster\.cpu_threads"):
        load_config(None, ["cluster.cpu_threads=0"])


# ---------------------------------------------------------------------------- the RankCalls surface


def _protocol_members() -> dict[str, object]:
    """RankCalls' members: its methods (by name) and its data attributes (name -> None)."""
    methods = {
        name: value
        for name, value in vars(RankCalls).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }
    return methods | dict.fromkeys(RankCalls.__annotations__)


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_declares_what_trainers_call():
    assert set(_protocol_members()) == {
        "is_controller",
        "last_call_s",
        "call_all",
        "call_first",
        "barrier",
        "gather_to_controller",
        "from_controller",
        "controller_only",
    }


@pytest.mark.parametrize("group_cls", [RankGroup, LocalGroup])
def test_both_groups_define_every_member_with_the_protocols_signature(group_cls):
    for name, declared in _protocol_members().items():
        if declared is None:  # a data attribute: a class default or set in __init__
            assert name in vars(group_cls) or f"self.{name}" in inspect.getsource(group_cls.__init__), name
            continue
        assert inspect.isfunction(vars(group_cls).get(name)), f"{group_cls.__name__}.{name} is not defined"
        assert _parameters(getattr(group_cls, name)) == _parameters(declared), name


def test_the_ray_group_is_its_only_controller_process():
    group = RankGroup.__new__(RankGroup)  # the controller-side members need no actors
    assert isinstance(group, RankCalls)
    assert group.is_controller and group.last_call_s == 0.0
    assert group.barrier() is None
    assert group.gather_to_controller({"digest": 1}) == [{"digest": 1}]
    assert group.from_controller(lambda: 7) == 7
    with group.controller_only(lambda: _Opened()) as opened:
        assert opened.entered


class _Opened:
    entered = False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        return False


def test_a_class_missing_a_member_is_not_a_rank_group():
    class CallsOnly:
        is_controller, last_call_s = True, 0.0

        def call_all(self, method, *args, **kwargs):
            return []

        def call_first(self, method, *args, **kwargs):
            return None

    assert not isinstance(CallsOnly(), RankCalls)


@pytest.fixture
def one_rank_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_spmd_group_calls_this_ranks_worker_and_rank_0_controls(one_rank_world):
    group = LocalGroup(TimedWorker())
    assert isinstance(group, RankCalls)
    assert group.is_controller
    assert group.call_all(Worker.train) == ["timed"]  # the override, called by name
    assert group.call_first(Worker.save) == "saved"
    assert group.last_call_s >= 0.0
    with pytest.raises(TypeError, match="is not a method of TimedWorker"):
        group.call_all(Other.train)
    group.barrier()
    assert group.gather_to_controller(("written", None)) == [("written", None)]
    assert group.from_controller(lambda: "chosen") == "chosen"

    def fails():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # raised on every rank, not only the controller
        group.from_controller(fails)


def test_the_runtime_package_exports_resolve_and_the_watchdog_imports_neither_ray_nor_torch():
    import megagrpo.runtime as runtime

    assert sorted(runtime.__all__) == sorted(runtime._MODULE_OF)
    assert runtime.RankGroup is RankGroup and runtime.FAULT_EXIT == 75
    code = "import sys, megagrpo.runtime.watchdog; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
