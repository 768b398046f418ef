"""The one decision of a config's ``auto`` values: :func:`resolve`, taken once, where the run starts.

``load_config`` calls it; a :class:`~megagrpo.config.schema.Config` built in Python (a test, a benchmark)
goes through it before its ranks start. The decisions travel inside the Config
(``cfg.resolved``: a :class:`~megagrpo.config.schema.Resolved`), pickled to every rank, so a rank on
another machine acts on what the run's start decided; ``dataclasses.replace`` keeps them and decides
nothing. The probes themselves are :mod:`megagrpo.parallel.backends`'.
"""

import dataclasses

from megagrpo.config.schema import Config, Resolved
from megagrpo.parallel import backends

__all__ = ["packs_sequences", "resolve"]


def resolve(cfg: Config) -> Config:
    """``cfg`` carrying its ``auto`` values as decided by this process (``cfg.resolved``).

    Named values are taken as they are: a config may name NCCL or Transformer Engine for the trainer's
    machines while it is loaded elsewhere; the ranks check availability when they use them. Whether the
    chosen layers support the configured sequence and context parallelism is a check of
    :func:`megagrpo.config.rules.validate`.
    """
    par = cfg.parallel
    transformer_impl = backends.resolve_transformer_impl(par.transformer_impl)
    decided = Resolved(
        backend=backends.resolve_backend(par.backend),
        transformer_impl=transformer_impl,
        packs_sequences=packs_sequences(cfg, transformer_impl),
        settings=Resolved.settings_of(cfg),
    )
    return dataclasses.replace(cfg, resolution=decided)


def packs_sequences(cfg: Config, transformer_impl: str) -> bool:
    """Whether the policy's micro-batches are packed end to end (THD) with ``transformer_impl``:
    policy.sequence_packing "auto", layers that keep packed sequences apart (``thd``), and no context
    parallelism (its split of packed rows over CP ranks is not wired up)."""
    return (
        cfg.policy.sequence_packing == "auto"
        and "thd" in backends.IMPL_FEATURES.get(transformer_impl, frozenset())
        and cfg.parallel.context_parallel_size == 1
    )
