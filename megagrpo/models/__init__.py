"""Architecture registry and Megatron model construction."""
