"""A run directory's checkpoints held to the checksums the run recorded for them, before diff or replay speaks.

RUN/checkpoints/NNNNNN/ is the state after NNNNNN steps. What each file must hold is recorded elsewhere in the run:

- model.safetensors (the Hugging Face weights): checksums.jsonl's `weights` at step NNNNNN - 1 (the train stage
  checksummed this same export), and for 000000 the manifest's `hashes.initial_weights`;
- the torch trainer's optimizer.safetensors: optimizer.json's `tensors_checksum`;
- the megatron trainer's optimizer-tpRR.safetensors: layout.json's `optimizer.shard_checksums`, and its
  model-tpRR.safetensors: rank RR's part of the verified model.safetensors (convert.to_megatron; replicated
  tensors as rank 0 holds them);
- state.json: its `steps_done` is the directory's number;
- a PPO run's critic/ (model.safetensors, optimizer.*): its weights held to checksums.jsonl's `critic_weights` at
  step NNNNNN - 1, and for 000000 the manifest's `hashes.initial_critic`; its optimizer as the torch trainer's. The
  actor's weights after a critic-only step are the initial ones (the actor did not train).

A file that does not hold what was recorded is bad input naming it (exit 2), never a verdict: it is one run's
damaged input, which its own checksums expose, not a difference between two runs (design.md: a corrupt or edited
file is bad input). A checkpoint past the last committed step, or an unfinished one (.NNNNNN.tmp), is ignored and
said in a note, as a reader ignores uncommitted steps. Checksumming reads every byte once: a tiny run's checkpoints
take milliseconds, a large model's as long as reading it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from rlbench.errors import BadInput
from rlbench.rundir.directory import RunDir
from rlbench.rundir.jsonio import read_json

CHECKPOINT_NAME = re.compile(r"\d{6}")
_UNFINISHED = re.compile(r"\.\d{6}\.tmp")  # the writer's temporary name until the rename
DAMAGED = "the checkpoint was changed or damaged after it was written"


@dataclass
class Verified:
    """What verify_checkpoints read: the checkpoints (steps done) it held to the run's checksums, and notes."""

    steps_done: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verify_checkpoints(run: RunDir) -> Verified:
    """Verify every committed checkpoint of `run` against what the run recorded (its checksums.jsonl rows as
    read, before any narrowing to a step range); a mismatch is BadInput naming the file."""
    found = Verified()
    folder = run.root / "checkpoints"
    if not folder.is_dir():
        return found
    last = max(run.steps, default=-1)  # a run replayed from a checkpoint commits steps A.. only
    for path in sorted(folder.iterdir()):
        if not CHECKPOINT_NAME.fullmatch(path.name):
            what = "an unfinished checkpoint" if _UNFINISHED.fullmatch(path.name) else "not a checkpoint"
            found.notes.append(f"{path}: ignored ({what})")
            continue
        done = int(path.name)
        if done - 1 > last:
            found.notes.append(f"{path}: ignored (after {done} steps, past the last committed step {last})")
            continue
        expected = recorded_weights(run, done)
        if expected is None:
            found.notes.append(f"{path}: not verified (the run recorded no weights checksum for it)")
            continue
        _verify(path, done, expected)
        if run.manifest.get("config", {}).get("algo", {}).get("advantage") == "ppo":
            _verify_critic(path, done, recorded_weights(run, done, critic=True))
        found.steps_done.append(done)
    return found


def recorded_weights(run: RunDir, done: int, critic: bool = False) -> str | None:
    """The weights checksum the run recorded for its checkpoint after `done` steps (manifest.json's
    hashes.initial_weights for 0 and after PPO's critic-only steps, else checksums.jsonl's weights at step
    done - 1), or None; `critic`: a PPO run's critic's (hashes.initial_critic, critic_weights)."""
    key, initial = ("critic_weights", "initial_critic") if critic else ("weights", "initial_weights")
    algo = run.manifest.get("config", {}).get("algo", {})
    untrained = 0 if critic or algo.get("advantage") != "ppo" else algo.get("num_critic_only_steps", 0)
    if done <= untrained:
        hashes = run.manifest.get("hashes")
        expected = hashes.get(initial) if isinstance(hashes, dict) else None
    else:
        expected = next((row.get(key) for row in run.checksums if row["step"] == done - 1), None)
    return expected if isinstance(expected, str) else None


def _verify_critic(path: Path, done: int, weights: str | None) -> None:
    """A PPO checkpoint's critic/: its weights held to the run's checksum, its optimizer state to its own."""
    from rlbench.core.model import load_safetensors
    from rlbench.rundir.digest import weights_digest

    folder = path / "critic"
    if not (folder / "model.safetensors").is_file():
        raise BadInput(
            f"expected critic/model.safetensors (a PPO run's checkpoint holds its critic): {DAMAGED}", path=path
        )
    if weights is None:
        raise BadInput("the run recorded no checksum of its critic's weights for this checkpoint", path=folder)
    hf = load_safetensors(folder / "model.safetensors")
    if weights_digest(hf) != weights:
        where = (
            "manifest.json's hashes.initial_critic"
            if done == 0
            else f"checksums.jsonl's critic_weights at step {done - 1}"
        )
        raise BadInput(f"the critic's weights do not match {where}: {DAMAGED}", path=folder / "model.safetensors")
    if (folder / "layout.json").is_file():  # the megatron trainer's critic: its rank shards
        _verify_megatron(folder, hf)
    else:
        _verify_torch(folder)


