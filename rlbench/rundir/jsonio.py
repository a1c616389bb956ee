"""Reading JSON that someone else wrote: every failure is bad input naming the file, never a traceback.

json.loads raises ValueError for malformed text, but RecursionError for text nested a few thousand
levels deep, and a file may be unreadable, a directory, or not UTF-8. One place turns all of them
into BadInput, so every reader of a run directory, golden file or dataset fails the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlbench.errors import BadInput


def parse_json(text: str | bytes, path: str | Path, what: str = "JSON") -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise BadInput(f"invalid {what}: nested too deeply", path=path) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"invalid {what} ({str(exc).splitlines()[0][:120]})", path=path) from None


def read_bytes(path: str | Path) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except IsADirectoryError:
        raise BadInput("is a directory, expected a file", path=path) from None
    except FileNotFoundError:
        raise BadInput("missing", path=path) from None
    except OSError as exc:
        raise BadInput(f"cannot read ({exc.strerror})", path=path) from None


def read_json(path: str | Path, what: str = "JSON") -> Any:
    return parse_json(read_bytes(path), path, what)
