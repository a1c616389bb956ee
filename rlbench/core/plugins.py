"""Loading user functions (reward, generate) by dotted path: `package.module.function`
or `package.module:function`. One loader, so every plugin fails the same clear way. The working
directory is searched last, as `python -m` would, so a plugin module beside the run needs no install. A module
that cannot import slime (or Miles, its fork) gets, in its one error line, what to run to have it."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from rlbench.errors import BadInput

# What a slime plugin needs and how to get it, in every error that finds slime missing: slime installs from its
# source; Miles' miles/ package is unpacked beside the checkout, never installed (its wheel overwrites megatron-core).
SLIME_MISSING = (
    "install slime from its source (pip install -e <slime checkout> --no-deps), or unpack Miles' package with "
    "`python tests/get_miles.py` and put it on the path: PYTHONPATH=.vendor/miles-rl-0.0.2 rlbench run ..."
)
# A top-level module a plugin imports -> what to do when it is missing.
_MISSING_HINTS = {
    "slime": f"a slime plugin imports slime or Miles: {SLIME_MISSING}",
    "miles": f"a slime plugin imports slime or Miles: {SLIME_MISSING}",
    "httpx": 'slime\'s http_utils needs httpx: pip install -e ".[slime]"',
}


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
        missing = (exc.name or "").partition(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
        hint = f"; {_MISSING_HINTS[missing]}" if missing in _MISSING_HINTS else ""
        raise BadInput(f"cannot import module '{module_name}' ({exc}){hint}", field=option) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the plugin's module failed while importing (SyntaxError, SystemExit)
        raise BadInput(
            f"importing module '{module_name}' raised {exc.__class__.__name__}: {exc}", field=option
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise BadInput(f"module '{module_name}' has no attribute '{attr}'", field=option)
    if not callable(fn):
        raise BadInput(f"'{path}' is not callable", field=option)
    return fn


def call_plugin(fn: Callable, name: str, option: str, *args, **kwargs):
    """Call a user function; whatever it raises, SystemExit and other BaseExceptions included, becomes
    BadInput naming the function (Ctrl-C stays Ctrl-C). A plugin cannot end the run as a success."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        raise BadInput(
            f"{name} called sys.exit({exc.code!r}); a plugin returns a value instead", field=option
        ) from None
    except BaseException as exc:  # noqa: BLE001 - a plugin's bug, named, with the cause kept for --debug
        raise BadInput(f"{name} raised {exc.__class__.__name__}: {exc}", field=option) from exc
