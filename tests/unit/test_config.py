"""Config loading: defaults, overrides, strict type/key checks, cross-field checks, save/load round trip."""

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megagrpo import config as config_module
from megagrpo.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    ParallelConfig,
    config_to_dict,
    load_config,
    save_config,
)
from megagrpo.parallel import backends

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [REPO / "configs" / "tiny_cpu.yaml", REPO / "configs" / "deepscaler" / "8k.yaml"]


def _error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------------------
# Loading and overrides
# ----------------------------------------------------------------------------------------------------------


def test_default_is_the_tiny_cpu_file():
    assert DEFAULT_CONFIG_PATH == REPO / "configs" / "tiny_cpu.yaml"
    cfg = load_config(None)
    assert cfg == load_config(DEFAULT_CONFIG_PATH)
    assert cfg.model.tiny is not None
    assert cfg.model.hf_dir is None
    assert cfg.model.dtype == "float32"
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 1)
    assert cfg.parallel.backend == "gloo"
    assert cfg.parallel.world_size == 2
    assert cfg.generation.num_engines == 1
    assert cfg.data.train_path is None
    assert cfg.data.synthetic_task == "arithmetic"
    assert cfg.rollouts_per_step == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations
    assert cfg.mini_batches_per_step * cfg.policy.mini_batch_size == cfg.rollouts_per_step


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_deepscaler_recipe_values():
    cfg = load_config(REPO / "configs" / "deepscaler" / "8k.yaml")
    assert cfg.model.hf_dir is not None
    assert cfg.model.tiny is None
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.seq_length == 8192
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations) == (128, 8)
    # NeMo-RL's grpo-deepscaler-1.5b-8K, as the file's head cites it.
    assert cfg.policy.lr == 2e-6 and cfg.policy.lr_warmup_steps == 50
    assert isinstance(cfg.policy.lr, float)
    assert cfg.rollouts_per_step // cfg.policy.mini_batch_size == 16  # optimizer steps per step
    assert cfg.generation.temperature == 1.0 and cfg.generation.gpu_memory_utilization == 0.6
    assert cfg.grpo.kl_coef == 0.0
    assert (cfg.grpo.clip_eps_low, cfg.grpo.clip_eps_high) == (0.2, 0.2)
    assert (cfg.grpo.num_steps, cfg.generation.placement, cfg.policy.offload) == (240, "colocated", "all")
    stages = [load_config(REPO / "configs" / "deepscaler" / f"{s}.yaml") for s in ("16k", "24k")]
    assert [c.grpo.num_steps for c in stages] == [290, 50]
    assert [(c.policy.lr, c.grpo.kl_coef, c.grpo.clip_eps_high) for c in stages] == [
        (2e-6, 0.001, 0.28),
        (5e-7, 0.0001, 0.28),
    ]
    assert cfg.reward.kind == "math_verify"
    assert cfg.parallel.world_size == cfg.cluster.gpus_per_node * cfg.cluster.num_nodes == 8
    assert "\\boxed{}" in cfg.data.template


def test_overrides_parse_int_float_bool_null():
    cfg = load_config(
        None,
        [
            "grpo.num_generations=8",
            "policy.lr=1e-6",  # no dot: plain PyYAML would read a string
            "policy.min_lr=0",  # int widened to float
            "parallel.use_distributed_optimizer=true",
            "grpo.behav_weight_cap=null",
            "grpo.off_policy_correction=none",
            "run_name=abc",
        ],
    )
    assert cfg.grpo.num_generations == 8
    assert type(cfg.grpo.num_generations) is int
    assert cfg.policy.lr == 1e-6
    assert type(cfg.policy.lr) is float
    assert cfg.policy.min_lr == 0.0
    assert type(cfg.policy.min_lr) is float
    assert cfg.parallel.use_distributed_optimizer is True
    assert cfg.grpo.behav_weight_cap is None
    assert load_config(None).grpo.behav_weight_cap is not None
    assert cfg.run_name == "abc"


