"""The house: imports go one way. No cycle among rlbench's modules (a function-level import
counts: it is a cycle the moment it runs), and no private name imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rlbench"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module imported, name imported from it or "") for each rlbench import anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    out.append((f"{base}.{alias.name}", ""))
                elif base in modules:
                    out.append((base, alias.name))
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v] - {v}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_rlbench_modules():
    modules = _modules()
    edges = {name: {target for target, _ in _imports(name, path, modules)} for name, path in modules.items()}
    assert _cycles(edges) == []


def test_no_private_name_is_imported_from_another_module():
    modules = _modules()
    private = [
        f"{name} imports {target}.{what}"
        for name, path in modules.items()
        for target, what in _imports(name, path, modules)
        if what.startswith("_") and what != "__version__"
    ]
    assert private == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"c"}}) == []


# The packages (and top-level modules) from the bottom up: a package imports only from its own layer or below.
# session.py sits above core/ (the stages and what they read), backends/ and placement/: it chooses between them.
# fixtures/ is no package but data (no __init__.py; pyproject.toml keeps its scripts out of the wheel): its .py files
# are the builders of that data, scripts run from a checkout (warm_start.py trains rlbench's own model), so they
# sit on top with __main__, where nothing in rlbench may import them.
LAYERS = [
    {"errors", "validate", "extras", "numerics", "keys"},
    {"config_sections", "config_placement", "config_rollout", "config_tracking"},
    {"config", "slime_args"},
    {"rundir"},
    {"core", "tasks"},
    {"backends"},
    {"serve", "placement"},
    {"session", "slime_rollout"},
    {"replay"},
    {"checks"},
    {"report", "command"},
    {"cli"},
    {"__main__", "fixtures", "testing"},
    {"pytest_plugin"},
]


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_no_package_imports_one_above_it():
    modules = _modules()
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    packages = {_package(name) for name in modules if name != "rlbench"}
    assert packages == set(layer), sorted(packages ^ set(layer))  # every package placed, none invented
    assert not list((ROOT / "fixtures").rglob("__init__.py"))  # fixtures' placement holds while it is no package
    upward = sorted(
        {
            (name, target)
            for name, path in modules.items()
            if name != "rlbench"
            for target, _ in _imports(name, path, modules)
            if _package(target) != "rlbench" and layer[_package(target)] > layer[_package(name)]
        }
    )
    assert upward == [], upward


def test_each_package_docstring_names_every_module_it_holds():
    """The README's promise: each package's docstring lists its modules (and the top package its subpackages)."""
    import ast as ast_

    for init in sorted(ROOT.rglob("__init__.py")):
        if "fixtures" in init.parts:
            continue
        doc = ast_.get_docstring(ast_.parse(init.read_text())) or ""
        held = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        held += [f"{p.name}/" for p in init.parent.iterdir() if (p / "__init__.py").is_file() and p.name != "fixtures"]
        missing = [name for name in held if name not in doc]
        assert missing == [], f"{init.relative_to(ROOT.parent)} does not name {missing}"


def test_no_test_file_imports_another_ones_private_names():
    """Shared test helpers live in tests/helpers.py (or a conftest): a test module's `_name` is its own."""
    tests = ROOT.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                found += [
                    f"{path.relative_to(tests)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert found == [], found
