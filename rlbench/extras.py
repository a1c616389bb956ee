"""Which of rlbench's optional extras are installed, asked before anything is loaded or started.

`require` answers a missing package with BadInput (exit 2) naming the setting that needs it and the pip
line that installs it. `importlib.util.find_spec("a.b")` imports `a` first and raises when `a` itself is
missing (megatron.core without megatron): both count as not installed here, never as an internal error.
"""

from __future__ import annotations

import importlib.util

from rlbench.errors import BadInput

SERVE_MODULES = ("starlette", "uvicorn", "orjson")  # what `rlbench serve` imports of its extra
SERVE_EXTRA = "pip install '.[serve]'"
DELTA_MODULES = ("zstandard", "xxhash", "blake3")  # slime's delta weight sync: rlbench/core/weight_delta.py
DELTA_EXTRA = "pip install '.[delta]'"


def installed(module: str) -> bool:
    """Whether `module` (dotted names too) can be imported here, without importing it (only its parents)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module with no spec
        return False


def require(modules: str | tuple[str, ...], how: str, field: str) -> None:
    """BadInput at the first of `modules` that is not installed: 'the X package is not installed here (HOW)'."""
    for module in (modules,) if isinstance(modules, str) else modules:
        if not installed(module):
            raise BadInput(f"the {module} package is not installed here ({how})", field=field)