def test_override_reaches_nested_section_and_replaces_null_parent(tmp_path):
    assert load_config(None, ["model.tiny.num_layers=4"]).model.tiny.num_layers == 4
    path = _write(tmp_path, "model:\n  hf_dir: /x\n  tiny: null\n  seq_length: 4096\n")
    cfg = load_config(path, ["model.hf_dir=null", "model.tiny.max_position_embeddings=4096"])
    assert cfg.model.hf_dir is None
    assert cfg.model.tiny.max_position_embeddings == 4096
    assert cfg.model.tiny.num_layers == config_module.TinyModelConfig().num_layers  # the rest are defaults


def test_missing_sections_take_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "model:\n  hf_dir: /some/model\n"))
    assert cfg.grpo == config_module.GRPOConfig()
    assert cfg.model.hf_dir == "/some/model"


# ----------------------------------------------------------------------------------------------------------
# Key and type errors
# ----------------------------------------------------------------------------------------------------------


def test_unknown_key_suggests_close_match():
    msg = _error(["grpo.num_generation=4"])
    assert "grpo.num_generation:" in msg
    assert "'num_generations'" in msg


def test_unknown_key_in_file_names_file(tmp_path):
    path = _write(tmp_path, "model:\n  tiny: {}\n  seq_lenght: 64\n")
    msg = _error([], path)
    assert str(path) in msg
    assert "model.seq_lenght" in msg
    assert "'seq_length'" in msg


def test_unknown_section_in_override():
    msg = _error(["gpro.num_generations=4"])
    assert "gpro" in msg
    assert "'grpo'" in msg


@pytest.mark.parametrize("override", ["grpo.num_generations", "=3", "grpo..seed=1", ".seed=1"])
def test_malformed_override(override):
    msg = _error([override])
    assert "malformed override" in msg
    assert repr(override) in msg


def test_override_into_scalar():
    msg = _error(["grpo.seed.x=1"])
    assert "grpo.seed:" in msg
    assert "cannot set a key inside it" in msg


def test_overrides_must_be_a_sequence_not_a_string():
    with pytest.raises(TypeError):
        load_config(None, "grpo.seed=1")


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("grpo.num_generations=2.5", "grpo.num_generations", "expected int, got float 2.5"),
        ("grpo.num_generations=true", "grpo.num_generations", "expected int, got bool True"),
        ("policy.lr=fast", "policy.lr", "expected float, got str 'fast'"),
        ("policy.lr=false", "policy.lr", "expected float, got bool False"),
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel", "expected bool, got int 1"),
        ("data.train_path=3", "data.train_path", "expected str or null, got int 3"),
        ("grpo.dual_clip=abc", "grpo.dual_clip", "expected float or null"),
        ("model.dtype=fp8", "model.dtype", "'float32', 'bfloat16', 'float16'"),
        ("grpo.kl_estimator=k4", "grpo.kl_estimator", "one of 'k1', 'k2', 'k3'"),
        ("parallel.backend=null", "parallel.backend", "got null"),
        ("grpo=3", "grpo", "expected a mapping"),
        ("model.tiny=[1, 2]", "model.tiny", "expected a mapping or null"),
    ],
)
def test_wrong_types(override, key, expected):
    msg = _error([override])
    assert f"{key}:" in msg
    assert expected in msg
    assert f"set by override {override.split('=')[0]}" in msg
    assert str(DEFAULT_CONFIG_PATH) in msg


def test_nested_error_keeps_its_own_key():
    msg = _error(["model.tiny.num_layers=x"])
    assert "model.tiny.num_layers: expected int" in msg


def test_missing_model_section(tmp_path):
    msg = _error([], _write(tmp_path, "run_name: x\n"))
    assert "model: required but missing" in msg


def test_yaml_syntax_error_and_non_mapping_top_level(tmp_path):
    path = _write(tmp_path, "model: [unclosed\n")
    msg = _error([], path)
    assert str(path) in msg
    assert "invalid YAML" in msg
    path.write_text("- a\n- b\n")
    assert "top level must be a mapping" in _error([], path)