def _verify(path: Path, done: int, weights: str) -> None:
    hf = verify_weights(path, done, weights)
    if (path / "layout.json").is_file():
        _verify_megatron(path, hf)
    elif (path / "optimizer.json").is_file():
        _verify_torch(path)
    else:
        raise BadInput("expected optimizer.json (torch trainer) or layout.json (megatron trainer)", path=path)


def verify_weights(path: Path, done: int, weights: str) -> dict:
    """The checkpoint folder `path` (after `done` steps) whole, and its Hugging Face weights held to the run's
    checksum `weights`: returns them; anything else is BadInput naming the file."""
    from rlbench.core.model import load_safetensors
    from rlbench.rundir.digest import weights_digest

    if not (path / "state.json").is_file():
        raise BadInput(f"not a whole checkpoint (no state.json): {DAMAGED}", path=path)
    state = read_json(path / "state.json")
    if not isinstance(state, dict) or state.get("steps_done") != done:
        got = state.get("steps_done") if isinstance(state, dict) else state
        raise BadInput(
            f"expected steps_done {done} (the directory's number), got {got!r}",
            path=path / "state.json",
            field="steps_done",
        )
    model = path / "model.safetensors"
    hf = load_safetensors(model)
    if weights_digest(hf) != weights:
        where = (
            "manifest.json's hashes.initial_weights" if done == 0 else f"checksums.jsonl's weights at step {done - 1}"
        )
        raise BadInput(f"the weights do not match {where}: {DAMAGED}", path=model)
    return hf


def _verify_torch(path: Path) -> None:
    from rlbench.core.model import load_safetensors
    from rlbench.rundir.digest import tensors_digest

    meta = read_json(path / "optimizer.json")
    expected = meta.get("tensors_checksum") if isinstance(meta, dict) else None
    if not isinstance(expected, str):
        raise BadInput(
            "expected the optimizer tensors' checksum (a string)",
            path=path / "optimizer.json",
            field="tensors_checksum",
        )
    tensors = load_safetensors(path / "optimizer.safetensors")
    if tensors_digest(sorted(tensors.items())) != expected:
        raise BadInput(
            f"its tensors do not match optimizer.json's tensors_checksum: {DAMAGED}",
            path=path / "optimizer.safetensors",
        )


def _verify_megatron(path: Path, hf: dict) -> None:
    """Each rank's optimizer shard against its recorded checksum; each rank's model shard against the verified
    Hugging Face weights cut as that rank holds them (convert.to_megatron: a re-layout, bit for bit). A replicated
    tensor (a norm) is recorded as rank 0 holds it, as the export gathers it: the other ranks' copies are held to
    nothing, for a run whose ranks let them drift apart (an unreduced q/k-norm gradient) wrote them so."""
    from rlbench.backends.megatron.convert import REPLICATED, Dims, params, to_megatron
    from rlbench.core.model import load_safetensors
    from rlbench.rundir.digest import tensors_digest

    layout = read_json(path / "layout.json")
    critic = isinstance(layout, dict) and layout.get("role") == "critic"  # PPO's critic: its names and head
    try:
        tp, dims = int(layout["tp"]), Dims(**layout["dims"])
        sums = layout["optimizer"]["shard_checksums"]
    except (TypeError, KeyError, ValueError):
        raise BadInput("expected tp, dims and optimizer.shard_checksums", path=path / "layout.json") from None
    if not isinstance(sums, list) or len(sums) != tp:
        raise BadInput(
            f"expected {tp} shard checksums, got {sums!r}"[:200],
            path=path / "layout.json",
            field="optimizer.shard_checksums",
        )
    for r in range(tp):
        shard = path / f"optimizer-tp{r:02d}.safetensors"
        if tensors_digest(sorted(load_safetensors(shard).items())) != sums[r]:
            raise BadInput(f"its tensors do not match layout.json's optimizer.shard_checksums: {DAMAGED}", path=shard)
        shard = path / f"model-tp{r:02d}.safetensors"
        try:
            expected = to_megatron(hf, dims, tp, r, critic)
        except (KeyError, RuntimeError, ValueError):
            raise BadInput(f"the weights do not fit layout.json's dims: {DAMAGED}", path=path / "layout.json") from None
        held = load_safetensors(shard)
        if r > 0:
            replicated = {p.megatron for p in params(dims, critic) if p.kind == REPLICATED}
            expected = {k: v for k, v in expected.items() if k not in replicated}
            held = {k: v for k, v in held.items() if k not in replicated}
        if tensors_digest(sorted(held.items())) != tensors_digest(sorted(expected.items())):
            raise BadInput(
                f"its tensors are not rank {r}'s part of the verified model.safetensors: {DAMAGED}", path=shard
            )


def counted(n: int) -> str:
    """How many checkpoints were verified, as a verdict says it."""
    return str(n) if n else "none (no checkpoint: not compared)"


def describe(counts: dict[str, int]) -> str:
    """The verdict's words for both sides' checkpoints: how many each verified, or that it had none."""
    return "checkpoints verified: " + ", ".join(f"{side} {counted(n)}" for side, n in counts.items())
