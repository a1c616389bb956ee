"""CLI options declared from the config fields they set, so an option cannot drift from its field.

`config_option("rollout.backend", "--rollout")` is a typer option whose help is the field's own
help (`rlbench.config.setting`), with the field's default shown; it remembers the field it sets.
`option_fields(command)` reads those back from a command's signature: the table a command turns
its arguments into config overrides with (and `--resume` refuses them by). `disagreements(...)`
holds each option to its field (name, type, default, help); tests/cpu/test_cli_config.py runs it
over every command.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from pathlib import Path
from typing import Any
from collections.abc import Callable

import typer

from rlbench.config import RunConfig


class AsyncMode(str, enum.Enum):  # rollout.async_mode (issue 38)
    off = "off"
    one_step = "one-step"
    fully = "fully"


class WeightMode(str, enum.Enum):  # rollout.update_weight_mode (issue 38)
    full = "full"
    delta = "delta"


@dataclasses.dataclass(frozen=True)
class FieldOption:
    """What an option sets: the dotted field of `root`, and for a flag the value it sets when given;
    `names` as declared (none: typer's --param-name)."""

    path: str
    root: type
    flag_value: Any = None
    names: tuple[str, ...] = ()
    default_text: str | None = None  # what --help says the default is, where the field's default is computed

    def label(self, param: str) -> str:
        """The option's name in a message: its last declared name (the short alias), else typer's."""
        return self.names[-1] if self.names else f"--{param.replace('_', '-')}"


@functools.cache
def _defaults(root: type) -> Any:
    """`root()`, made once: every option of a command reads its field's default from it (a CLI builds its
    commands' options at each call, ~200 of them)."""
    return root()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_of(path: str, root: type = RunConfig) -> tuple[dataclasses.Field, Any, Any]:
    """The dataclass field at a dotted `path` of `root`: (field, its default, its type). The default is
    shared between calls: read it, never change it."""
    cls, default = root, _defaults(root)
    *sections, name = path.split(".")
    for section in sections:
        default = getattr(default, section)
        cls = type(default)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if name not in by_name:
        raise KeyError(f"{root.__name__} has no field {path!r}")
    return by_name[name], getattr(default, name), _hints(cls)[name]


def shown(value: Any) -> str:
    """A default as --help shows it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def config_option(
    path: str,
    *names: str,
    root: type = RunConfig,
    default_text: str | None = None,
    flag_value: Any = None,
    **kwargs: Any,
) -> Any:
    """A typer option that sets the field `path` of `root`: its help is the field's help and the
    field's default (or `default_text`, where the field's default means "computed": None). A flag
    sets `flag_value` when given (`--no-record` sets record = False)."""
    field, default, _ = field_of(path, root)
    text = field.metadata.get("help")
    if not text:
        raise KeyError(f"{root.__name__}.{path} has no help: declare it with rlbench.config.setting")
    text = text.replace("[", "\\[")  # rich markup: a literal bracket
    if flag_value is None:
        text += f" \\[default: {default_text if default_text is not None else shown(default)}]"
    else:
        text += f" \\[sets {path} = {shown(flag_value)}; default: {shown(default)}]"
    info = typer.Option(*names, help=text, **kwargs)
    info.rlbench_field = FieldOption(
        path, root, flag_value, tuple(n for n in names if n.startswith("--")), default_text
    )
    return info


def option_fields(command: Callable) -> dict[str, FieldOption]:
    """Each parameter of `command` declared with `config_option`: parameter name -> the field it sets."""
    found = {}
    for name, hint in typing.get_type_hints(command, include_extras=True).items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(getattr(meta, "rlbench_field", None), FieldOption):
                found[name] = meta.rlbench_field
    return found


def to_config(value: Any, option: FieldOption) -> Any:
    """A parsed option value as its field holds it (None: not given)."""
    if option.flag_value is not None:
        return option.flag_value if value else None
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    _, default, _ = field_of(option.path, option.root)
    if isinstance(default, tuple) and isinstance(value, str):  # a comma-separated list
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


def overrides(command: Callable, params: dict[str, Any]) -> dict[str, Any]:
    """The options given on the command line as config overrides (`section__field=value`)."""
    out = {}
    for name, option in option_fields(command).items():
        value = to_config(params.get(name), option)
        if value is not None:
            out[option.path.replace(".", "__")] = value
    return out


def disagreements(command: Callable, click_command) -> list[str]:
    """Where an option of `command` (its click form: `click_command`) disagrees with its field: the
    type it parses, the default its help shows, the help text. [] when every option agrees."""
    found = []
    params = {p.name: p for p in click_command.params}
    for name, option in option_fields(command).items():
        param = params[name]
        field, default, hint = field_of(option.path, option.root)
        label = f"{'/'.join(param.opts)} ({option.root.__name__}.{option.path})"
        expected = _expected_type(hint)
        parsed = _parsed_type(param)
        if option.flag_value is not None:
            if not getattr(param, "is_flag", False) or expected != "bool" or option.flag_value == default:
                found.append(f"{label}: a flag sets a bool field to its non-default value")
        elif isinstance(expected, frozenset):
            if parsed != expected:
                found.append(
                    f"{label}: choices {sorted(parsed) if isinstance(parsed, frozenset) else parsed}, "
                    f"the field takes {sorted(expected)}"
                )
        elif parsed != expected:
            found.append(
                f"{label}: parses {getattr(parsed, '__name__', parsed)}, "
                f"the field holds {getattr(expected, '__name__', expected)}"
            )
        if param.default is not None and option.flag_value is None:
            found.append(f"{label}: defaults to {param.default!r} itself; an option left out must mean the config's")
        text = " ".join((param.help or "").split()).replace("\\[", "[")
        want = " ".join(field.metadata.get("help", "").split())
        if not text.startswith(want):
            found.append(f"{label}: help {text!r} is not the field's {want!r}")
        if option.flag_value is not None:
            marker = f"[sets {option.path} = {shown(option.flag_value)}; default: {shown(default)}]"
        else:
            marker = f"[default: {option.default_text if option.default_text is not None else shown(default)}]"
        if marker not in text:
            found.append(f"{label}: --help does not show the field's default ({marker})")
    return found


def _parsed_type(param) -> Any:
    """What an option parses, in `_expected_type`'s terms (a path is a string to the config)."""
    annotation = param.type_descriptor.annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return frozenset(member.value for member in annotation)
    return {Path: str}.get(annotation, "bool" if annotation is bool else annotation)


def _expected_type(hint: Any) -> Any:
    """int, float, str, "bool", or the set of a Literal's choices, for a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return frozenset(typing.get_args(hint))
    if hint is bool:
        return "bool"
    if hint in (int, float, str):
        return hint
    if typing.get_origin(hint) is tuple:
        return str  # a comma-separated list on the command line
    if len(args) == 1:  # X | None
        return _expected_type(args[0])
    return repr(hint)