# ----------------------------------------------------------------------------------------------------------
# Value and cross-field checks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "keys", "expected"),
    [
        (["parallel.tensor_model_parallel_size=0"], ["parallel.tensor_model_parallel_size"], ">= 1"),
        (["grpo.num_prompts_per_step=-1"], ["grpo.num_prompts_per_step"], ">= 1"),
        (["cluster.rank_call_timeout_s=0"], ["cluster.rank_call_timeout_s"], "finite and > 0"),
        (["parallel.collective_timeout_s=.inf"], ["parallel.collective_timeout_s"], "finite and > 0"),
        (
            ["parallel.tensor_model_parallel_size=3"],
            ["parallel.tensor_model_parallel_size", "model.tiny.num_attention_heads"],
            "must divide num_attention_heads 4",
        ),
        (
            ["parallel.tensor_model_parallel_size=4"],
            ["parallel.tensor_model_parallel_size", "model.tiny.num_query_groups"],
            "must divide num_query_groups 2",
        ),
        (
            ["parallel.pipeline_model_parallel_size=3"],
            ["parallel.pipeline_model_parallel_size", "model.tiny.num_layers"],
            "must divide num_layers 2",
        ),
        (
            ["parallel.context_parallel_size=2", "parallel.transformer_impl=local"],
            ["parallel.context_parallel_size", "parallel.transformer_impl"],
            "not 'local'",
        ),
        (
            ["parallel.context_parallel_size=2", "parallel.transformer_impl=torch"],
            ["parallel.context_parallel_size", "parallel.transformer_impl"],
            "needs transformer_impl 'transformer_engine', not 'torch'",
        ),
        (
            ["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=1"],
            ["parallel.sequence_parallel"],
            "tensor_model_parallel_size > 1",
        ),
        (
            ["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"],
            ["parallel.sequence_parallel", "parallel.transformer_impl"],
            "local norms refuse it",
        ),
        (
            ["parallel.expert_model_parallel_size=2"],
            ["parallel.expert_model_parallel_size"],
            "mixture-of-experts",
        ),
        (["grpo.clip_eps_low=0"], ["grpo.clip_eps_low"], "in (0, 1)"),
        (["grpo.clip_eps_high=1.0"], ["grpo.clip_eps_high"], "in (0, 1)"),
        (["grpo.dual_clip=1.0"], ["grpo.dual_clip"], "> 1"),
        (["grpo.loss=gspo"], ["grpo.loss_agg", "grpo.loss"], "set loss_agg: sequence"),
        (
            ["grpo.loss=gspo_token", "grpo.loss_agg=token"],
            ["grpo.loss_agg", "grpo.loss"],
            "mean over sequences",
        ),
        (
            ["grpo.loss=gspo", "grpo.loss_agg=sequence"],
            ["grpo.off_policy_correction", "grpo.loss"],
            "sequence-level ratio",
        ),
        (
            ["grpo.loss=cispo", "grpo.dual_clip=3"],
            ["grpo.dual_clip", "grpo.loss"],
            "does not define it",
        ),
        (["grpo.loss=cispo", "grpo.clip_eps_low=1.5"], ["grpo.clip_eps_low"], "in (0, 1] with loss cispo"),
        (["grpo.loss=cispo", "grpo.clip_eps_high=0"], ["grpo.clip_eps_high"], "> 0 with loss cispo"),
        (["grpo.loss=ppo"], ["grpo.loss"], "grpo"),
        (
            ["grpo.baseline=reinforce_pp", "grpo.filter_zero_variance_groups=true"],
            ["grpo.filter_zero_variance_groups", "grpo.baseline"],
            "use reinforce_pp_baseline",
        ),
        (["grpo.num_generations=1"], ["grpo.num_generations"], ">= 2"),
        (
            ["policy.mini_batch_size=5", "grpo.num_prompts_per_step=4", "grpo.num_generations=4"],
            ["policy.mini_batch_size", "grpo.num_prompts_per_step", "grpo.num_generations"],
            "must divide num_prompts_per_step * num_generations = 16",
        ),
        (
            ["parallel.data_parallel_size=3", "policy.mini_batch_size=4"],
            ["policy.mini_batch_size", "parallel.data_parallel_size"],
            "divisible by data_parallel_size 3",
        ),
        (["generation.top_p=0"], ["generation.top_p"], "in (0, 1]"),
        (["generation.top_p=1.5"], ["generation.top_p"], "in (0, 1]"),
        (["generation.top_k=0"], ["generation.top_k"], "-1 (off) or >= 1"),
        (["generation.temperature=0"], ["generation.temperature"], "> 0"),
        (["generation.probe_max_error=0.99"], ["generation.probe_max_error"], ">= 1"),
        (
            ["generation.max_new_tokens=256"],
            ["generation.max_new_tokens", "model.seq_length"],
            "no room for a prompt",
        ),
        (
            ["generation.engine_tensor_parallel_size=3"],
            ["generation.engine_tensor_parallel_size"],
            "must divide num_attention_heads",
        ),
        (
            ["policy.micro_batch_max_tokens=100"],
            ["policy.micro_batch_max_tokens", "model.seq_length"],
            "cannot hold one sequence",
        ),
        (["policy.min_lr=1.0"], ["policy.min_lr"], "min_lr <= lr"),
        (["policy.adam_beta2=1.0"], ["policy.adam_beta2"], "in [0, 1)"),
        (["model.tiny=null"], ["model.hf_dir", "model.megatron_ckpt", "model.tiny"], "no model given"),
        (["model.hf_dir=/m"], ["model.tiny", "model.hf_dir"], "not both"),
        (
            ["model.tiny=null", "model.megatron_ckpt=/ckpt"],
            ["model.hf_dir"],
            "megatron_ckpt needs hf_dir",
        ),
        (
            ["model.seq_length=512"],
            ["model.tiny.max_position_embeddings", "model.seq_length"],
            "max_position_embeddings 256 < seq_length 512",
        ),
        (
            ["model.tiny.num_query_groups=3"],
            ["model.tiny.num_attention_heads", "model.tiny.num_query_groups"],
            "must divide",
        ),
        (
            ["grpo.overlong_policy=soft_penalty"],
            ["grpo.overlong_buffer_tokens", "grpo.overlong_policy"],
            "needs overlong_buffer_tokens >= 1",
        ),
        (
            [
                "grpo.overlong_policy=soft_penalty",
                "grpo.overlong_buffer_tokens=16",
                "generation.max_new_tokens=16",
            ],
            ["grpo.overlong_buffer_tokens", "generation.max_new_tokens"],
            "must be < max_new_tokens 16",
        ),
        (["grpo.behav_weight_cap=0.5"], ["grpo.behav_weight_cap"], "finite, >= 1 or null"),
        (
            [
                "checkpoint.dir=null",
                "checkpoint.export_hf_at_end=false",
                "checkpoint.save_every=0",
                "checkpoint.resume=true",
            ],
            ["checkpoint.resume", "checkpoint.dir"],
            "needs dir",
        ),
        (
            ["checkpoint.dir=null", "checkpoint.export_hf_at_end=false", "checkpoint.save_every=5"],
            ["checkpoint.save_every", "checkpoint.dir"],
            "needs dir",
        ),
        (
            ["logging.val_every=2", "data.num_val_prompts=0"],
            ["logging.val_every", "data.num_val_prompts"],
            "num_val_prompts is 0",
        ),
        (["parallel.backend=nccl"], ["parallel.backend", "cluster.gpus_per_node"], "needs GPUs"),
        (
            ["generation.placement=colocated", "generation.num_engines=3"],
            ["generation.placement", "generation.num_engines", "parallel.world_size"],
            "at most 2 engines for 2 ranks",
        ),
        (
            [
                "cluster.gpus_per_node=8",
                "generation.placement=colocated",
                "generation.engine_tensor_parallel_size=2",
                "model.tiny.num_attention_heads=4",
            ],
            ["generation.placement", "generation.engine_tensor_parallel_size"],
            "must be 1",
        ),
        (
            ["cluster.gpus_per_node=1", "generation.placement=disaggregated"],
            ["parallel.data_parallel_size", "generation.num_engines", "cluster.gpus_per_node"],
            "needs 3 GPUs",
        ),
        (["data.template=no placeholder"], ["data.template"], "{prompt}"),
        (["run_name=a/b"], ["run_name"], "letters, digits"),
    ],
)
def test_invalid_values(overrides, keys, expected):
    msg = _error(overrides)
    for key in keys:
        assert key in msg
    assert expected in msg


