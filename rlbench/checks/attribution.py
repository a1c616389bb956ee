"""`check logprobs --attribute`: the train-inference mismatch split by cause, token by token.

For every judged token (check logprobs' tokens: trained, not removed, with engine log-probs) a chain of log-prob
states leads from the engine's log-prob as recorded to the trainer's as recorded, each state changing one factor of
the one before it (the chain's order matters: the factors interact, and each link measures its factor with the
ones before it already changed):

    decode     the engine's decode as recorded: KV cache, prefix reuse, in the batch it ran in
    engine     the engine's own forward over the whole sequence, alone (batch size 1), no cache
    forward    the trainer's forward code, with the engine's weights in the engine's dtype, alone
    dtype      the trainer's dtype: computed in it, with the weights the trainer held before the engine's cast or
               quantization (the trainer's weights of the version the engine held)
    weights    the trainer's weights of the step (the version it trained: policy lag, a sync's damage)
    micro_batch the trainer's forward as trained (its micro-batches)
    definition the trainer's log-prob definition (until here each state is read the engine's way: a top-p or top-k
               nucleus renormalised, its temperature)
    recorded   the trainer's log-prob as recorded (old_logprobs)

Link k is state k+1 - state k; the links add up to recorded - decode, token by token (in float64). The last,
`residual`, is what recomputing the trainer's own log-prob does not reproduce (0 where rlbench computed both).

A state that cannot be computed for a token (no engine to ask, no checkpoint of the weights, a server holding
another version) is not measured there, with its reason. A link is measured on the tokens where both its ends are;
where a state is missing between two measured ones, the links across it are reported together, as one span "not
split", never folded into a neighbour. A state whose inputs are those of the state before it (the same weights'
bytes, dtype, code, layout and definition) is that state's values, and says so (`same`). A token with a measured
state that is not a finite number is left out of every figure, counted and the first named in a note.

Figures, per link (and span): the tokens it compared, mean |delta|, and its share: its sum of |delta| over the sum,
over every link and span, of theirs (shares add up to 1 unless every link is 0: then every share is 0 and the output
says every link is 0 over how many tokens). Per step as well, and the `top` tokens of largest |delta| of the link
with the largest share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STATES = ("decode", "engine", "forward", "dtype", "weights", "micro_batch", "definition", "recorded")
LINKS = {  # link name: what it changes, from the state before to the state of the same index + 1
    "cache": "the engine's decode -> its forward over the whole sequence, alone, no cache (KV cache, prefix reuse, "
    "the engine's batch)",
    "kernels": "-> the trainer's forward code, the engine's weights and dtype, alone (kernels, attention backend)",
    "dtype": "-> the trainer's dtype, before the engine's cast or quantization (precision)",
    "weights": "-> the trainer's weights of the step (weight version, sync)",
    "micro_batch": "-> the trainer's micro-batches as trained (the trainer's batch)",
    "definition": "-> the trainer's log-prob definition (nucleus, temperature)",
    "residual": "-> the trainer's log-prob as recorded (what recomputing it does not reproduce)",
}
LINK_NAMES = tuple(LINKS)


@dataclass
class StepStates:
    """One step's judged tokens and their states. `values[state]` [n] float64 where computed; `measured[state]` [n]
    bool (absent: nowhere); `reasons[state]`: why it is not measured (where it is not); `same[state]`: the state
    before it whose values these are, with why; `notes`: what else the output says of how a state was had.
    `where` [n, 3]: each token's (sample, response token, token id)."""

    step: int
    where: torch.Tensor
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    measured: dict[str, torch.Tensor] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    same: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # how a state was measured, where the output should say

    def put(self, state: str, values: torch.Tensor, measured: torch.Tensor | None = None) -> None:
        self.values[state] = values.double()
        self.measured[state] = torch.ones(len(values), dtype=torch.bool) if measured is None else measured

    def tokens(self) -> int:
        return int(self.where.shape[0])


@dataclass
class Link:
    """One link, or a span of several not split (`names`): over the tokens it compared."""

    names: tuple[str, ...]
    tokens: int
    sum_abs: float
    share: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why a span is not split, or a link not measured
    notes: list[str] = field(default_factory=list)  # how it was measured (`same`)
    mean_abs: float = field(init=False)

    def __post_init__(self) -> None:
        self.mean_abs = self.sum_abs / self.tokens if self.tokens else 0.0

    @property
    def name(self) -> str:
        return "+".join(self.names)


@dataclass
class Worst:
    step: int
    sample: int
    response_token: int
    token_id: int
    before: float
    after: float
    delta: float


@dataclass
class Attribution:
    tokens: int  # judged tokens
    notes: list[str]  # the steps' notes, each once
    total: Link  # recorded - decode, where both are measured
    links: list[Link]  # the chain's links and spans, in chain order
    not_measured: list[Link]  # links measured on no token, with their reasons
    per_step: list[dict]
    largest: str | None  # the link (or span) with the largest share; None when every link is 0
    worst: list[Worst]

    @property
    def all_zero(self) -> bool:
        return self.largest is None


def _segments(measured: list[bool]) -> list[tuple[int, int]]:
    """(from state, to state) of each link or span between consecutive measured states."""
    kept = [i for i, on in enumerate(measured) if on]
    return list(zip(kept, kept[1:]))


def _nonfinite(step: StepStates) -> torch.Tensor:
    """[n] bool: the tokens with a measured state that is not a finite number (left out of every figure)."""
    bad = torch.zeros(step.tokens(), dtype=torch.bool)
    for state, values in step.values.items():
        bad |= step.measured[state] & ~values.isfinite()
    return bad


