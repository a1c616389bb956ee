"""The weight-update check, for every trainer: what the engine holds after a sync is the trainer's
export, bit for bit (slime: --check-weight-update-equal).

Two comparisons. After every sync, the engine's own export must equal what the trainer sent
(a loader that drops, re-fuses or re-casts a tensor shows here). Before step 0, the trainer's
first export must equal the weights the engine loaded from the model itself: the trainer was
initialised from those same weights, so a conversion that is wrong one way (a fused QKV or
gate/up split, a tied embedding) shows before a single step is trained.

An engine reports what it holds as one checksum per tensor for each copy of the weights (one
in-process; one per SGLang server, which cannot hand the tensors over cheaply): a copy agrees when
every name and checksum is the trainer's. Only where one differs are its tensors fetched, to name
the place. A mismatch raises WeightMismatch (exit 1) naming the first differing tensor, in the
trainer's order, and its first differing element, with both values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlbench.errors import WeightMismatch
from rlbench.rundir.digest import weights_digests


def _first_element(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The flat index of the first element whose bytes differ (-0.0 vs 0.0 and NaN payloads count)."""
    bytes_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).view(a.numel(), -1)
    bytes_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).view(b.numel(), -1)
    differ = (bytes_a != bytes_b).any(dim=1).nonzero()
    return int(differ[0]) if differ.numel() else None


def first_difference(
    expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], labels: tuple[str, str]
) -> str | None:
    """Where `got` first differs from `expected` (names, dtypes, shapes, then bytes); None when equal."""
    missing, extra = [n for n in expected if n not in got], [n for n in got if n not in expected]
    if missing or extra:
        return f"tensor names differ: only the {labels[0]}'s {missing[:3]}, only the {labels[1]}'s {extra[:3]}"
    differing = []
    for name, a in expected.items():
        b = got[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{name}: {labels[0]} {a.dtype} {tuple(a.shape)}, {labels[1]} {b.dtype} {tuple(b.shape)}"
        index = _first_element(a, b)
        if index is not None:
            differing.append((name, index))
    if not differing:
        return None
    name, index = differing[0]
    a, b = expected[name], got[name]
    place = list(torch.unravel_index(torch.tensor(index), a.shape)) if a.dim() else []
    where = f"{name}[{', '.join(str(int(i)) for i in place)}]"
    more = f"; {len(differing)} tensors differ" if len(differing) > 1 else ""
    return (
        f"{where} (element {index} of {a.numel()}): {labels[0]} {a.reshape(-1)[index].item()!r}, "
        f"{labels[1]} {b.reshape(-1)[index].item()!r}{more}"
    )


def check(
    expected: Mapping[str, torch.Tensor],
    got: Mapping[str, torch.Tensor],
    when: str,
    labels: tuple[str, str] = ("trainer", "engine"),
) -> None:
    found = first_difference(expected, got, labels)
    if found is not None:
        raise WeightMismatch(f"{when}: {labels[1]} weights differ from the {labels[0]}'s at {found}")


def held_by(engine, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """What `engine` holds after a sync of `weights`: the embedded engine's own dtype or quantization
    (engine_numerics.Numerics.held), else the weights themselves."""
    numerics = getattr(engine, "numerics", None)
    if numerics is None or (numerics.dtype is None and numerics.quantization == "none"):
        return weights
    return numerics.held(weights)


def check_engine(
    engine, weights: Mapping[str, torch.Tensor], when: str, digests: tuple[str, dict[str, str]] | None = None
) -> str:
    """Every copy of the weights `engine` holds is `weights`, bit for bit; returns their digest (the
    `engine_weights` checksum: the digest of what the engine holds, proven equal to `weights`). `digests`:
    `weights_digests(weights)` where the caller has it already (the train stage's, of the same export)."""
    whole, want = digests or weights_digests(weights)  # one pass over the bytes for both
    for holder, got in engine.weight_checksums().items():
        if got == want:
            continue
        label = "engine" if holder == engine.engine_id else f"engine {holder}"
        differing = [name for name in want if got.get(name) != want[name]]
        extra = [name for name in got if name not in want]
        if extra or any(name not in got for name in differing):
            found = first_difference(want, got, ("trainer", "engine"))  # names only: the values are not needed
        else:
            held = engine.export_weights(holder, differing)
            found = first_difference({name: weights[name] for name in differing}, held, ("trainer", "engine"))
            found = found or f"{differing[0]}: its checksum differs, its values read back equal (dtype?)"
        raise WeightMismatch(f"{when}: {label} weights differ from the trainer's at {found}")
    return whole


def check_unchanged(engine, synced: tuple[str, dict[str, str]], when: str) -> str:
    """Between syncs (slime's --update-weights-interval): every copy the engine holds is still what the last sync
    gave it (`synced`: its digests, whole and per tensor); returns the whole digest, the step's `engine_weights`."""
    whole, want = synced
    for holder, got in engine.weight_checksums().items():
        if got != want:
            label = "engine" if holder == engine.engine_id else f"engine {holder}"
            name = next((n for n in sorted(set(want) | set(got)) if got.get(n) != want.get(n)), "?")
            raise WeightMismatch(f"{when}: {label} weights changed since the last sync, at {name}")
    return whole