def test_context_parallel_auto_depends_on_transformer_engine(monkeypatch):
    overrides = ["parallel.context_parallel_size=2", "parallel.transformer_impl=auto"]
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: False)
    msg = _error(overrides)
    assert "parallel.context_parallel_size" in msg
    assert "'auto' resolves to 'torch' here: transformer_engine is not importable" in msg
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: True)
    cfg = load_config(None, overrides)
    assert cfg.parallel.context_parallel_size == 2
    assert cfg.resolved.transformer_impl == "transformer_engine"
    msg = _error([*overrides, "grpo.loss_agg=sequence"])
    assert "grpo.loss_agg" in msg and "needs loss_agg 'token'" in msg


def test_sequence_parallel_with_the_torch_layers_loads():
    cfg = load_config(
        None,
        [
            "parallel.sequence_parallel=true",
            "parallel.tensor_model_parallel_size=2",
            "parallel.transformer_impl=torch",
        ],
    )
    assert cfg.parallel.sequence_parallel and cfg.resolved.transformer_impl == "torch"


def test_context_parallel_needs_seq_length_divisible_by_2cp():
    msg = _error(["parallel.context_parallel_size=3", "parallel.transformer_impl=transformer_engine"])
    assert "parallel.context_parallel_size" in msg
    assert "model.seq_length" in msg
    assert "2 * context" in msg


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_eps_low", "0.0"),
        ("clip_eps_high", "1.5"),
        ("dual_clip", "1.0"),
        ("kl_coef", "-0.1"),
        ("kl_coef", ".inf"),
        ("kl_estimator", "k4"),
        ("behav_weight_cap", "0.5"),
        ("behav_weight_cap", ".inf"),
        ("off_policy_correction", "ppo"),
        ("loss_agg", "batch"),
        ("kl_clamp", "0.0"),
        ("kl_clamp", ".inf"),
        ("baseline", "median"),
    ],
)
def test_loss_knobs_are_checked_at_load(field, value):
    # Moved from test_grpo_loss.py: the loss takes these as given, the config checks them once.
    with pytest.raises(ValueError, match=rf"grpo\.{field}: (must be|expected)"):
        load_config(None, [f"grpo.{field}={value}"])


