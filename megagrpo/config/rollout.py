"""What rollouts and evaluation read: ``generation`` (the vLLM engines and the weight sync), ``data``,
``reward`` and ``eval``.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

from megagrpo.config.errors import check, positive, require

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "CAPABILITIES",
    "ENGINE_CAPABILITIES",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "GenerationConfig",
    "RewardConfig",
]


@dataclass(kw_only=True, frozen=True)
class GenerationConfig:
    """Rollout engines (``engine``: vLLM) and the weight sync from the trainer to them."""

    engine: Literal["vllm"] = "vllm"
    """Rollout engine (megagrpo.generation.engine.ENGINES): "vllm". The config's checks refuse settings the
    engine cannot serve (colocated sleep, episodes, routed experts, expert parallelism) before any
    process starts."""
    num_engines: int = 1
    """Number of independent engine instances (each on engine_tensor_parallel_size devices)."""
    engine_tensor_parallel_size: int = 1
    """Tensor parallel size inside one engine."""
    engine_expert_parallel: bool = False
    """Mixture-of-experts models: vLLM's expert parallelism inside each engine (``enable_expert_parallel``):
    each of its engine_tensor_parallel_size workers holds num_experts / TP experts whole instead of
    every expert's 1 / TP slice; the weight sync sends each expert to the worker that holds it."""
    temperature: float = 1.0
    """Sampling temperature; must be > 0 since GRPO needs diverse samples per prompt."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 1024
    """Maximum response length; must be < model.seq_length to leave room for the prompt."""
    seed: int = 0
    """Engine sampling seed."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may claim (weights + KV cache), in (0, 1]."""
    cpu_kvcache_space_gib: int | None = None
    """KV-cache size for vLLM's CPU backend in GiB; null keeps vLLM's default."""
    enforce_eager: bool = False
    """Disable CUDA graphs in vLLM (slower decode, faster start, less memory)."""
    max_num_seqs: int | None = None
    """Sequences one engine decodes at once (vLLM's max_num_seqs). null: vLLM's default, except on its
    CPU build, whose default (256 per engine TP rank) would decode a larger step in waves: there, at
    least one step's rollouts per engine."""
    ignore_eos: bool = False
    """Training rollouts run to max_new_tokens past EOS and stop tokens (a fixed amount of work per step,
    for benchmarks; rewards score the whole text). Validation and `megagrpo eval` stop as usual."""
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    """Engines share the trainer's devices (sleeping during training), or run on devices of their own."""
    sync_bucket_mb: float = 512.0
    """Size of the buckets weights are sent to the engines in, in MiB."""
    weight_sync_path: Literal["auto", "gathered"] = "auto"
    """auto: shard-wise where the TP layouts allow it (weight_sync.shards), else gathered; gathered: always"""
    sync_mode: Literal["full", "delta"] = "full"
    """full: every sync sends every bucket whole; delta: after a first full sync, each bucket goes as the
    elements whose bytes changed (int32 index + value, weight_sync.delta), senders and engines keeping the
    last bytes in host memory; digests still prove the engines' bytes equal the trainer's."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With policy.lora: merged = each sync sends the base with the adapters merged in (the full weights'
    bytes); adapter = the first sync after the engines start sends the base, each later one the adapters
    alone, which the engines apply with vLLM's LoRA support (one adapter, replaced in place at each sync:
    megagrpo.generation.vllm_lora)."""
    sync_delta_max_fraction: float = 0.25
    """sync_mode delta: a bucket with more than this fraction of its elements changed is sent whole
    (a bf16 delta costs 6 bytes per changed element: 0.25 changed is 75% of the whole bucket), in (0, 1]."""
    probe_max_error: float | None = None
    """Largest mean exp|logprob delta| between trainer and engines the post-sync probe tolerates (>= 1).
    null: by model.dtype: float32 1.001 (kernels agree to ~1e-7: measured 1.0000002 on CPU);
    bfloat16/float16 1.05, the bound the peers gate bf16 runs on (NeMo-RL's nightly tests: median
    token_mult_prob_error < 1.05), since bf16 kernels differ by their rounding; measured here at most 1.007
    (vLLM CPU, tiny model) and 1.021 (Megatron against transformers at Qwen2-1.5B's shape on an H200),
    benchmarks/probe_bf16.py.
    A wrong sync is caught exactly by the bucket digests every sync checks; this bound is the numerics."""
    sync_timeout_s: float = 600.0
    """Seconds one wait of a weight sync may take (connecting a link's group, a bucket's broadcast or
    handoff, on the sender and on each engine; a colocated engine's sleep/wake-up) before it fails naming
    the link; the controller allows the whole sync 1.5x as long."""
    timeout_s: float = 6000.0
    """Seconds to wait for one engine's completions of a generate call before it counts as failed."""
    stream_slice_s: float = 0.25
    """grpo.async_mode partial: seconds of generation an engine runs per call of the driver's pump; a
    weight sync waits at most this long for the engines to reach a token boundary."""
    stream_kv: Literal["keep", "recompute"] = "keep"
    """grpo.async_mode partial, at a weight swap: keep = requests in flight decode on over the KV cache
    their prefix had under the old weights (free); recompute = they are prefilled again (prompt and tokens
    so far) with the new weights before their next token (``megagrpo.generation.stream``)."""
    max_engine_restarts: int = 2
    """Engine restarts allowed per engine_restart_window_steps; one failure more checkpoints and stops."""
    engine_restart_window_steps: int = 100
    """Restarts older than this many GRPO steps no longer count against max_engine_restarts; 0 counts all."""

    def __post_init__(self) -> None:
        positive(self, "num_engines", "engine_tensor_parallel_size", "max_new_tokens")
        check(self, "max_num_seqs", self.max_num_seqs is None or self.max_num_seqs >= 1, ">= 1 or null")
        check(self, "sync_bucket_mb", self.sync_bucket_mb > 0, "> 0")
        check(self, "temperature", self.temperature > 0, "> 0")
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check(self, "top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1")
        check(self, "gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        check(
            self,
            "cpu_kvcache_space_gib",
            self.cpu_kvcache_space_gib is None or self.cpu_kvcache_space_gib >= 1,
            ">= 1 or null",
        )
        check(
            self, "probe_max_error", self.probe_max_error is None or self.probe_max_error >= 1, ">= 1 or null"
        )
        check(self, "sync_timeout_s", self.sync_timeout_s > 0, "> 0")
        check(self, "sync_delta_max_fraction", 0 < self.sync_delta_max_fraction <= 1, "in (0, 1]")
        check(self, "timeout_s", self.timeout_s > 0, "> 0")
        check(self, "stream_slice_s", 0 < self.stream_slice_s <= self.timeout_s, "> 0 and <= timeout_s")
        check(self, "max_engine_restarts", self.max_engine_restarts >= 0, ">= 0")
        check(
            self,
            "engine_restart_window_steps",
            self.engine_restart_window_steps >= 0,
            ">= 0 (0: the whole run)",
        )


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Prompts and reference answers."""

    train_path: str | None = None
    """Training records (.jsonl, .json array or .parquet): GRPO prompts with answers, SFT conversations
    or DPO pairs; null uses synthetic_task."""
    val_path: str | None = None
    """Validation records; null draws them from synthetic_task (or holds none if train_path is set)."""
    prompt_key: str = "problem"
    """Record field holding the question."""
    answer_key: str = "answer"
    """Record field holding the reference answer given to the reward."""
    synthetic_task: Literal["arithmetic", "math", "agent"] = "arithmetic"
    """Generated task used when train_path is null: "arithmetic" (a+b over a character vocabulary),
    "math" (SFT only: worked solutions of generated math problems, megagrpo.data.math_problems; a tiny
    model then gets a BPE tokenizer trained on such problems) or "agent" (SFT only: conversations that
    answer arithmetic questions, some through the python tool, megagrpo.envs.code_tool.tool_use_records;
    a tiny model then gets the Qwen-style tool chat tokenizer, megagrpo.envs.chat.tool_chat_tokenizer)."""
    agent_tool_frac: float = 0.3
    """synthetic_task agent: share of the conversations that call the python tool."""
    arithmetic_max_operand: int = 99
    """Synthetic arithmetic: operands are drawn uniformly from [0, arithmetic_max_operand]."""
    arithmetic_ops: str = "+-"
    """Synthetic arithmetic: operators to draw from (any of "+-*")."""
    math_terse_frac: float = 0.0
    """Synthetic math SFT: share of the worked solutions that give the boxed answer alone, without the
    steps (a model made from such data answers some problems at once and works others through; the CPU
    twin's made model uses none, see benchmarks/results/twin_sweep.md)."""
    math_unboxed_frac: float = 0.0
    """Synthetic math SFT: share of the other worked solutions that end in the answer without
    \\boxed{} (the math reward scores such a response 0: a made model then loses reward to format, as
    a real one does at first, and GRPO has a behaviour to learn)."""
    num_val_prompts: int = 0
    """Validation prompts evaluated every logging.val_every steps; 0 disables validation."""
    template: str = "{prompt}"
    """Prompt text; the literal `{prompt}` is replaced (str.replace, so braces like \\boxed{} are kept)."""
    apply_chat_template: bool = False
    """GRPO: wrap the templated prompt in the tokenizer's chat template as a single user turn. SFT/DPO:
    render conversations with the chat template (loss on assistant tokens only); false: plain prompt
    text followed by the response and EOS."""
    messages_key: str = "messages"
    """SFT/DPO: record field holding a conversation (a list of {role, content}); rows without it use
    prompt_key and response_key (SFT) or prompt_key, chosen_key and rejected_key (DPO)."""
    response_key: str = "response"
    """SFT: record field holding the response to the prompt (prompt_key)."""
    chosen_key: str = "chosen"
    """DPO: record field holding the preferred response (a string or a list of assistant messages)."""
    rejected_key: str = "rejected"
    """DPO: record field holding the dispreferred response (a string or a list of assistant messages)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A row with a missing, empty or wrongly typed field (GRPO, eval, SFT, DPO), bytes that are not UTF-8,
    a text too long in characters for its token budget (checked before tokenizing), a pair whose chosen
    equals rejected, or an SFT/DPO sequence longer than model.seq_length stops the run naming file and row
    ("error"), or is left out and counted in the metrics ("skip"). GRPO prompts too long in tokens for
    the context are always skipped and counted (data/skipped_long_prompts)."""

    def __post_init__(self) -> None:
        require("{prompt}" in self.template, "template", f"must contain '{{prompt}}', got {self.template!r}")
        keys = ("prompt_key", "answer_key", "messages_key", "response_key", "chosen_key", "rejected_key")
        for name in keys:
            require(bool(getattr(self, name)), name, "must not be empty")
        check(self, "num_val_prompts", self.num_val_prompts >= 0, ">= 0")
        check(self, "math_terse_frac", 0.0 <= self.math_terse_frac <= 1.0, "in [0, 1]")
        check(self, "math_unboxed_frac", 0.0 <= self.math_unboxed_frac <= 1.0, "in [0, 1]")
        check(self, "agent_tool_frac", 0.0 <= self.agent_tool_frac <= 1.0, "in [0, 1]")
        check(self, "arithmetic_max_operand", 1 <= self.arithmetic_max_operand <= 9999, "in [1, 9999]")
        check(
            self,
            "arithmetic_ops",
            bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"),
            'a non-empty string of operators from "+-*"',
        )


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """How responses are scored."""

    kind: Literal["math_verify", "arithmetic", "python"] = "math_verify"
    """math_verify: symbolic equivalence of the last \\boxed{} answer; arithmetic: exact integer match;
    python: reward.function."""
    function: str | None = None
    """kind python: "package.module:function" or "path/to/file.py:function" (relative to the working
    directory), called as function(response, answer) -> float; imported and checked by the validation at
    load (megagrpo.config.rules), not when the config is built."""
    num_workers: int = 4
    """Worker processes scoring responses in parallel (math_verify, python)."""
    timeout_s: float = 5.0
    """Deadline of one response's scoring from when a worker starts it; past it the response scores 0 and
    the worker is killed and replaced (math_verify, python)."""
    format_reward: float = 0.0
    """math_verify: reward of a wrong answer given in a complete final \\boxed{} (a correct one scores 1,
    no box 0); in [0, 1), 0 disables it."""
    import_timeout_s: float = 120.0
    """kind python: deadline of importing function's module in a child process at load; a module that
    takes longer (or exits, or raises) is refused naming it."""

    def __post_init__(self) -> None:
        positive(self, "num_workers")
        check(self, "timeout_s", math.isfinite(self.timeout_s) and self.timeout_s > 0, "finite and > 0")
        check(self, "format_reward", 0 <= self.format_reward < 1, "in [0, 1)")
        check(self, "import_timeout_s", 0 < self.import_timeout_s < math.inf, "finite and > 0")
        require(
            self.format_reward == 0 or self.kind == "math_verify",
            ("format_reward", "kind"),
            "format_reward applies to kind 'math_verify' only",
        )
        if self.kind != "python":
            require(self.function is None, ("function", "kind"), "function is used with kind 'python' only")
            return
        require(self.function is not None, ("function", "kind"), "kind 'python' needs a function")


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """pass@k evaluation (``megagrpo eval``) and the sampled part of GRPO's validation (megagrpo.evaluate)."""

    path: str | None = None
    """Problems to evaluate (.jsonl, .json or .parquet with data.prompt_key / data.answer_key); null:
    data.val_path."""
    num_problems: int = 0
    """Evaluate the first this many problems; 0: all of them."""
    num_samples: int = 16
    """Samples per problem (n): pass@1 is averaged over them, pass@k reported for k = 1, 2, 4, ... n."""
    temperature: float = 0.6
    """Sampling temperature (DeepScaleR's AIME protocol: 0.6)."""
    top_p: float = 0.95
    """Nucleus sampling mass (DeepScaleR's AIME protocol: 0.95)."""
    max_new_tokens: int | None = None
    """Response budget; null: generation.max_new_tokens."""
    seed: int = 0
    """Sampling seed (per problem, so results do not depend on batching)."""
    val_samples: int = 0
    """GRPO validation: also sample this many responses per validation prompt with the settings above
    and log val/pass@k (k = 1, 2, 4, ...); 0: only the greedy val/accuracy."""

    def __post_init__(self) -> None:
        check(self, "num_problems", self.num_problems >= 0, ">= 0 (0: all)")
        positive(self, "num_samples")
        check(self, "temperature", self.temperature > 0, "> 0")
        check(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        check(self, "max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1, ">= 1 or null")
        check(self, "val_samples", self.val_samples >= 0, ">= 0")


CAPABILITIES = {
    "sleep": "give its device memory back while the trainer runs (generation.placement: colocated)",
    "episodes": "run multi-turn episodes (env.environment)",
    "routed_experts": "report the experts it routed each token to (grpo.routing_replay: rollout)",
    "expert_parallel": "hold whole experts per worker (generation.engine_expert_parallel)",
    "stream": "generate from a request stream, pausing between steps for weights (StreamingEngine)",
    "lora_adapters": "apply LoRA adapters sent by the weight sync (generation.lora_sync: adapter)",
}
"""What a rollout engine may be able to do beyond the calls every engine answers
(``megagrpo.generation.engine.RolloutEngine``), and which settings need it."""

ENGINE_CAPABILITIES = {
    "vllm": frozenset({"sleep", "episodes", "routed_experts", "expert_parallel", "stream", "lora_adapters"}),
}
"""What each ``generation.engine`` can do, of :data:`CAPABILITIES` (its entry of
``megagrpo.generation.engine.ENGINES``): the preflight refuses a setting the engine cannot serve."""

BUILTIN_ENVIRONMENTS = {
    "guess_number": "megagrpo.envs.games:GuessNumber",
    "python_tool": "megagrpo.envs.code_tool:PythonTool",
}
"""``env.environment`` names of the environments megagrpo ships (megagrpo.envs)."""


@dataclass(kw_only=True, frozen=True)
class EnvConfig:
    """Multi-turn episodes (``megagrpo.envs``): with ``environment`` set, each GRPO rollout is an episode
    of turns: the engine samples a turn, the environment answers, until it says done."""

    environment: str | None = None
    """null: single-turn rollouts (prompt -> completion -> reward). Else a built-in environment
    ("guess_number", "python_tool") or a class by "package.module:Class" or "path/to/file.py:Class"
    (see megagrpo.envs.base.Environment), imported and checked at load."""
    args: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (YAML scalars and lists)."""
    max_turns: int = 4
    """Model turns per episode at most; an episode still going after them is truncated."""
    max_new_tokens: int = 256
    """Tokens one model turn may sample; a turn cut there ends its episode as truncated."""
    max_episode_tokens: int = 1024
    """Tokens after the opening prompt (sampled and observation tokens) at most; an episode that would
    pass it is truncated. The opening prompt + this must fit model.seq_length."""
    reward: Literal["final", "sum"] = "final"
    """Episode reward: the last step's reward ("final"), or the sum of every step's ("sum": per-turn
    rewards count too)."""
    tool_format: str = "hermes"
    """How tool calls are written in the model's turns (megagrpo.envs.chat.TOOL_CALL_FORMATS): "hermes"
    (Qwen2.5/Qwen3/Hermes <tool_call>{json}</tool_call>) or "llama3_json"."""
    num_workers: int = 4
    """Worker processes per engine that run the environments' steps."""
    step_timeout_s: float = 30.0
    """Deadline of one environment call (reset or step); past it the episode ends with reward 0 and
    its worker is killed and replaced."""
    schedule: Literal["async", "turns"] = "async"
    """async: each episode's next turn goes to the engine as soon as its observation is ready; turns:
    every episode's turn t is sampled, then every environment steps, then turn t + 1 (the baseline
    benchmarks/agents.py compares against)."""
    allow_unsandboxed: bool = False
    """Code tools: run model-written code without the bubblewrap sandbox when it is unavailable
    (rlimits, a private directory and the deadline only). false: refuse to start without it."""
    import_timeout_s: float = 120.0
    """Deadline of importing environment's module in a child process at load; a module that takes longer
    (or exits, or raises) is refused naming it."""

    def __post_init__(self) -> None:
        positive(self, "max_turns", "max_new_tokens", "max_episode_tokens", "num_workers")
        check(self, "step_timeout_s", math.isfinite(self.step_timeout_s) and self.step_timeout_s > 0, "> 0")
        check(self, "import_timeout_s", 0 < self.import_timeout_s < math.inf, "finite and > 0")
        check(
            self,
            "max_new_tokens",
            self.max_new_tokens <= self.max_episode_tokens,
            f"<= max_episode_tokens ({self.max_episode_tokens})",
        )

    @property
    def enabled(self) -> bool:
        return self.environment is not None

    @property
    def spec(self) -> str | None:
        """The environment's import spec (built-in names resolved; file paths made absolute)."""
        if self.environment is None:
            return None
        from megagrpo.rewards.user import resolve_spec

        return BUILTIN_ENVIRONMENTS.get(self.environment) or resolve_spec(self.environment)
