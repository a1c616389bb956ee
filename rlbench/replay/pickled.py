"""What a torch.save file's pickle would build, named from its opcodes without running any of it.

When `torch.load(weights_only=True)` refuses a file, its message names the first class it met and invites the
user to allowlist it (`torch.serialization.add_safe_globals`), which would execute what the file says. rlbench
says instead what the file holds: `pickletools.genops` only parses the opcode stream (it imports nothing and
calls nothing), and the classes and functions a pickle uses are the arguments of its GLOBAL opcodes
("module name") and of its STACK_GLOBAL opcodes (the two strings pushed before it, given directly or from the
memo). The pickle is torch's zip archive's `*/data.pkl`, or in torch's legacy format the pickles at the file's
start (magic number, protocol, system info, then the object), read until the first that does not parse.
`load_torch_file` loads a dump so (slime's rollout and train dumps), a refusal named from its opcodes.
"""

from __future__ import annotations

import io
import warnings
import pickletools
import zipfile
from pathlib import Path

import torch

from rlbench.errors import BadInput

# Pickle's own machinery for building an object of a class: not what the file holds.
MACHINERY = {
    "copyreg._reconstructor",
    "copyreg.__newobj__",
    "copyreg.__newobj_ex__",
    "builtins.object",
    "__builtin__.object",
}
_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_LEGACY_PICKLES = 4  # magic number, protocol version, system info, the object


def pickle_globals(path: Path) -> list[str]:
    """The "module.name" of every class or function the file's pickle refers to, in first-seen order, none run.
    [] where the file is not a pickle rlbench can parse (then nothing can be said of it)."""
    try:
        streams = _pickles(Path(path))
    except (OSError, zipfile.BadZipFile, KeyError):
        return []
    names: list[str] = []
    for stream in streams:
        try:
            _scan(stream, names)
        except (ValueError, EOFError, IndexError):  # a malformed or cut opcode stream: what was read so far stands
            break
    return list(dict.fromkeys(names))


def _pickles(path: Path) -> list[io.BytesIO]:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            return [io.BytesIO(archive.read(name))] if name is not None else []
    stream = io.BytesIO(path.read_bytes())
    return [stream] * _LEGACY_PICKLES  # one stream, read pickle after pickle


def _scan(stream: io.BytesIO, names: list[str]) -> None:
    """One pickle's opcodes, up to its STOP: the globals it names appended to `names`."""
    recent: list[str | None] = []  # what the last opcodes pushed, where a string (None: anything else)
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(stream):
        kind = op.name
        if kind == "GLOBAL":
            names.append(".".join(str(arg).split(" ", 1)))
            recent.append(None)
        elif kind == "STACK_GLOBAL":
            module, name = recent[-2:] if len(recent) >= 2 else [None, None]
            names.append(f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else "(unnamed)")
            recent.append(None)
        elif kind in _STRINGS:
            recent.append(arg if isinstance(arg, str) else None)
        elif kind in _GETS:
            recent.append(memo.get(arg))
        elif kind in _PUTS:
            memo[arg] = recent[-1] if recent else None
        elif kind == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif kind not in ("FRAME", "PROTO"):
            recent.append(None)


def plain_pickle(path: Path) -> str | None:
    """What a file written by pickle.dump rather than torch.save holds at its top ("list", "dict", ...): None for
    torch's zip archive, torch's legacy format (its first pickle a number, the magic) or what does not parse.
    Read from the first opcodes, none run."""
    try:
        if zipfile.is_zipfile(path):
            return None
        with open(path, "rb") as stream:
            for op, _, _ in pickletools.genops(stream):
                if op.name in ("PROTO", "FRAME"):
                    continue
                kinds = {"EMPTY_LIST": "list", "EMPTY_DICT": "dict", "EMPTY_TUPLE": "tuple", "MARK": "list or tuple"}
                return None if op.name.startswith(("LONG", "INT", "BININT")) else kinds.get(op.name, "object")
    except (OSError, ValueError, EOFError):
        return None
    return None


def refused_globals(path: Path) -> list[str]:
    """The classes and functions in the file that torch.load(weights_only=True) does not load: what made it refuse
    the file (pickle's own machinery and the types torch allows left out)."""
    allowed = _torch_allowed()
    return [n for n in pickle_globals(path) if n not in MACHINERY and not allowed(n)]


def _torch_allowed():
    """Whether torch's weights-only unpickler loads a global: its own list, or, where a torch lacks that private
    function, torch's names and the two plain ones it has always allowed."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        names = set(_get_allowed_globals())
    except (ImportError, AttributeError):  # pragma: no cover - a torch without it
        return lambda n: n.startswith("torch.") or n in ("collections.OrderedDict", "_codecs.encode")
    return names.__contains__


def what_it_holds(names: list[str]) -> str:
    """The sentence saying what a refused dump holds: a multimodal dump's images, or the classes rlbench does not
    load."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if any(n.split(".", 1)[0] == "PIL" for n in names):
        return f"holds {shown} objects (a multimodal dump; rlbench reads text rollouts)"
    return (
        f"holds {shown} objects, which rlbench does not load (it reads plain data and tensors only, with "
        "torch.load(weights_only=True))"
    )


def load_torch_file(path: Path):
    """A torch.save file, loaded with torch.load(weights_only=True): plain containers, numbers, strings and
    tensors; anything more is refused, named from its pickle's opcodes (none run)."""
    if not path.is_file():
        raise BadInput("dump not found", path=path)
    if path.stat().st_size == 0:
        raise BadInput("empty file (0 bytes): not a torch.save file", path=path)
    try:
        with warnings.catch_warnings():  # torch's note on a protocol-4 pickle: rlbench loads it or names what it holds
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            dump = torch.load(path, map_location="cpu", weights_only=True)
    except (Exception, RecursionError) as exc:  # pickle.UnpicklingError for what weights_only refuses
        lines = str(exc).splitlines() or [""]
        if type(exc).__name__ == "UnpicklingError" and "weights_only" in str(exc):
            raise BadInput(_refusal(path, lines), path=path) from None
        raise BadInput(f"not a torch.save file ({exc.__class__.__name__}: {lines[0][:120]})", path=path) from None
    return dump


def _refusal(path: Path, lines: list[str]) -> str:
    """Why a dump that torch.load(weights_only=True) refused is refused: what it holds, read from its pickle's
    opcodes, none run (pickled.py). torch's own text invites the user to allowlist the class, which would run it:
    where the opcodes cannot be read, only its first sentence is kept."""
    names = refused_globals(path)
    if names:
        return f"refused: the dump {what_it_holds(names)}"
    reason = next((line.strip() for line in lines if "GLOBAL" in line or "global" in line), lines[0])
    reason = reason.split(" Please use", 1)[0].removeprefix("WeightsUnpickler error: ")[:160]
    return (
        f"refused: loading needs more than torch.load(weights_only=True), and rlbench unpickles nothing else ({reason})"
    )