def test_auto_backend_and_layers_are_decided_once_at_load(monkeypatch):
    overrides = ["parallel.backend=auto", "parallel.transformer_impl=auto"]
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: False)
    cfg = load_config(None, overrides)
    assert (cfg.resolved.backend, cfg.resolved.transformer_impl) == ("nccl", "torch")
    assert cfg.resolved.packs_sequences  # the torch layers pack sequences (THD) with sequence_packing auto
    # What another process (a rank) would probe does not change the loaded config, which travels pickled.
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: True)
    back = pickle.loads(pickle.dumps(cfg))
    assert (back.resolved.backend, back.resolved.transformer_impl) == ("nccl", "torch")
    # Not keys: a saved config keeps "auto", and loading it decides again.
    saved = config_to_dict(cfg)
    assert (saved["parallel"]["backend"], saved["parallel"]["transformer_impl"]) == ("auto", "auto")
    assert "resolution" not in saved and not any(key.startswith("resolved") for key in saved["parallel"])
    again = load_config(None, overrides)
    assert (again.resolved.backend, again.resolved.transformer_impl) == ("gloo", "transformer_engine")
    assert again == cfg  # the decision is not part of the config's value
    assert "unknown key" in _error(["parallel.resolved_backend=nccl"])
    assert "unknown section" in _error(["resolution.backend=nccl"])


