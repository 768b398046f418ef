"""The engine contract (``megagrpo.generation.engine``): the vLLM engine implements every method of the
Protocol with a signature the driver's calls fit, the registry names it and its layout, and the config
refuses an unknown engine, the old key, and settings the engine cannot serve (vLLM is not started)."""

import dataclasses
import inspect
import typing

import pytest

from megagrpo.config import ConfigError, GenerationConfig, load_config
from megagrpo.config.rollout import ENGINE_CAPABILITIES
from megagrpo.config.rules import engine_needs
from megagrpo.generation.engine import CAPABILITIES, ENGINES, RolloutEngine, StreamingEngine, engine_spec
from megagrpo.generation.vllm import VLLMEngine
from megagrpo.generation.vllm_layout import VLLM_LAYOUT, VLLMLayout

pytestmark = pytest.mark.unit


def _methods(protocol: type) -> list[str]:
    """The methods a Protocol declares itself (not those of ``Protocol`` or its bases)."""
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and name[0] != "_"]


def _parameters(function) -> list[tuple[str, object, object]]:
    # Making an actor class of it (ray.remote, as any run in this process does) adds Ray's tracing keyword.
    params = inspect.signature(function).parameters.values()
    return [(p.name, p.kind, p.default) for p in params if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("method", _methods(RolloutEngine))
def test_vllm_engine_implements_every_protocol_method_with_its_signature(method):
    implemented = getattr(VLLMEngine, method, None)
    assert callable(implemented), f"VLLMEngine lacks RolloutEngine.{method}"
    assert _parameters(implemented) == _parameters(getattr(RolloutEngine, method))


def test_the_protocols_declare_the_contract():
    # The names the driver, the sync and the colocated hand-over call: a method dropped from the Protocol
    # would leave a call the contract does not cover.
    assert set(_methods(RolloutEngine)) == {
        "cpu_threads",
        "node_id",
        "generate",
        "run_episodes",
        "close_episodes",
        "prompt_logprobs",
        "sleep",
        "wake_up",
        "load_adapter",
        "init_weight_sync",
        "receive_weights",
        "weight_layout",
        "param_shapes",
        "received_bytes",
        "receive_buffer_bytes",
        "shutdown_weight_sync",
    }
    streaming = {"submit", "advance", "abort", "set_version", "in_flight", "resume_from"}
    assert set(_methods(StreamingEngine)) == streaming
    assert issubclass(VLLMEngine, RolloutEngine)


def test_registry_names_the_config_engines_their_classes_and_layouts():
    names = typing.get_args(typing.get_type_hints(GenerationConfig)["engine"])
    assert sorted(names) == sorted(ENGINES)
    spec = engine_spec("vllm")
    assert spec.name == "vllm" and spec.load_class() is VLLMEngine
    assert spec.layout() is VLLM_LAYOUT and isinstance(VLLM_LAYOUT, VLLMLayout)
    # The sync asks the engines for their layout; plan asks the registry: the same one.
    assert VLLMEngine.weight_layout(object.__new__(VLLMEngine)) is spec.layout()
    assert VLLM_LAYOUT.padded_vocab(300) == 320 and VLLM_LAYOUT.placement("lm_head.weight").dim == 0
    for spec in ENGINES.values():
        assert spec.capabilities == ENGINE_CAPABILITIES[spec.name] <= set(CAPABILITIES), spec.name
        # "stream" is claimed exactly by a class that has every StreamingEngine method.
        streams = all(callable(getattr(spec.load_class(), m, None)) for m in _methods(StreamingEngine))
        assert ("stream" in spec.capabilities) == streams, spec.name


def test_unknown_engine_is_refused_naming_the_engines():
    with pytest.raises(ValueError, match=r"generation\.engine: unknown engine 'sglang'; engines: vllm"):
        engine_spec("sglang")
    with pytest.raises(ConfigError, match=r"generation\.engine: expected one of 'vllm', got str 'sglang'"):
        load_config(None, ["generation.engine=sglang"])


def test_the_old_key_names_its_new_name():
    with pytest.raises(ConfigError, match=r"generation\.backend: renamed to generation\.engine"):
        load_config(None, ["generation.backend=vllm"])


def test_engine_needs_names_the_keys_asking_for_each_capability():
    cfg = load_config(None)
    assert engine_needs(cfg, trainer=True) == {}
    asking = dataclasses.replace(
        cfg,
        generation=dataclasses.replace(cfg.generation, placement="colocated", engine_expert_parallel=True),
        grpo=dataclasses.replace(cfg.grpo, routing_replay="rollout"),
        env=dataclasses.replace(cfg.env, environment="guess_number"),
    )
    assert engine_needs(asking, trainer=True) == {
        "episodes": ("env.environment",),
        "expert_parallel": ("generation.engine_expert_parallel",),
        "sleep": ("generation.placement",),
        "routed_experts": ("grpo.routing_replay",),
    }
    # megagrpo eval's engines have no trainer beside them: they neither sleep nor replay routing.
    assert set(engine_needs(asking, trainer=False)) == {"episodes", "expert_parallel"}
    assert set(engine_needs(asking, trainer=True)) <= ENGINE_CAPABILITIES["vllm"]


def test_an_engine_without_a_capability_is_one_error_naming_the_keys(monkeypatch):
    load_config(None, ["generation.placement=colocated"])  # vLLM sleeps
    monkeypatch.setitem(ENGINE_CAPABILITIES, "vllm", frozenset())
    with pytest.raises(ConfigError) as info:
        load_config(None, ["generation.placement=colocated"])
    assert info.value.keys == ("generation.engine", "generation.placement")
    assert "engine 'vllm' cannot give its device memory back" in str(info.value)
