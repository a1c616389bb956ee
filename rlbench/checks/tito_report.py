"""What `check tito` reports of a run directory or a JSONL: each finding where it is, and the counts each lens
kept. Below both lenses (tito_run.py, tito_jsonl.py), which fill it."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlbench.checks.tito import Finding


@dataclass
class SampleFinding:
    step: int | None
    sample: int
    where: str
    finding: Finding


@dataclass
class RunReport:
    source: str
    lens: str  # "sampled" (engine ids recorded), "evidence" (none recorded), "rendered" (JSONL)
    samples: int = 0
    findings: list[SampleFinding] = field(default_factory=list)
    compared: int = 0  # samples whose trained ids were held to the engine's, turn by turn
    non_canonical: int = 0  # samples with sampled ids that are not the canonical encoding of their text
    example: dict | None = None  # one such sample: where, the ids, the canonical ids, the text
    padded_samples: int = 0  # samples that sampled padded ids (core/vocab.py: valid, no text)
    padded_ids: int = 0  # how many padded ids they sampled
    # evidence lens: sampled / retokenised / undetermined (no model) / no_logprobs (undetermined: none recorded)
    evidence: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    removed: int = 0  # samples slime removed (remove_sample): not trained, not judged
    kwargs: dict = field(default_factory=dict)  # the chat template kwargs (JSONL: before each row's own)
    sampled_rows: int = 0  # JSONL rows that gave their engine outputs (`sampled`), each held to its trained ids

    @property
    def rates(self) -> dict[str, float]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.finding.mode] = counts.get(f.finding.mode, 0) + 1
        return {mode: count / self.samples for mode, count in counts.items()}

    @property
    def strict(self) -> bool:
        return any(f.finding.strict for f in self.findings)

    @property
    def hazards(self) -> list[SampleFinding]:
        return [f for f in self.findings if not f.finding.strict]