def test_explicit_backend_and_layers_are_taken_as_given(monkeypatch):
    # A config may name what only the trainer's machines have; the ranks check it when they use it.
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "transformer_engine_available", lambda: False)
    cfg = load_config(SHIPPED[1], ["parallel.transformer_impl=transformer_engine"])
    assert (cfg.resolved.backend, cfg.resolved.transformer_impl) == ("nccl", "transformer_engine")
    cfg = load_config(None)
    assert (cfg.resolved.backend, cfg.resolved.transformer_impl) == ("gloo", "local")


def test_loading_without_auto_does_not_import_torch():
    code = "import sys; import megagrpo.config as c; c.load_config(None); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_generation_timeout_has_its_own_key():
    default = config_module.GenerationConfig()
    assert default.timeout_s == 10 * default.sync_timeout_s == 6000.0  # what the driver waited before
    for path in SHIPPED:  # the shipped files keep their 10 x sync_timeout_s
        gen = load_config(path).generation
        assert gen.timeout_s == 10 * gen.sync_timeout_s
    assert load_config(None, ["generation.timeout_s=30"]).generation.timeout_s == 30.0
    msg = _error(["generation.timeout_s=0"])
    assert "generation.timeout_s" in msg and "> 0" in msg


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(TypeError):
        ParallelConfig(2)  # keyword-only


def test_config_is_frozen():
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grpo.num_generations = 3  # type: ignore[misc]


def test_config_error_is_picklable_value_error():
    err = ConfigError(("a.b", "c.d"), "bad", "f.yaml")
    assert isinstance(err, ValueError)
    assert str(err) == "f.yaml: a.b, c.d: bad"
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err)
    assert back.keys == err.keys
    assert back.source == "f.yaml"


# ----------------------------------------------------------------------------------------------------------
# Plain data; "auto" resolved once; one validation per trainer
# ----------------------------------------------------------------------------------------------------------


def _tiny(**sections) -> Config:
    """A Config built in Python, as tests and benchmarks do (not resolved, not validated)."""
    model = config_module.ModelConfig(tiny=config_module.TinyModelConfig(), seq_length=128)
    generation = config_module.GenerationConfig(max_new_tokens=64)
    return Config(model=model, **{"generation": generation, **sections})


def _no_probe(monkeypatch) -> None:
    def probe():
        raise AssertionError("the machine was probed")

    for name in ("cuda_available", "transformer_engine_available", "torch_layers_available"):
        monkeypatch.setattr(backends, name, probe)


@pytest.fixture
def noisy_reward(tmp_path):
    """(reward.function spec, the file its module writes when it is imported)."""
    marker = tmp_path / "imported"
    module = tmp_path / "noisy_reward.py"
    module.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n\n"
        "def reward(response, answer):\n    return float(response == answer)\n"
    )
    return f"{module}:reward", marker


def test_building_and_replacing_a_config_loads_no_user_code(noisy_reward):
    spec, marker = noisy_reward
    cfg = _tiny(reward=config_module.RewardConfig(kind="python", function=spec))
    cfg = dataclasses.replace(cfg, run_name="other", reward=dataclasses.replace(cfg.reward, num_workers=2))
    assert not marker.exists()
    # A trainer that scores nothing does not import it at load either.
    overrides = ["reward.kind=python", f"reward.function={spec}"]
    sft = load_config(None, overrides, trainer="sft")
    assert sft.reward.function == spec and not marker.exists()
    # The validation for a trainer that scores is what imports and checks it.
    config_module.validate(config_module.resolve(cfg), "grpo")
    assert marker.read_text() == "yes"


def test_a_user_reward_is_checked_by_the_validation_naming_the_file(tmp_path):
    module = tmp_path / "bad_reward.py"
    module.write_text("def reward(response):\n    return 1.0\n")
    cfg = _tiny(reward=config_module.RewardConfig(kind="python", function=f"{module}:reward"))
    with pytest.raises(ConfigError, match=r"^reward\.function: .*must accept"):
        config_module.validate(config_module.resolve(cfg), "grpo")
    config_module.validate(config_module.resolve(cfg), "sft")  # SFT scores nothing
    text = "model:\n  tiny: {}\n  seq_length: 128\ngeneration:\n  max_new_tokens: 64\n"
    path = _write(tmp_path, f"{text}reward:\n  kind: python\n  function: {module}:reward\n")
    msg = _error([], path)
    assert msg.startswith(f"{path}: reward.function: ") and "must accept" in msg


