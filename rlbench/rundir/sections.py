"""The manifest's sections held to their types when it is read back (directory.read_run, the one reader every
command goes through), before any reader relies on them: a section of another type (`config.model` a string,
say) is one line naming the file and the field, exit 2, for every command alike. Apart from manifest.py,
which writes them, so that the reader does not import the writer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlbench.errors import BadInput

# The manifest's own sections that are objects when written; null is read as absent (a run without them).
OBJECT_SECTIONS = ("versions", "platform", "determinism", "weights", "numerics", "hashes", "vocab", "source", "engines")


def _config_tables() -> list[str]:
    """The config's tables, as `config.to_dict()` writes them: each section ("config.model") and each table
    inside one ("config.rollout.sglang")."""
    from rlbench.config import RunConfig

    tables, config = [], RunConfig()
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            tables.append(f"config.{section.name}")
            tables += [
                f"config.{section.name}.{f.name}"
                for f in dataclasses.fields(value)
                if isinstance(getattr(value, f.name), dict)
            ]
    return tables


def check_sections(made: dict, path: Path) -> None:
    """Every section of the manifest `made` (read from `path`) that is written as an object is one, or absent:
    BadInput naming the file and the field otherwise. The config's tables may not be null (a config always has
    them); the manifest's own sections may (older runs wrote some as null). Values inside are the readers'."""

    def refuse(field: str, got: object) -> BadInput:
        return BadInput(
            f"expected an object (a table), got {'null' if got is None else type(got).__name__}", path=path, field=field
        )

    for key in OBJECT_SECTIONS:
        if made.get(key) is not None and not isinstance(made[key], dict):
            raise refuse(key, made[key])
    for field in _config_tables():
        node: object = made
        parts = field.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node and not isinstance(node[parts[-1]], dict):
            raise refuse(field, node[parts[-1]])
