"""pass@k evaluation on vLLM engines: ``megagrpo eval`` and the GRPO driver's sampled validation.

Each problem is sampled ``n`` times (``eval.num_samples``; the AIME 2024 protocol of DeepScaleR is 30
problems x 16 samples at temperature 0.6, top_p 0.95) and every sample is scored by the run's reward
(``RewardScorer``, math-verify on the decoded text). Reported per problem and averaged over problems:

- pass@1 = c / n, the fraction of a problem's samples that are correct (pass@1 "averaged over n samples");
- pass@k for k = 1, 2, 4, ... up to n, with the unbiased estimator of Chen et al. (2021, "Evaluating
  Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), the probability that at least one
  of k samples drawn without replacement from the n is correct.

Samples are seeded per problem (``eval.seed``), so a table does not depend on how problems are batched
or split over engines: the same model, config and seed give the same table. ``megagrpo eval`` starts
engines that load the model's weights from disk (no trainer), writes ``eval.json`` and ``eval.md``
atomically and shows a progress bar; the driver calls :func:`evaluate` on its own engines.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megagrpo.data.prompts import Prompt
from megagrpo.types import Completion, SamplingSettings

__all__ = ["EvalReport", "ProblemResult", "evaluate", "pass_at_k", "pass_ks", "run_eval"]

GenerateFn = Callable[[list[Prompt], SamplingSettings, list[int]], list[Completion]]
"""(prompts, settings, one seed per prompt) -> ``settings.n`` completions per prompt, in prompt order."""

_CHUNK = 8
"""Problems per generate call (the progress bar advances per chunk; results do not depend on it)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a problem with ``c`` correct among ``n`` samples (needs 1 <= k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) as a product: exact in floating point for the sizes used here.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to ``n`` (and ``n`` itself when it is not a power of two)."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


@dataclass(frozen=True)
class ProblemResult:
    index: int
    """Position of the problem in the evaluated set (0-based)."""
    answer: str
    """Reference answer."""
    correct: int
    """Samples that scored 1."""
    samples: int
    """Samples drawn (n)."""
    pass_at: dict[int, float]
    """k -> unbiased pass@k of this problem."""
    example: str
    """The first sample's decoded text (for the table)."""


@dataclass(frozen=True)
class EvalReport:
    problems: list[ProblemResult]
    settings: dict = field(default_factory=dict)
    """How the samples were drawn (temperature, top_p, max_tokens, n, seed) and what was evaluated."""

    @property
    def pass_at(self) -> dict[int, float]:
        """k -> pass@k averaged over problems (k = 1 is pass@1 averaged over the n samples)."""
        ks = pass_ks(self.problems[0].samples) if self.problems else []
        return {k: sum(p.pass_at[k] for p in self.problems) / len(self.problems) for k in ks}

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        """``{prefix}/pass@k`` for every k."""
        return {f"{prefix}/pass@{k}": v for k, v in self.pass_at.items()}

    def to_json(self) -> str:
        rows = [asdict(p) | {"pass_at": {str(k): v for k, v in p.pass_at.items()}} for p in self.problems]
        summary = {f"pass@{k}": v for k, v in self.pass_at.items()}
        return json.dumps({"summary": summary, "settings": self.settings, "problems": rows}, indent=1)

    def to_markdown(self, title: str = "Evaluation") -> str:
        ks = list(self.pass_at)
        lines = [f"# {title}", ""]
        lines += [", ".join(f"{k}: {v}" for k, v in self.settings.items()), ""]
        lines += ["| " + " | ".join(f"pass@{k}" for k in ks) + " |", "|" + "---:|" * len(ks)]
        lines += ["| " + " | ".join(f"{self.pass_at[k]:.3f}" for k in ks) + " |", ""]
        lines += ["| # | answer | correct / n | pass@1 | first sample |", "|---:|---|---:|---:|---|"]
        for p in self.problems:
            sample = p.example.replace("|", "\\|").replace("\n", " ")[:80]
            lines.append(
                f"| {p.index} | {p.answer} | {p.correct} / {p.samples} | {p.pass_at[1]:.3f} | {sample} |"
            )
        return "\n".join(lines) + "\n"


