#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint directory into a megagrpo Megatron distributed checkpoint.

    python tools/convert_hf/hf_to_megatron.py --hf-dir DIR --out DIR [--tp N] [--pp N] [--ep N [--etp N]]

The checkpoint loads at any TP/PP/EP/ETP (not only the one it was written with); --tp/--pp/--ep/--etp
only choose how many ranks share the conversion work and memory. Supported: Qwen2/Qwen2.5, Llama 3.x,
Qwen3, Qwen3-MoE, Qwen2-MoE.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hf-dir", required=True, help="HF directory: config.json + *.safetensors (+ tokenizer)"
    )
    parser.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks doing the conversion")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks doing the conversion")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks doing the conversion (MoE models)"
    )
    parser.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size: ranks splitting each expert's width (default: --tp)",
    )
    args = parser.parse_args(argv)

    from megagrpo.ckpt.convert import hf_to_megatron

    try:
        out = hf_to_megatron(
            args.hf_dir, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, in_process=True
        )
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"hf_to_megatron: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote Megatron checkpoint {out}")
    return 0


if __name__ == "__main__":
    from megagrpo.compat.process_exit import exit_without_teardown
    from megagrpo.compat.upstream_warnings import silence_in_this_program

    silence_in_this_program()
    exit_without_teardown(main())
