"""Megatron shards -> HF-named tensors -> buckets -> broadcast into vLLM; the probe that checks it."""