def evaluate(
    generate: GenerateFn,
    prompts: Sequence[Prompt],
    settings: SamplingSettings,
    scorer,
    decode: Callable[[list[int]], str],
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> EvalReport:
    """Sample ``settings.n`` completions per prompt, score them, and report pass@k per problem.

    ``scorer(texts, answers) -> scores`` (a ``RewardScorer``); a score >= 1 counts as correct.
    ``progress(done)`` is called with the number of problems finished after each chunk.
    """
    n = settings.n
    results = []
    for start in range(0, len(prompts), _CHUNK):
        chunk = list(prompts[start : start + _CHUNK])
        seeds = [seed * 1_000_003 + start + i for i in range(len(chunk))]
        comps = generate(chunk, settings, seeds)
        texts = [decode(c.token_ids) for c in comps]
        scores = completion_scores(comps, texts, chunk, scorer)
        for i, prompt in enumerate(chunk):
            mine = [s for c, s in zip(comps, scores, strict=True) if c.prompt_index == i]
            if len(mine) != n:
                raise RuntimeError(f"problem {start + i}: {len(mine)} completions, expected {n}")
            correct = sum(s >= 1.0 for s in mine)
            first = next(t for c, t in zip(comps, texts, strict=True) if c.prompt_index == i)
            pass_at = {k: pass_at_k(n, correct, k) for k in pass_ks(n)}
            results.append(ProblemResult(start + i, prompt.answer, correct, n, pass_at, first))
        if progress is not None:
            progress(len(results))
    return EvalReport(results)


def completion_scores(
    comps: Sequence, texts: Sequence[str], prompts: Sequence[Prompt], scorer
) -> list[float]:
    """Each completion's reward: the environment's for multi-turn episodes (``Completion.reward``), else
    ``scorer``'s for its text against its prompt's answer."""
    if comps and all(c.reward is not None for c in comps):
        return [c.reward for c in comps]
    return scorer(list(texts), [prompts[c.prompt_index].answer for c in comps])


# ----------------------------------------------------------------------------------- megagrpo eval


def _loaded_engine_class(cfg):
    from megagrpo.generation.engine import engine_spec

    class LoadedEngine(engine_spec(cfg.generation.engine).load_class()):
        """An engine that reads the model's weights from its directory (no trainer sends them)."""

        def __init__(self, cfg, model_dir: str, engine_index: int = 0):
            super().__init__(cfg, model_dir, engine_index, dummy_weights=False)

    return LoadedEngine


def run_eval(cfg, model_dir: str | Path, out_dir: str | Path, *, samples: int | None = None) -> EvalReport:
    """``megagrpo eval``: the problems of ``eval.path`` (default ``data.val_path``) sampled on vLLM engines
    loading ``model_dir``; writes ``out_dir/eval.json`` and ``out_dir/eval.md``."""
    import dataclasses

    import ray

    from megagrpo.ckpt.durable import atomic_write
    from megagrpo.data.prompts import eval_prompts
    from megagrpo.rewards import RewardScorer
    from megagrpo.runtime.engines import EnginePool
    from megagrpo.runtime.ray_session import shutdown_ray, start_ray

    ev = cfg.eval
    n = samples or ev.num_samples
    prompts, decode, stops = eval_prompts(cfg, str(model_dir))  # bad data stops here, before any engine
    scorer = RewardScorer(cfg.reward)
    settings = SamplingSettings(
        max_tokens=ev.max_new_tokens or cfg.generation.max_new_tokens,
        temperature=ev.temperature,
        top_p=ev.top_p,
        stop_token_ids=stops,
        n=n,
    )
    start_ray(cfg.cluster, cfg=cfg)
    engine_cls = _loaded_engine_class(cfg)
    try:
        # No policy: the engines load their weights from model_dir, a replacement too.
        engines = EnginePool.start(cfg, str(model_dir), engine_cls=engine_cls)
        with _ProgressBar(len(prompts), cfg.logging.progress_bar) as advance:
            report = evaluate(
                functools.partial(engines.generate, step=0),  # one "step": restarts count over the whole eval
                prompts,
                settings,
                scorer,
                decode,
                seed=ev.seed,
                progress=advance,
            )
    finally:
        scorer.close()
        if ray.is_initialized():
            shutdown_ray()
    where = ev.path or cfg.data.val_path
    report = dataclasses.replace(
        report,
        settings={
            "model": str(model_dir),
            "problems": f"{where} ({len(prompts)})",
            "samples": n,
            "temperature": ev.temperature,
            "top_p": ev.top_p,
            "max_tokens": settings.max_tokens,
            "seed": ev.seed,
        },
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "eval.json", report.to_json())
    atomic_write(out / "eval.md", report.to_markdown(f"megagrpo eval: {cfg.run_name}"))
    return report


class _ProgressBar:
    """A rich progress bar over problems (a no-op callback when ``enabled`` is false)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda done: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"), TimeElapsedColumn()
        )
        self.bar.start()
        task = self.bar.add_task("eval", total=self.total)
        return lambda done: self.bar.update(task, completed=done)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
