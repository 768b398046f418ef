"""Generated math problems shaped like DeepScaleR's records: ``problem``, ``answer``, ``solution``.

Four families, drawn uniformly: multi-step arithmetic (``3 + 4 \\times 5``), sums and differences of
fractions, percentages of a number, and linear equations ``ax + b = c`` with an integer root. Answers are
integers (``23``, ``-4``) or reduced fractions in LaTeX (``\\frac{5}{6}``); every worked solution ends in
``\\boxed{answer}``, as math-verify expects of a response. Numbers are small so that a model of a few
hundred thousand parameters (the CPU twin's) can learn the steps.

``math_records(n, seed, terse_frac=..., unboxed_frac=...)`` can give a share of the records a terse
solution (the boxed answer alone, without the steps) or an unboxed one (the steps, then the answer in
plain math mode: math-verify scores it 0, as a real reward does a response that never boxes). A model
made from such data has styles to choose between, and GRPO learns which pays.

``math_records(n, seed)`` is deterministic: record ``i`` depends only on ``seed`` and ``i``, so a training
file and a validation file drawn from seeds far apart do not share a stream. ``write_math_dataset``
writes them as JSONL, a JSON array or Parquet (by suffix), atomically.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

__all__ = ["FAMILIES", "math_records", "write_math_dataset"]


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _record(problem: str, steps: list[str], answer: Fraction | int) -> dict[str, str]:
    answer = _latex(Fraction(answer))
    solution = " ".join([*steps, _final(answer)])
    return {"problem": problem, "answer": answer, "solution": solution}


def _final(answer: str, boxed: bool = True) -> str:
    return f"The answer is $\\boxed{{{answer}}}$." if boxed else f"The answer is ${answer}$."


def _arithmetic(rng: random.Random) -> dict[str, str]:
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 9)
    form = rng.randrange(3)
    if form == 0:
        p = b * c
        return _record(
            f"Compute ${a} + {b} \\times {c}$.",
            [f"First ${b} \\times {c} = {p}$.", f"Then ${a} + {p} = {a + p}$."],
            a + p,
        )
    if form == 1:
        s = a + b
        return _record(
            f"Compute $({a} + {b}) \\times {c}$.",
            [f"First ${a} + {b} = {s}$.", f"Then ${s} \\times {c} = {s * c}$."],
            s * c,
        )
    p = b * c
    return _record(
        f"Compute ${b} \\times {c} - {a}$.",
        [f"First ${b} \\times {c} = {p}$.", f"Then ${p} - {a} = {p - a}$."],
        p - a,
    )


def _fractions(rng: random.Random) -> dict[str, str]:
    b, d = rng.randint(2, 6), rng.randint(2, 6)
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
    op = rng.choice("+-")
    x, y = Fraction(a, b), Fraction(c, d)
    value = x + y if op == "+" else x - y
    num = a * d + c * b if op == "+" else a * d - c * b
    steps = [
        f"Over the common denominator ${b * d}$: $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}} = "
        f"\\frac{{{num}}}{{{b * d}}}$.",
    ]
    if value.denominator != b * d:
        steps.append(f"This reduces to ${_latex(value)}$.")
    return _record(f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$.", steps, value)


def _percentage(rng: random.Random) -> dict[str, str]:
    pct = rng.choice([10, 20, 25, 50, 75])
    n = Fraction(pct, 100).denominator * rng.randint(1, 12)  # a whole answer
    value = Fraction(pct * n, 100)
    return _record(
        f"What is ${pct}\\%$ of ${n}$?",
        [f"${pct}\\%$ of ${n}$ is ${n} \\times {pct} / 100 = {_latex(value)}$."],
        value,
    )


def _linear(rng: random.Random) -> dict[str, str]:
    a, x, b = rng.randint(2, 9), rng.randint(-5, 12), rng.randint(1, 20)
    c = a * x + b
    return _record(
        f"Solve for $x$: ${a}x + {b} = {c}$.",
        [f"Subtract ${b}$: ${a}x = {c - b}$.", f"Divide by ${a}$: $x = {x}$."],
        x,
    )


FAMILIES = {"arithmetic": _arithmetic, "fractions": _fractions, "percentage": _percentage, "linear": _linear}
"""Problem family name -> generator of one record from a ``random.Random``."""


def math_records(
    n: int, seed: int, *, terse_frac: float = 0.0, unboxed_frac: float = 0.0
) -> list[dict[str, str]]:
    """``n`` records; record ``i`` is drawn from ``random.Random(seed * 1_000_003 + i)``. With
    ``terse_frac``, that share of the records have a solution that states the boxed answer without the
    steps; with ``unboxed_frac``, that share of the others end in the answer without ``\\boxed{}``. Each
    share is chosen by a stream of its own, so the problems do not change."""
    out = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        family = rng.choice(sorted(FAMILIES))
        record = FAMILIES[family](rng)
        if terse_frac and random.Random(f"terse {seed} {i}").random() < terse_frac:
            record["solution"] = _final(record["answer"])
        elif unboxed_frac and random.Random(f"unboxed {seed} {i}").random() < unboxed_frac:
            steps = record["solution"].removesuffix(_final(record["answer"]))
            record["solution"] = steps + _final(record["answer"], boxed=False)
        out.append(record)
    return out


def write_math_dataset(path: str | Path, records: list[dict]) -> Path:
    """``records`` as ``.jsonl``, ``.json`` (an array) or ``.parquet``, written aside and renamed."""
    from megagrpo.ckpt.durable import atomic_file, atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        return atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))
    if path.suffix == ".json":
        return atomic_write(path, json.dumps(records, indent=1))
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with atomic_file(path, "wb") as fh:
            pq.write_table(pa.Table.from_pylist(records), fh)
        return path
    raise ValueError(f"{path}: unsupported suffix {path.suffix!r} (use .jsonl, .json or .parquet)")


def main(argv: list[str] | None = None) -> None:
    """``python -m megagrpo.data.math_problems OUT N [--seed S]``: write N generated records to OUT."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", help="file to write: .jsonl, .json or .parquet")
    parser.add_argument("count", type=int, help="number of records")
    parser.add_argument("--seed", type=int, default=0, help="seed of the record stream")
    args = parser.parse_args(argv)
    path = write_math_dataset(args.out, math_records(args.count, args.seed))
    print(f"wrote {args.count} generated math records to {path}")


if __name__ == "__main__":
    main()
