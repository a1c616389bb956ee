"""No load path unpickles: the package imports no pickle module, every torch.load passes
weights_only=True, and numpy never loads with allow_pickle=True."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def find_problems(package) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
                problems.append(f"{path}: from {node.module} import ...")
        for call in _calls(tree):
            name = _name(call.func)
            kwargs = {k.arg: k.value for k in call.keywords}
            if name.endswith("torch.load") or (name.endswith(".load") and "weights_only" in kwargs):
                ok = isinstance(kwargs.get("weights_only"), ast.Constant) and kwargs["weights_only"].value is True
                if not ok:
                    problems.append(f"{path}:{call.lineno}: torch.load without weights_only=True")
            if "allow_pickle" in kwargs and not (
                isinstance(kwargs["allow_pickle"], ast.Constant) and kwargs["allow_pickle"].value is False
            ):
                problems.append(f"{path}:{call.lineno}: allow_pickle")
    return problems


def test_package_has_no_pickle_load_path():
    assert find_problems(REPO / "rlbench") == []


def test_the_scanner_catches_a_bad_load(tmp_path):
    """The scan above can fail: point it at a package with unsafe loads and see it complain."""
    (tmp_path / "bad.py").write_text(
        "import torch\nimport pickle\nx = torch.load('f')\n"
        "y = torch.load('g', weights_only=False)\nz = numpy.load('h', allow_pickle=True)\n"
    )
    problems = find_problems(tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "import pickle",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "allow_pickle",
    ]
