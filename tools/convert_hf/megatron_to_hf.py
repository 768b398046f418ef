#!/usr/bin/env python3
"""Export a megagrpo Megatron checkpoint as a Hugging Face directory that transformers and vLLM load.

    python tools/convert_hf/megatron_to_hf.py --ckpt DIR --out DIR [--max-shard-size 5GB]

Writes sharded safetensors with an index, config.json, generation_config.json and the tokenizer
files carried in the checkpoint. Same as `megagrpo export`.
"""

from __future__ import annotations

import sys

from megagrpo.cli import run

if __name__ == "__main__":
    run(["export", *sys.argv[1:]])
