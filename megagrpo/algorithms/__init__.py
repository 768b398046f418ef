"""GRPO math as pure tensor functions: group advantages, KL estimators, the clipped surrogate loss; the
layout and metrics of rollout routing replay (``routing``).

Nothing here touches a process group: the loss returns a (sum, count) pair and additive metrics, and the
caller (the Megatron train step) sums them across micro-batches and data-parallel ranks.
"""
