"""The run directory (schema `rlbench.run/1`): written so a crash loses nothing committed.

    RUN/manifest.json                  schema, checksum algorithm, resolved config, seed, versions, platform, hashes
    RUN/metrics.jsonl                  one line per committed step, written last: the commit point
    RUN/checksums.jsonl                one line per step: {"step": n, "<stage>": "<checksum>", ...}
    RUN/rollouts/NNNNNN.safetensors    the step's tensors (flat tokens + offsets, masks, log-probs, ...)
    RUN/rollouts/NNNNNN.json           the step's per-sample metadata
    RUN/checkpoints/NNNNNN/            state after NNNNNN steps (000000: the initial weights)

Every file is written to a temporary name, fsynced, and renamed into place; the two JSONL logs
are appended and fsynced, checksums before metrics. A step is committed once its metrics line
(newline included) is on disk; a reader ignores anything past the last committed step, torn
lines included, and says so.

A run directory has one writer: the command holding `RUN/.lock` (lock.py). A new one is claimed
atomically: made whole (lock, logs, manifest) in a sibling temporary directory and renamed into place,
so a kill leaves either no run directory or a complete one. Nothing is written through a link: files
are opened with O_NOFOLLOW, and resume refuses a directory holding links or entries it did not make.

The bytes are made on the caller's thread; the writes and fsyncs run in order on one background (writes.py)
thread, so the disk's latency overlaps the next step's compute instead of adding to it (an fsync
costs ~4 ms here, six of them were a fifth of a step). Order is what makes the commit protocol
hold, and one thread keeps it: a crash loses at most the steps still queued, never committed ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.errors import BadInput
from rlbench.rundir.algorithm import CHECKSUM, SCHEMA, older_checksums
from rlbench.rundir.failpoints import hit
from rlbench.rundir.jsonio import parse_json, read_bytes, read_json
from rlbench.rundir.lock import NAME as LOCK_NAME, RunLock
from rlbench.rundir.writes import fsync_dir, write_new, atomic_write, append_line, OrderedWriter

if TYPE_CHECKING:  # readers (check golden, diff's first pass) need no torch
    import torch

# checksums.jsonl: the digests each stage of the loop adds to a step's line, in loop order.
STAGE_CHECKSUMS = {
    "data": ("data",),
    "rollout": ("rollout_tokens", "rollout_logprobs"),
    "reward": ("rewards",),
    "recorded": ("data", "rollout_tokens", "rollout_logprobs", "rewards"),
    "values": ("values",),
    "advantage": ("advantages",),
    "critic_train": ("critic_loss", "critic_grads", "critic_weights"),
    "logprob": ("old_logprobs",),
    "train": ("loss", "grads", "weights"),
    "sync": ("engine_weights",),
}
CHECKSUM_KEYS = (
    "data",
    "rollout_tokens",
    "rollout_logprobs",
    "rewards",
    "values",
    "advantages",
    "critic_loss",
    "critic_grads",
    "critic_weights",
    "old_logprobs",
    "loss",
    "grads",
    "weights",
    "engine_weights",
)


def step_name(step: int) -> str:
    return f"{step:06d}"


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    """Complete lines as records; a torn last line is ignored and noted, any other bad line raises."""
    rows, notes = [], []
    if not path.exists() and not path.is_symlink():
        return rows, notes
    raw = read_bytes(path)
    lines = raw.split(b"\n")
    if lines and lines[-1]:
        notes.append(f"{path.name}: ignored a torn last line (a write was cut off)")
    for lineno, line in enumerate(lines[:-1], start=1):
        row = parse_json(line, path, f"JSON at line {lineno}")
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("step"), int)
            or isinstance(row["step"], bool)
            or row["step"] < 0
        ):
            raise BadInput(
                f"line {lineno}: not a step record (expected an object with an integer 'step' >= 0)", path=path
            )
        rows.append(row)
    return rows, notes


class RunWriter:
    """Creates a run directory (refusing one that holds anything else) and commits steps to it,
    holding the directory's lock until `close`."""

    def __init__(self, root: Path, manifest: dict | None, record: bool = True):
        """Create the run directory for `manifest`; with manifest=None, reopen an existing one to
        append to it (resume: the caller has already cut it back to its committed steps)."""
        self.root, self.record = Path(root), record
        self.created, self.existed, self.commits = manifest is not None, Path(root).is_dir(), 0
        if manifest is None:
            self.lock = RunLock(self.root).acquire()
        else:
            self.lock = self._claim(manifest)
        self._writer = OrderedWriter()
        # What else follows the commits (core/trackers.py): `committed(line)` with each metrics line once it is on
        # disk, on the writer's thread and in order; `close()` after the last write landed.
        self.on_commit = None

    def _claim(self, manifest: dict) -> RunLock:
        """Refuse an --out that holds anything, then make the run directory whole beside it and rename it
        into place: another process sees no directory or a complete one, never a half-made claim."""
        root = self.root
        self._refuse_taken(manifest)
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"cannot make the directory that holds --out ({exc.strerror})", path=root) from None
        tmp = root.parent / f".{root.name}.claim-{os.getpid()}"
        if tmp.is_symlink() or tmp.is_file():
            tmp.unlink()
        elif tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir()
        except OSError as exc:
            raise BadInput(f"cannot create the run directory ({exc.strerror})", path=root) from None
        lock = RunLock(tmp).acquire()
        try:
            (tmp / "rollouts").mkdir()
            (tmp / "checkpoints").mkdir()
            for log in ("checksums.jsonl", "metrics.jsonl"):
                write_new(tmp / log, b"")
            atomic_write(tmp / "manifest.json", (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            hit("claim.made")
            try:
                os.rename(tmp, root)  # onto nothing, or onto an empty directory
            except OSError:
                raise BadInput(
                    "--out was claimed by another run meanwhile; nothing was overwritten", path=root
                ) from None
        except BaseException:
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        lock.moved(root)
        fsync_dir(root.parent)
        return lock

    def _refuse_taken(self, manifest: dict) -> None:
        root = self.root
        if root.is_symlink() or (root.exists() and not root.is_dir()):
            raise BadInput("--out exists and is not a directory", path=root)
        if root.is_dir() and any(root.iterdir()):
            existing = root / "manifest.json"
            if not existing.is_file():
                raise BadInput("--out is not empty and holds no rlbench run; choose a new --out", path=root)
            try:
                old = json.loads(existing.read_text())
            except ValueError:
                old = {}
            differs = sorted(
                k
                for k in set(old.get("config", {})) | set(manifest["config"])
                if old.get("config", {}).get(k) != manifest["config"].get(k)
            )
            what = f"a different run (config differs in: {', '.join(differs)})" if differs else "this run"
            raise BadInput(f"--out already holds {what}; nothing was overwritten, choose a new --out", path=root)

    def commit_step(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        samples: list[dict],
        checksums: dict[str, str],
        metrics: dict[str, float],
        extra: dict | None = None,
    ) -> None:
        """Queue the step's recording, then its checksums, then its metrics line (the commit)."""
        from rlbench.rundir.recording import encode_step

        files = {}
        if self.record:
            tensor_bytes, json_bytes = encode_step(step, tensors, samples, extra)
            files = {f"{step_name(step)}.safetensors": tensor_bytes, f"{step_name(step)}.json": json_bytes}
        checksum_line, metrics_line = {"step": step, **checksums}, {"step": step, **metrics}
        self.commits += 1

        def job() -> None:
            for name, data in files.items():
                atomic_write(self.root / "rollouts" / name, data, sync_dir=False)
            if files:
                fsync_dir(self.root / "rollouts")
                hit("rollout.renamed")
            append_line(self.root / "checksums.jsonl", checksum_line)
            hit("checksums.appended")
            append_line(self.root / "metrics.jsonl", metrics_line)
            hit("metrics.appended")
            if self.on_commit is not None:  # after the commit point: a step is logged elsewhere once committed
                self.on_commit.committed(metrics_line)

        self._writer.submit(job)

    def write_checkpoint(self, steps_done: int, files: dict[str, bytes | memoryview], state: dict) -> None:
        """Queue checkpoints/NNNNNN/: written whole under a temporary name, then renamed into place."""
        files = {**files, "state.json": (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()}
        self._writer.submit(lambda: self._write_checkpoint(steps_done, files))

    def _write_checkpoint(self, steps_done: int, files: dict[str, bytes | memoryview]) -> None:
        final = self.root / "checkpoints" / step_name(steps_done)
        tmp = final.with_name(f".{final.name}.tmp")
        if tmp.is_symlink():
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # per-rank subdirectories
            write_new(tmp / name, data)
            hit("checkpoint.partial")
        fsync_dir(tmp)
        hit("checkpoint.tmp_complete")
        if final.exists():  # only after a crash between rename and commit: the same step is rewritten
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        hit("checkpoint.renamed")

    def has_checkpoint(self, steps_done: int) -> bool:
        return (self.root / "checkpoints" / step_name(steps_done) / "state.json").is_file()

    def flush(self) -> None:
        """Wait for every queued write to land (and raise if one failed)."""
        self._writer.flush()

    def close(self) -> None:
        """Wait for every queued write to land (and raise if one failed), close what follows the commits; then let
        the directory go."""
        try:
            self._writer.close()
        finally:
            follower, self.on_commit = self.on_commit, None
            try:
                if follower is not None:
                    follower.close()
            finally:
                self.lock.release()

    def discard(self) -> None:
        """A run that failed before committing any step: remove the directory this writer made (back to the
        empty directory it found, if it found one), so the same --out can be used again."""
        try:
            self.close()
        except BaseException:  # noqa: BLE001 - the run's own error is the one to report
            pass
        if self.created and self.commits == 0 and self.root.is_dir() and not self.root.is_symlink():
            shutil.rmtree(self.root, ignore_errors=True)
            if self.existed:
                self.root.mkdir(exist_ok=True)


@dataclass
class RunDir:
    """A run directory as read back: only committed steps, with what was ignored noted."""

    root: Path
    manifest: dict
    metrics: list[dict]
    checksums: list[dict]
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [row["step"] for row in self.metrics]

    @property
    def checksum_keys(self) -> list[str]:
        """The checksums each committed step of this run must have, from the stages its manifest names."""
        stages = self.manifest.get("stages")
        if not isinstance(stages, list) or not all(s in STAGE_CHECKSUMS for s in stages):
            raise BadInput(
                f"expected a list of stages from {', '.join(STAGE_CHECKSUMS)}, got {stages!r}",
                path=self.root / "manifest.json",
                field="stages",
            )
        keys = {k for stage in stages for k in STAGE_CHECKSUMS[stage]}
        return [k for k in CHECKSUM_KEYS if k in keys]

    def keys_at(self, step: int) -> list[str]:
        """The checksums step `step` must have: `checksum_keys`, less the actor's (logprob, train) on a PPO run's
        critic-only steps, where slime's actor computes nothing (and, imported from slime's dumps, the critic's
        values and the advantages too: no train dump holds them)."""
        algo = (self.manifest.get("config") or {}).get("algo") or {}
        critic_only = algo.get("num_critic_only_steps", 0) if algo.get("advantage") == "ppo" else 0
        if isinstance(critic_only, int) and step < critic_only:
            actor = STAGE_CHECKSUMS["logprob"] + STAGE_CHECKSUMS["train"]
            if self.manifest.get("imported"):
                actor += STAGE_CHECKSUMS["values"] + STAGE_CHECKSUMS["advantage"]
            return [k for k in self.checksum_keys if k not in actor]
        return self.checksum_keys

    def require_checksums(self) -> None:
        """Verification data or nothing: every committed step has its checksums line, holding a checksum for
        every stage the run records. Anything less is bad input, never a verdict over what is there."""
        path = self.root / "checksums.jsonl"
        if self.steps and not path.is_file():
            raise BadInput(f"missing: {len(self.steps)} committed steps and no checksums to verify them by", path=path)
        rows = {row["step"]: row for row in self.checksums}
        missing = [s for s in self.steps if s not in rows]
        if missing:
            raise BadInput(
                f"no checksums for committed step(s) {_steps_text(missing)} of {len(self.steps)} (truncated or edited)",
                path=path,
            )
        for step in self.steps:
            row = rows[step]
            bad = [
                k
                for k in self.keys_at(step)
                if not (
                    isinstance(row.get(k), str) and len(row[k]) == 64 and all(c in "0123456789abcdef" for c in row[k])
                )
            ]
            if bad:
                raise BadInput(
                    f"step {step}: expected a checksum (64 hex digits) for {', '.join(bad)} (the run's "
                    f"stages {', '.join(self.manifest['stages'])} record them)",
                    path=path,
                )


_FILES = {"manifest.json", "metrics.jsonl", "checksums.jsonl", LOCK_NAME}
_STEP_FILE = re.compile(r"\.?\d{6}\.(safetensors|json)(\.tmp)?")
_CHECKPOINT = re.compile(r"\.?\d{6}(\.tmp)?")


def foreign_entries(root: Path) -> list[str]:
    """What a run directory holds that rlbench did not make, links first: resume refuses to write into
    a directory holding any (it would write or delete through a link, or drop a user's file)."""
    root = Path(root)
    if root.is_symlink():
        return ["(the run directory itself is a link)"]
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        parts = rel.parts
        if path.is_symlink():
            found.append(f"{rel} (a link)")
        elif len(parts) == 1:
            ok = (parts[0] in ("rollouts", "checkpoints") and path.is_dir()) or (
                path.is_file() and (parts[0] in _FILES or re.fullmatch(r"\.[\w.]+\.tmp", parts[0]))
            )
            if not ok:
                found.append(str(rel))
        elif parts[0] == "rollouts":
            if len(parts) != 2 or not path.is_file() or not _STEP_FILE.fullmatch(parts[1]):
                found.append(str(rel))
        elif parts[0] == "checkpoints":
            if len(parts) == 2 and not (path.is_dir() and _CHECKPOINT.fullmatch(parts[1])):
                found.append(str(rel))
    return found


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:6]))
    return shown + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")


