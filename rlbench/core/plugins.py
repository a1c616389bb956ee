"""Loading user functions (reward, generate) by dotted path: `package.module.function`
or `package.module:function`. One loader, so every plugin fails the same clear way. The working
directory is searched last, as `python -m` would, so a plugin module beside the run needs no install."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from rlbench.errors import BadInput


def load_function(path: str, option: str) -> Callable:
    """Import `path` and return the callable it names; `option` names the flag, for the error."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise BadInput(f"expected a dotted path 'package.module.function', got {path!r}", field=option)
    if os.getcwd() not in sys.path:  # as `python -m` does: a plugin beside the run needs no install
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(f"cannot import module '{module_name}' ({exc})", field=option) from None
    except Exception as exc:  # the plugin's own module failed while importing (SyntaxError, ...)
        raise BadInput(f"importing module '{module_name}' raised {exc.__class__.__name__}: {exc}",
                       field=option) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise BadInput(f"module '{module_name}' has no attribute '{attr}'", field=option)
    if not callable(fn):
        raise BadInput(f"'{path}' is not callable", field=option)
    return fn
