"""The package's layout as the README describes it: no import cycles between its packages nor between its
modules, architecture apart from checkpoint I/O, third-party patches only in ``compat``, modules and
functions of a size one can read."""

import ast
from pathlib import Path

import pytest

import megagrpo

pytestmark = pytest.mark.unit

ROOT = Path(megagrpo.__file__).parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], deferred: bool):
    """The statements that run when the module is imported: not function bodies (unless ``deferred``:
    then the imports made at call time too), never the body of ``if TYPE_CHECKING:`` (its ``else`` runs);
    class bodies, ``try`` and other blocks do run."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, deferred)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                for child in children:
                    # an except handler or match case holds its statements one level down
                    inner = child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child]
                    yield from _import_nodes(inner, deferred)


def _with_parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts) + 1)}


def _module_imports(modules: dict[str, Path], module: str, deferred: bool = False) -> set[str]:
    """The package's modules whose code an import statement of ``module`` runs: ``import a.b`` and
    ``from a.b import c`` run ``a/__init__``, ``a/b`` (or ``a/b/__init__``) and ``a/b/c`` when ``c`` is a
    submodule. The packages that hold ``module`` are left out: they are already initialised (or being
    initialised) when its code runs, so ``from megagrpo.config import rules`` inside ``config/`` depends on
    ``config.rules`` only."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in _import_nodes(tree.body, deferred):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found |= _with_parents(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            found |= _with_parents(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules} - _with_parents(module)


def _module_graph(root: Path, deferred: bool = False) -> dict[str, set[str]]:
    modules = _modules(root)
    return {module: _module_imports(modules, module, deferred) for module in modules}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graph is a few hundred modules, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return [_path_around(edges, component) for component in components]


def _path_around(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges[node] & component):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _runtime_imports(tree: ast.AST):
    """Names of megagrpo modules imported anywhere in the file (function bodies too), leaving out
    ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
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


def test_module_import_graph_reads_relative_from_deferred_and_type_checking_imports(tmp_path):
    """The cycle checks' reading of imports, on a package written for it: a circle made of a relative
    import, a ``from package import submodule`` and an import in a ``try`` is found; an import under
    ``if TYPE_CHECKING:`` is never an edge (its ``else`` is); one inside a function is an edge of the
    deferred graph only; importing a submodule of another package runs that package's ``__init__``."""
    pkg = tmp_path / "megagrpo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nfrom megagrpo.sub import c\n"
        "if TYPE_CHECKING:\n    from megagrpo.sub import d\nelse:\n    from megagrpo import other\n"
    )
    (pkg / "sub" / "c.py").write_text("try:\n    import megagrpo.sub.a\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "d.py").write_text("def late():\n    from megagrpo.sub import e\n")
    (pkg / "sub" / "e.py").write_text("class K:\n    from megagrpo.sub.d import late\n")
    (pkg / "other.py").write_text("from megagrpo.sub.e import K\n")
    edges = _module_graph(pkg)
    assert edges["megagrpo.sub.b"] == {"megagrpo.sub.c", "megagrpo.other"}
    assert edges["megagrpo.sub.d"] == set()
    assert edges["megagrpo.other"] == {"megagrpo.sub", "megagrpo.sub.e"}
    assert _cycles(edges) == [["megagrpo.sub.a", "megagrpo.sub.b", "megagrpo.sub.c", "megagrpo.sub.a"]]
    deferred = _module_graph(pkg, deferred=True)
    assert deferred["megagrpo.sub.d"] == {"megagrpo.sub.e"}
    assert sorted(_cycles(deferred)) == [
        ["megagrpo.sub.a", "megagrpo.sub.b", "megagrpo.sub.c", "megagrpo.sub.a"],
        ["megagrpo.sub.d", "megagrpo.sub.e", "megagrpo.sub.d"],
    ]


def test_no_import_cycles_between_modules():
    """What runs at import: a circle between two modules of one package passes the package check above
    but makes the import order matter (a name read from a half-initialised module)."""
    cycles = [" -> ".join(cycle) for cycle in _cycles(_module_graph(ROOT))]
    assert cycles == [], "module-level import cycles:\n" + "\n".join(cycles)


def test_no_import_cycles_hidden_in_functions():
    """The same with imports inside functions counted: moving one side of a circle into a function keeps
    it from failing at import but not the two modules from depending on each other (``data.prompts`` and
    ``data.records`` were such a pair while ``DataError`` lived in ``prompts``)."""
    cycles = [" -> ".join(cycle) for cycle in _cycles(_module_graph(ROOT, deferred=True))]
    assert cycles == [], "import cycles through imports inside functions:\n" + "\n".join(cycles)


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
        "lora",  # adapter modules; their checkpoint files are written by ckpt/lora.py
    }
    assert {p.stem for p in (ROOT / "models").glob("*.py")} == architecture


def test_no_module_over_800_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert long == {}


def _long_modules(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root.parent)}: {n} lines"
        for path in sorted(root.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]


def _long_functions(root: Path) -> list[str]:
    """``file:qualified.name: N lines`` for every def (methods and nested ones included) over the limit,
    counted from the ``def`` line (decorators not counted) to its last line."""
    found = []

    def visit(node: ast.AST, path: Path, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = child.end_lineno - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(root.parent)}:{name}: {length} lines")
                visit(child, path, f"{name}.")
            else:
                visit(child, path, prefix)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), path, "")
    return found


def test_size_checks_count_lines_of_modules_and_of_every_def(tmp_path):
    """The two size checks on a module written for them: a function at the limit passes, one line more
    fails; a method and a function nested in it are each measured, the method with its nested body."""
    pkg = tmp_path / "megagrpo"
    pkg.mkdir()
    lines = [f"x{i} = {i}" for i in range(MAX_FUNCTION_LINES)]

    def block(n: int, depth: int) -> str:
        return "\n".join(" " * 4 * depth + line for line in lines[:n])

    (pkg / "mod.py").write_text(
        f"def at_limit():\n{block(MAX_FUNCTION_LINES - 1, 1)}\n\n"
        f"def over():\n{block(MAX_FUNCTION_LINES, 1)}\n\n"
        f"class K:\n    def outer(self):\n        def inner():\n{block(MAX_FUNCTION_LINES, 3)}\n"
        "        return inner\n"
    )
    assert _long_functions(pkg) == [
        f"megagrpo/mod.py:over: {MAX_FUNCTION_LINES + 1} lines",
        f"megagrpo/mod.py:K.outer: {MAX_FUNCTION_LINES + 3} lines",
        f"megagrpo/mod.py:K.outer.inner: {MAX_FUNCTION_LINES + 1} lines",
    ]
    assert _long_modules(pkg) == []
    (pkg / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _long_modules(pkg) == [f"megagrpo/big.py: {MAX_MODULE_LINES + 1} lines"]


def test_no_module_over_600_lines():
    long = _long_modules(ROOT)
    assert long == [], f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_80_lines():
    long = _long_functions(ROOT)
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_test_files_have_unique_names():
    """pytest imports test modules by basename (the test folders are not packages): two files of the
    same name in different tiers fail the whole collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