def _one_line_per_step(rows: list[dict], path: Path) -> None:
    """A step has one line in each log: rlbench appends it once and resume cuts back before it writes,
    so a second line (`rows[i]` is line i + 1) is an edit or a mix-up, which no reader picks a side of."""
    first: dict[int, int] = {}
    for i, row in enumerate(rows):
        step = row["step"]
        if step in first:
            earlier = rows[first[step]]
            differ = [k for k in dict.fromkeys([*earlier, *row]) if earlier.get(k) != row.get(k)]
            how = f"differing at {', '.join(differ[:3])}" if differ else "the same again"
            raise BadInput(
                f"line {i + 1}: a second line for step {step} (line {first[step] + 1} is the first), {how}", path=path
            )
        first[step] = i


def _numbers_only(metrics: list[dict], path: Path) -> None:
    """Every metric a number (NaN included: a gate fails it by name), never a string, a boolean or null."""
    for i, row in enumerate(metrics):
        for key, value in row.items():
            if key != "step" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise BadInput(f"line {i + 1}: {_shown(key)} is {_shown(value)}, expected a number", path=path)


def _shown(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def read_run(root: str | Path) -> RunDir:
    """Validate and read a run directory's manifest and logs, keeping committed steps only."""
    root = Path(root)
    path = root / "manifest.json"
    if not path.is_file():
        raise BadInput("not a run directory (no manifest.json)", path=root)
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise BadInput(f"expected {SCHEMA!r}, got {got!r}", path=path, field="schema")
    if manifest.get("checksum") != CHECKSUM:
        raise BadInput(older_checksums(manifest.get("checksum")), path=path, field="checksum")
    for key, kind in (("config", dict), ("stages", list), ("mode", str)):
        if not isinstance(manifest.get(key), kind):
            raise BadInput(
                f"expected {kind.__name__ if kind is not dict else 'an object'}, got "
                f"{type(manifest.get(key)).__name__}",
                path=path,
                field=key,
            )
    from rlbench.rundir.sections import check_sections

    check_sections(manifest, path)
    metrics, notes = _read_jsonl(root / "metrics.jsonl")
    checksums, more = _read_jsonl(root / "checksums.jsonl")
    notes += more
    _one_line_per_step(metrics, root / "metrics.jsonl")
    _one_line_per_step(checksums, root / "checksums.jsonl")
    _numbers_only(metrics, root / "metrics.jsonl")
    committed = {row["step"] for row in metrics}
    extra = [row["step"] for row in checksums if row["step"] not in committed]
    if extra:
        notes.append(f"checksums.jsonl: ignored uncommitted step(s) {extra} (no metrics line)")
    checksums = [row for row in checksums if row["step"] in committed]
    return RunDir(root, manifest, metrics, checksums, notes)
