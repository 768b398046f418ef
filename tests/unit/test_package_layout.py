"""The package's layout as the README describes it: no import cycles between its packages,
architecture apart from checkpoint I/O, third-party patches only in ``compat``."""

import ast
from pathlib import Path

import pytest

import megagrpo

pytestmark = pytest.mark.unit

ROOT = Path(megagrpo.__file__).parent


def _runtime_imports(tree: ast.AST):
    """Names of megagrpo modules imported, leaving out ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megagrpo"):
            if node.module == "megagrpo":
                yield from (f"megagrpo.{alias.name}" for alias in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("megagrpo"))


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("").parts
        source = rel[0] if rel[0] != "__init__" else None
        if source is None:
            continue
        for module in _runtime_imports(ast.parse(path.read_text())):
            target = _package_of(module)
            if target and target != source:
                edges.setdefault(source, set()).add(target)
    return edges


def _cycle_through(edges: dict[str, set[str]], start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in edges.get(node, ()):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycles_between_packages():
    edges = _graph()
    cycles = [cycle for node in sorted(edges) if (cycle := _cycle_through(edges, node))]
    assert cycles == []


def test_models_hold_the_architecture_only():
    edges = _graph()
    assert "ckpt" not in edges.get("models", set())
    assert edges.get("compat", set()) == set()  # patches depend on nothing of ours


def test_checkpoint_io_lives_in_ckpt():
    for name in ("hf_files", "hf_weights", "files", "dist_files", "durable", "megatron", "convert", "run"):
        assert (ROOT / "ckpt" / f"{name}.py").is_file()
    architecture = {
        *("__init__", "registry", "shape", "mapping", "layout", "builder", "description"),
        "torch_layers",
    }
    assert {p.stem for p in (ROOT / "models").glob("*.py")} == architecture


def test_no_module_over_800_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert long == {}


def test_test_files_have_unique_names():
    """pytest imports test modules by basename (the test folders are not packages): two files of the
    same name in different tiers fail the whole collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