def test_building_and_replacing_a_config_probes_nothing(monkeypatch):
    _no_probe(monkeypatch)
    cfg = _tiny(parallel=ParallelConfig(backend="auto", transformer_impl="auto"))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_size=2))
    assert cfg.resolution is None
    with pytest.raises(RuntimeError, match=r"never resolved.*megagrpo\.config\.resolve\(\)"):
        cfg.resolved  # noqa: B018  (a rank acting on a config nobody resolved fails here, loudly)
    with pytest.raises(RuntimeError, match="never resolved"):
        config_module.validate(cfg, "grpo")  # the layer checks need the resolved layers


def test_resolve_decides_once_and_replace_decides_nothing(monkeypatch):
    def machine(cuda: bool, te: bool) -> None:
        monkeypatch.setattr(backends, "cuda_available", lambda: cuda)
        monkeypatch.setattr(backends, "transformer_engine_available", lambda: te)
        monkeypatch.setattr(backends, "torch_layers_available", lambda: True)

    machine(cuda=False, te=False)
    cfg = config_module.resolve(_tiny(parallel=ParallelConfig(backend="auto", transformer_impl="auto")))
    assert cfg.resolved == config_module.Resolved(
        backend="gloo",
        transformer_impl="torch",
        packs_sequences=True,
        settings=("auto", "auto", "auto", 1),
    )
    _no_probe(monkeypatch)
    grpo = dataclasses.replace(cfg.grpo, num_steps=3)
    changed = dataclasses.replace(cfg, run_name="again", grpo=grpo, data=dataclasses.replace(cfg.data))
    assert changed.resolved is cfg.resolved  # carried as it is: nothing decided again
    # Changing a setting a decision was made from makes the record stale: it is refused, not reused.
    local = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, transformer_impl="local"))
    again = r"decided from .*: pass the changed config through megagrpo\.config\.resolve\(\) again"
    with pytest.raises(RuntimeError, match=again):
        local.resolved  # noqa: B018
    padded = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, sequence_packing="off"))
    with pytest.raises(RuntimeError, match="decided from"):
        padded.resolved  # noqa: B018
    # resolve() is the one place that decides: on another machine, it decides for that machine.
    machine(cuda=True, te=True)
    elsewhere = config_module.resolve(local).resolved
    assert (elsewhere.backend, elsewhere.transformer_impl) == ("nccl", "local")
    assert config_module.resolve(padded).resolved.packs_sequences is False


def test_an_sft_config_without_a_generation_section_loads(tmp_path):
    text = (REPO / "configs" / "tiny_sft.yaml").read_text()
    assert "generation:" not in text
    cfg = load_config("tiny_sft", trainer="sft")
    assert cfg.generation == config_module.GenerationConfig()  # defaults, unread by SFT
    assert cfg.generation.max_new_tokens >= cfg.model.seq_length
    # The same config is no GRPO run: GRPO's length rule applies to GRPO only.
    msg = _error([], REPO / "configs" / "tiny_sft.yaml")
    assert "generation.max_new_tokens, model.seq_length: " in msg and "no room for a prompt" in msg
    # Nor do GRPO's batching rules apply to SFT: policy.mini_batch_size is the GRPO mini-batch.
    load_config("tiny_sft", ["policy.mini_batch_size=7"], trainer="sft")
    assert "policy.mini_batch_size" in _error(["policy.mini_batch_size=7"])


