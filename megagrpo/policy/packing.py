"""Grouping sequences into micro-batches under a token budget.

First-fit-decreasing: take sequences longest first and put each into the first micro-batch that still has
room. Long sequences placed first leave gaps that the short ones fill, which keeps both the number of
micro-batches (forward/backward passes) and, in the padded layout, the padding low: sequences of similar
length end up together, so a batch's padding to its longest member wastes little. The loss does not depend on
the grouping (see ``megagrpo.algorithms.grpo``), so any grouping is correct; this one is just cheap to run.
"""

from collections.abc import Sequence

__all__ = ["pack_by_token_budget"]


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int, *, padded: bool = True) -> list[list[int]]:
    """Indices into ``lengths`` grouped into micro-batches whose cost is at most ``max_tokens``.

    Cost: ``padded=True`` (right-padded [b, s] layout) ``len(batch) * max(length in batch)``; ``padded=False``
    (packed THD layout) ``sum(lengths in batch)``. Deterministic: ties are broken by index; each micro-batch
    lists its indices in ascending order, micro-batches come in the order they were opened (longest first).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if not 0 <= n <= max_tokens:
            raise ValueError(f"sequence {i} has length {n}, outside [0, max_tokens={max_tokens}]")

    batches: list[list[int]] = []
    costs: list[int] = []  # in the padded layout: the first (longest) length of each batch
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, batch in enumerate(batches):
            # Longest first: a padded batch's max is its first member, so adding i costs that max once more.
            new_cost = costs[b] * (len(batch) + 1) if padded else costs[b] + n
            if new_cost <= max_tokens:
                batch.append(i)
                if not padded:
                    costs[b] = new_cost
                break
        else:
            batches.append([i])
            costs.append(n)
    return [sorted(batch) for batch in batches]
