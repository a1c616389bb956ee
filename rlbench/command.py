"""A command line, as `rlbench run` reads it, turned into the run's `RunConfig` by one library function,
`run_config`: the defaults, then the TOML file, then the options given, then slime's own arguments (with slime's
defaults for the settings slime defines, where neither the file nor an option says otherwise; an rlbench option
and a slime argument that set one setting are refused together), `--sglang-*` passed through to the servers,
and, for a train-only run, the recording's settings (with a note for each one that replaced what was asked).
Relative paths from the command line resolve against the working directory (a TOML file's against its folder:
rlbench/config.py), recorded absolute. The CLI parses, calls this, and renders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rlbench import slime_args
from rlbench.config import NULL, RunConfig, absolute_paths, apply_overrides, file_keys, load_config
from rlbench.errors import BadInput


@dataclass(frozen=True)
class CommandConfig:
    """What a command line resolves to: the config, the notes a train-only run gets (each setting the recording
    replaced), and each slime argument given with its value and the settings it set."""

    config: RunConfig
    notes: list[str]
    slime: list[tuple[str, object, dict]]


def run_config(
    extra: list[str],
    config: Path | None = None,
    given: dict | None = None,
    rollouts: Path | None = None,
    steps: int | None = None,
) -> CommandConfig:
    """The run a command line asks for. `extra`: the arguments rlbench's own options did not take (slime's
    arguments, `--sglang-*`; anything else is refused by name); `config`: the TOML file; `given`: the options given,
    as load_config's `section__field` overrides; `rollouts`: the recording a train-only run trains on; `steps`: the
    steps asked for, which a train-only run holds to the recording's."""
    sglang, slime_given = split_extra(extra)
    given = dict(given or {})
    explained: list = []
    if slime_given:
        given, explained = with_slime(config, given, slime_given)
    cfg = load_config(config, **given)
    if sglang:
        cfg = apply_overrides(cfg, rollout__sglang={**cfg.rollout.sglang, **sglang})
    notes = []
    if rollouts is not None:
        from rlbench.replay.replay import recorded_overrides, train_only_config

        asked = cfg
        cfg = train_only_config(cfg, rollouts, steps)
        notes = [f"train-only: {note}" for note in recorded_overrides(asked, cfg)]
    if cfg.out is None:
        cfg = cfg.replace(out=default_out())
    # recorded absolute, so `--resume` and replay read them from anywhere; the run directory stays as given (every
    # later command is given it, and the summary names it as the user wrote it)
    cfg = absolute_paths(cfg, keep=("out",))
    return CommandConfig(cfg, notes, explained)


def default_out() -> str:
    """runs/run-<time>: where a run goes when no --out is given."""
    return f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}"


def split_extra(args: list[str]) -> tuple[dict, dict]:
    """The arguments rlbench's options did not take: `--sglang-KEY VALUE` (or a bare `--sglang-KEY` flag), passed
    through to the servers, and slime's own arguments (rlbench/slime_args.py); anything else is refused by name."""
    sglang, rest, i = {}, [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--sglang-") and len(arg) > len("--sglang-") and arg.partition("=")[0] not in slime_args.ARGS:
            key, _, value = arg[len("--sglang-") :].partition("=")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            sglang[key] = value or True
        else:
            rest.append(arg)
        i += 1
    return sglang, slime_args.parse(rest)


def with_slime(config: Path | None, given: dict, slime_given: dict) -> tuple[dict, list]:
    """The run's overrides with slime's arguments (and slime's defaults, where neither the config file nor an
    option says otherwise) merged in; an rlbench option and a slime argument that set one field are refused
    together."""
    fields, explained = slime_args.resolve(slime_given)
    named = {path: name for name, _, sets in explained for path in sets}
    clash = sorted(named[path] for path in named if path.replace(".", "__") in given)
    if clash:
        raise BadInput(f"{clash[0]} and an rlbench option set the same setting: give one of them", field="rlbench run")
    in_file = file_keys(config) if config is not None else set()
    merged = {
        path.replace(".", "__"): NULL if value is None else value
        for path, value in fields.items()
        if path in named or path not in in_file
    }
    return {**merged, **given}, explained