@pytest.mark.parametrize(
    ("config", "trainer", "overrides", "keys", "expected"),
    [
        (
            "tiny_sft",
            "sft",
            ["parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2", "sft.batch_size=1"],
            ["sft.batch_size", "parallel.data_parallel_size"],
            "without data",
        ),
        ("tiny_sft", "sft", ["policy.micro_batch_max_tokens=100"], ["model.seq_length"], "one sequence"),
        ("tiny_dpo", "dpo", ["policy.micro_batch_max_tokens=300"], ["model.seq_length"], "hold a pair"),
        (
            "tiny_dpo",
            "dpo",
            ["parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2", "warmup.batch_size=1"],
            ["warmup.batch_size", "parallel.data_parallel_size"],
            "without data",
        ),
        ("tiny_cpu", "warmup", ["warmup.steps=0"], ["warmup.steps"], "nothing to run"),
        ("tiny_cpu", "warmup", ["model.tiny=null", "model.hf_dir=/m"], ["model.tiny"], "tiny model only"),
        (
            "tiny_cpu",
            "eval",
            ["model.tiny=null", "model.hf_dir=/m", "eval.max_new_tokens=256"],
            ["eval.max_new_tokens", "model.seq_length"],
            "no room for a prompt",
        ),
    ],
)
def test_each_trainer_checks_what_it_uses_naming_the_file(config, trainer, overrides, keys, expected):
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides, trainer=trainer)
    msg = str(info.value)
    assert info.value.source is not None and msg.startswith(info.value.source + ": ")
    assert all(key in msg for key in keys) and expected in msg


def test_eval_does_not_check_the_trainer_layout():
    # megagrpo eval starts engines only: the policy's batching and layers are not its concern.
    overrides = ["model.tiny=null", "model.hf_dir=/m", "policy.mini_batch_size=7"]
    overrides += ["policy.micro_batch_max_tokens=8"]
    assert load_config(None, overrides, trainer="eval").policy.mini_batch_size == 7
    with pytest.raises(ValueError, match="trainer must be one of grpo, distill, sft, dpo, eval, warmup"):
        load_config(None, trainer="train")


# ----------------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_save_load_round_trip(tmp_path, path):
    cfg = load_config(path, ["grpo.seed=7"])
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.yaml"]  # no temp file left behind


def test_config_to_dict_is_plain_yaml():
    cfg = load_config(None)
    data = config_to_dict(cfg)
    assert data["parallel"]["tensor_model_parallel_size"] == 2
    assert data["model"]["tiny"]["num_layers"] == cfg.model.tiny.num_layers
    assert yaml.safe_load(yaml.safe_dump(data)) == data


def test_save_overwrites_existing_file(tmp_path):
    out = tmp_path / "config.yaml"
    save_config(load_config(None), out)
    save_config(load_config(None, ["grpo.seed=3"]), out)
    assert load_config(out).grpo.seed == 3


def test_node_labels_need_a_cluster_and_disaggregated_engines():
    err = _error(["cluster.policy_resource=trainer_node"])
    assert "cluster.policy_resource" in err and "cluster.ray_address" in err
    err = _error(
        [
            "cluster.ray_address=10.0.0.1:6379",
            "cluster.engine_resource=engine_node",
            "cluster.gpus_per_node=8",
            "generation.placement=colocated",
        ]
    )
    assert "cluster.engine_resource" in err and "generation.placement" in err
    assert "cluster.policy_resource" in _error(["cluster.ray_address=auto", "cluster.policy_resource=GPU"])
    cfg = load_config(
        None,
        ["cluster.ray_address=auto", "cluster.policy_resource=trainer", "cluster.engine_resource=engine"],
    )
    assert (cfg.cluster.policy_resource, cfg.cluster.engine_resource) == ("trainer", "engine")


def test_the_probe_bound_follows_the_dtype_unless_set():
    from megagrpo.weight_sync.sync import probe_bound

    assert probe_bound(load_config("tiny_cpu")) == 1.001  # float32
    assert probe_bound(load_config("tiny_cpu", ["model.dtype=bfloat16"])) == 1.05
    assert (
        probe_bound(load_config("tiny_cpu", ["model.dtype=bfloat16", "generation.probe_max_error=1.2"]))
        == 1.2
    )
