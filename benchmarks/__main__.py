"""``python -m benchmarks run ...``: the suite (``suite.py``); ``python -m benchmarks readme [--check]``:
README.md's "Measured" table from the committed results (``readme.py``)."""

from __future__ import annotations

import sys

USAGE = "usage: python -m benchmarks {run,readme} [options]  (each takes --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("run", "readme"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "run":
        from .suite import run

        suite = run(argv[1:])
        return 1 if any("error" in b for b in suite["benchmarks"].values()) else 0
    from .readme import main as readme_main

    return readme_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
