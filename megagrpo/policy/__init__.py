"""Megatron policy: model/optimizer engine, logprobs, GRPO training step."""