def _links(step: StepStates) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """This step's (from, to) segments -> (token indices, to - from there), token by token, over its tokens whose
    every measured state is finite."""
    n = step.tokens()
    present = torch.stack(
        [step.measured.get(s, torch.zeros(n, dtype=torch.bool)) for s in STATES], dim=1
    )  # [n, states]
    present[_nonfinite(step)] = False
    out: dict[tuple[int, int], list] = {}
    for pattern in torch.unique(present, dim=0):
        rows = (present == pattern).all(dim=1).nonzero().squeeze(1)
        for a, b in _segments(pattern.tolist()):
            delta = step.values[STATES[b]][rows] - step.values[STATES[a]][rows]
            got = out.setdefault((a, b), [[], []])
            got[0].append(rows)
            got[1].append(delta)
    return {k: (torch.cat(r), torch.cat(d)) for k, (r, d) in out.items()}


def _name(segment: tuple[int, int]) -> tuple[str, ...]:
    return LINK_NAMES[segment[0] : segment[1]]


def attribute(steps: list[StepStates], top: int = 10) -> Attribution:
    """The chain's figures over `steps` (see the module docstring)."""
    sums: dict[tuple[int, int], list] = {}  # segment -> [tokens, sum |delta|]
    per_step, candidates = [], []
    total_tokens, total_sum = 0, 0.0
    nonfinite, first_bad = 0, None
    for step in steps:
        segments = _links(step)
        row = {"step": step.step, "tokens": step.tokens(), "links": {}}
        for seg, (rows, delta) in sorted(segments.items()):
            got = sums.setdefault(seg, [0, 0.0])
            got[0] += len(delta)
            got[1] += float(delta.abs().sum())
            row["links"]["+".join(_name(seg))] = {"tokens": len(delta), "mean_abs": float(delta.abs().mean())}
            candidates.append((step, seg, rows, delta))
        bad = _nonfinite(step)
        if bad.any():
            row["nonfinite"] = int(bad.sum())
            if first_bad is None:
                sample, position, token_id = (int(x) for x in step.where[int(bad.nonzero()[0])])
                state = next(s for s in STATES if s in step.values and not bool(step.values[s][bad].isfinite().all()))
                first_bad = f"step {step.step}, sample {sample}, response token {position} (id {token_id}) in {state}"
            nonfinite += int(bad.sum())
        ends = step.measured.get("decode"), step.measured.get("recorded")
        if ends[0] is not None and ends[1] is not None:
            both = ends[0] & ends[1] & ~bad
            whole = (step.values["recorded"] - step.values["decode"])[both].abs()
            total_tokens += int(both.sum())
            total_sum += float(whole.sum())
            row["total"] = {"tokens": int(both.sum()), "mean_abs": float(whole.mean()) if both.any() else 0.0}
        per_step.append(row)
    grand = sum(s for _, s in sums.values())
    links = []
    for seg, (tokens, summed) in sorted(sums.items()):
        link = Link(_name(seg), tokens, summed, summed / grand if grand > 0 else 0.0)
        if len(link.names) > 1:
            link.reasons = _reasons(steps, seg)
        link.notes = _notes(steps, seg)
        links.append(link)
    covered = {name for link in links for name in link.names}  # measured alone or in a span
    not_measured = [
        Link((name,), 0, 0.0, reasons=_reasons(steps, (i, i + 1)))
        for i, name in enumerate(LINK_NAMES)
        if name not in covered
    ]
    largest = max(links, key=lambda link: link.sum_abs) if grand > 0 else None
    notes = list(dict.fromkeys(note for step in steps for note in step.notes))
    if nonfinite:
        notes.append(
            f"{nonfinite} tokens with a state that is not a finite number, left out of every link; the first "
            f"at {first_bad}"
        )
    return Attribution(
        sum(s.tokens() for s in steps),
        notes,
        Link(("total",), total_tokens, total_sum),
        links,
        not_measured,
        per_step,
        largest.name if largest is not None else None,
        _worst(candidates, largest, top) if largest is not None else [],
    )


def _reasons(steps: list[StepStates], seg: tuple[int, int]) -> list[str]:
    """Why the states inside `seg` (or its ends) are not measured, each reason once, in chain order."""
    found: list[str] = []
    for state in STATES[seg[0] : seg[1] + 1]:
        for step in steps:
            reason = step.reasons.get(state)
            if reason and f"{state}: {reason}" not in found:
                found.append(f"{state}: {reason}")
    return found


def _notes(steps: list[StepStates], seg: tuple[int, int]) -> list[str]:
    """How the state `seg` ends at was had where it is its predecessor's values, with the steps where it was (all of
    them: no steps named)."""
    found: dict[str, list[int]] = {}
    for step in steps:
        note = step.same.get(STATES[seg[1]])
        if note:
            found.setdefault(note, []).append(step.step)
    every = [s.step for s in steps]
    return [note if at == every else f"{note} (steps {at})" for note, at in found.items()]


def _worst(candidates: list, largest: Link, top: int) -> list[Worst]:
    """The `top` tokens of largest |delta| in the largest link (ties: the earlier step and token first)."""
    picked = []
    for step, seg, rows, delta in candidates:
        if _name(seg) != largest.names:
            continue
        order = torch.argsort(delta.abs(), descending=True, stable=True)[:top]
        for k in order.tolist():
            row = int(rows[k])
            sample, position, token_id = (int(x) for x in step.where[row])
            before = float(step.values[STATES[seg[0]]][row])
            picked.append(
                (
                    float(delta[k].abs()),
                    Worst(
                        step.step,
                        sample,
                        position,
                        token_id,
                        before,
                        float(step.values[STATES[seg[1]]][row]),
                        float(delta[k]),
                    ),
                )
            )
    ranks = torch.argsort(torch.tensor([p[0] for p in picked], dtype=torch.float64), descending=True, stable=True)
    return [picked[k][1] for k in ranks[:top].tolist()]
