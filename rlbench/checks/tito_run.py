"""`check tito RUN|JSONL`: did any sample train on ids the engine never sampled? One question per lens.

- Trained vs sampled (every rlbench run): the recording holds the engine's own ids, each turn's
  prompt and output (single-turn samples too). Each turn's prompt + output must be an exact prefix
  of the next turn's prompt, and the last one's of the ids the trainer trained on. This is the
  TITO rule itself; a default run passes it by construction.
- Canonical re-tokenisation (every run, reported, never a finding): how many samples the engine
  sampled as ids that are not the canonical encoding of their own text. A random policy does so all
  the time, and training on them is right; a pipeline that decoded and re-tokenised them would
  train on other ids (mode 1). The number says how exposed a run would be to such a pipeline.
- Padded ids (every run, a note, never a finding): ids the model has a logit for and the tokenizer no
  text (core/vocab.py). The engine samples them, rightly; no text re-tokenises to one, so a pipeline
  that decoded and re-tokenised would lose them. An id the model has no logit for is bad input.
- Evidence (a recording without engine ids: imported dumps): the importer already holds each sample
  to slime's invariant, response length = number of engine log-probs = loss-mask length. The lens
  applies to what the engine sampled: each run of loss-mask-1 tokens of the response is one sampled
  output; spans of loss mask 0 (tool observations, which slime writes with log-prob 0.0) are not
  judged. Where a sampled span's ids are not canonical, either the engine sampled them (fine) or a
  pipeline built them piecewise (drift). With `--model`, the engine's log-prob at the first
  non-canonical id is held to the trainer's for that id (renormalised over the recorded top-p
  nucleus where there is one, as the engine reported it): the same (within EVIDENCE_NATS) means
  sampled, far apart means the engine scored another id there, so the trained ids were not the
  sampled ones (mode 1). Without a model, or for a sample whose engine reported no log-probs, such a
  sample is undetermined, and the report says so instead of claiming no drift.
- Samples slime removed (`remove_sample`: not trained) are not judged, and counted.
- Re-render (a JSONL of {messages, token_ids}): tito_jsonl.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlbench.checks.compare import first_divergence
from rlbench.checks.tito import Finding, canonical, decode, finding
from rlbench.checks.tito_report import RunReport, SampleFinding
from rlbench.core.vocab import Vocab, run_vocab
from rlbench.errors import BadInput

# Log-probs of one id from two forwards of the same weights agree to ~1e-6 (fp32) or ~1e-1 (bf16 engine
# against an fp32 trainer, research.md section 3); another id's log-prob is typically nats away.
EVIDENCE_NATS = 0.5


def _check_turns(tok, turns: list[dict], trained: list[int], label: str) -> Finding | None:
    """The TITO rule: each turn's prompt + sampled ids is a prefix of the next turn's prompt, and the
    last one's of the ids the trainer trains on."""
    eos = tok.eos_token_id
    for k in range(len(turns)):
        got = list(turns[k]["prompt_ids"]) + list(turns[k]["output_ids"])
        if turns[k].get("sampled") is False:  # a slime plugin's span the engine's request log does not hold
            prompt = list(turns[k]["prompt_ids"])
            why = turns[k].get("why", "not sampled by the engine")
            return finding(tok, label, f"turn {k}: {why}", got, prompt, len(prompt), [], [], ("unsampled", True))
        last = k + 1 == len(turns)
        nxt, where = (
            (list(trained), "the trained ids") if last else (list(turns[k + 1]["prompt_ids"]), f"turn {k + 1}'s prompt")
        )
        index = first_divergence(got, nxt[: len(got)] if len(nxt) >= len(got) else nxt)
        if index is not None:
            truncated = [len(got)] if not turns[k]["output_ids"] or turns[k]["output_ids"][-1] != eos else []
            ends = [] if last else truncated
            # the next turn's prompt goes on past this turn; the trained ids end with the last one
            return finding(tok, label, f"turn {k} vs {where}", got, nxt, index, [len(got)], ends, extends=not last)
    return None


def _non_canonical(tok, turns: list[dict]) -> tuple[int, list[int], list[int]] | None:
    """(turn, ids, canonical ids) of the first turn whose sampled ids are not canonical, or None."""
    for k, turn in enumerate(turns):
        ids = list(turn["output_ids"])
        again = canonical(tok, ids)
        if again != ids:
            return k, ids, again
    return None


class _Evidence:
    """The engine's log-prob against the trainer's at a position, with the weights given."""

    def __init__(self, model_dir: str | Path | None, seed: int, temperature: float, init: str | None):
        self.model, self.temperature = None, temperature
        if model_dir is not None:
            from rlbench.core.model import build_model, weight_files

            if init is None:  # a recording from before model.init (or an import without it): what the run did
                init = "checkpoint" if weight_files(model_dir) else "random"
            self.model = build_model(model_dir, seed, init=init).eval().requires_grad_(False)

    def delta(self, ids: list[int], position: int, engine: float, nucleus: list[int] | None = None) -> float:
        """|trainer - engine| log-prob of ids[position]; over `nucleus` (and the id) where one was recorded."""
        import torch

        from rlbench.checks.logprobs import sequence_nucleus_logprobs
        from rlbench.core.algo import sequence_logprobs

        if nucleus is not None:
            trainer = sequence_nucleus_logprobs(
                self.model, torch.tensor(ids[: position + 1]), position, [nucleus], self.temperature
            )[0]
            return abs(float(trainer) - engine)
        with torch.no_grad():
            trainer = sequence_logprobs(self.model, torch.tensor(ids), self.temperature, "cpu")
        return abs(float(trainer[position]) - engine)


def sampled_spans(ids: list[int], prompt: int, mask: list[int]) -> list[dict]:
    """The engine's outputs of a sample recorded without engine ids: each run of loss-mask-1 tokens
    of the response, as a turn (the ids before it, its ids)."""
    turns, start = [], None
    for j in range(prompt, len(ids) + 1):
        inside = j < len(ids) and mask[j] == 1
        if inside and start is None:
            start = j
        elif not inside and start is not None:
            turns.append({"prompt_ids": ids[:start], "output_ids": ids[start:j]})
            start = None
    return turns


def check_run(
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    model_dir: str | Path | None = None,
    kwargs: dict | None = None,
) -> RunReport:
    """Every sample of a run directory (or a JSONL of {messages, token_ids}) held to the TITO rule. `kwargs`: the
    chat template kwargs (a run directory records its own, data.chat_template_kwargs, used where none are given)."""
    from rlbench.core.model import load_tokenizer

    path = Path(path)
    if path.is_file():
        if tokenizer_dir is None:
            raise BadInput("a JSONL of trajectories needs --tokenizer", path=path)
        from rlbench.checks.tito_jsonl import check_jsonl

        return check_jsonl(path, load_tokenizer(tokenizer_dir), tokenizer_dir, dict(kwargs or {}))
    from rlbench.core.context import check_made_with
    from rlbench.rundir import recording
    from rlbench.replay.integrity import open_run

    run = open_run(path, recordings="verify", checkpoints="present", need_steps=True, need_recordings=True).run
    config = run.manifest.get("config") or {}
    tokenizer_dir = tokenizer_dir or (config.get("model") or {}).get("tokenizer")
    check_made_with(run, tokenizer=tokenizer_dir, model=model_dir)
    tok = load_tokenizer(tokenizer_dir)
    vocab = run_vocab(run.manifest, run.root / "manifest.json", tok)
    evidence = None
    report = RunReport(str(run.root), "sampled")
    # recorded, not used: this lens compares the engine's own ids and renders nothing
    report.kwargs = dict(kwargs if kwargs is not None else (config.get("data") or {}).get("chat_template_kwargs") or {})
    for step in run.steps:
        tensors, meta = recording.read_step(run.root, step)
        vocab.check(tensors, run.root / "rollouts" / f"{step:06d}.safetensors")
        offsets, tokens = tensors["offsets"].tolist(), tensors["tokens"].tolist()  # once a step, not a sample
        mask = tensors["loss_mask"].tolist()
        for i, sample in enumerate(meta["samples"]):
            if sample.get("remove_sample"):
                report.removed += 1
                continue
            report.samples += 1
            ids = tokens[offsets[i] : offsets[i + 1]]
            label = f"step {step} sample {i}"
            turns = sample.get("turns")
            if not turns:  # no engine ids recorded: judge by the evidence the recording has
                report.lens = "evidence"
                turns = sampled_spans(ids, int(tensors["prompt_lengths"][i]), mask[offsets[i] : offsets[i + 1]])
                if evidence is None:
                    evidence = _Evidence(
                        model_dir,
                        int(config.get("seed", 0)),
                        float((config.get("rollout") or {}).get("temperature", 1.0)),
                        (config.get("model") or {}).get("init"),
                    )
                engine = _EngineSide(tensors, offsets[i], sample)
                _judge(tok, report, evidence, step, i, ids, int(tensors["prompt_lengths"][i]), turns, engine)
            else:
                report.compared += 1
                found = _check_turns(tok, turns, ids, label)
                if found is not None:
                    report.findings.append(SampleFinding(step, i, found.where, found))
            _count_padded(report, vocab, turns)
            odd = _non_canonical(tok, turns)
            if odd is not None:
                report.non_canonical += 1
                if report.example is None:
                    k, got, again = odd
                    report.example = {
                        "step": step,
                        "sample": i,
                        "turn": k,
                        "sampled": got,
                        "canonical": again,
                        "text": decode(tok, got),
                    }
    if report.lens == "evidence" and report.compared:
        report.notes.append(
            f"{report.compared} samples held engine ids and were compared exactly; the others were judged by evidence"
        )
    if report.padded_ids:
        report.notes.append(
            f"{report.padded_samples} samples sampled {report.padded_ids} padded ids (>= the "
            f"tokenizer's {vocab.tokenizer} ids, < the model's {vocab.model}): valid and trained as "
            "sampled, but no text decodes to them: a pipeline that decodes and re-tokenises loses them"
        )
    if report.removed:
        report.notes.append(f"{report.removed} samples removed by slime (remove_sample): not trained, not judged")
    if not report.samples:  # no verdict speaks for nothing
        raise BadInput(
            f"undetermined: no sample to judge in {len(run.steps)} committed steps ({report.removed} removed by "
            "slime, remove_sample)",
            path=run.root / "rollouts",
        )
    if report.evidence.get("no_logprobs"):
        report.notes.append(
            f"{report.evidence['no_logprobs']} non-canonical samples without engine log-probs: "
            "undetermined (no log-prob to hold to the trainer's)"
        )
    return report


def _count_padded(report: RunReport, vocab: Vocab, turns: list[dict]) -> None:
    """The padded ids (core/vocab.py) the engine sampled in one sample's turns, counted in `report`."""
    count = sum(vocab.count_padded(turn["output_ids"]) for turn in turns)
    report.padded_ids += count
    report.padded_samples += bool(count)


@dataclass
class _EngineSide:
    """What the engine recorded of one sample: its log-probs (when it reported any) and its top-p nucleus."""

    tensors: dict
    start: int  # the sample's first flat position
    sample: dict

    def logprob(self, position: int) -> float | None:
        if self.sample.get("has_rollout_logprobs") is False:
            return None
        return float(self.tensors["rollout_logprobs"][self.start + position])

    def nucleus(self, position: int) -> list[int] | None:
        if not self.sample.get("top_p"):
            return None
        from rlbench.checks.logprobs import sample_nuclei

        return sample_nuclei(self.tensors, self.start + position, self.start + position + 1)[0]


def _judge(
    tok,
    report: RunReport,
    evidence: _Evidence,
    step: int,
    i: int,
    ids: list[int],
    prompt: int,
    turns: list[dict],
    engine_side: _EngineSide,
) -> None:
    """The evidence lens for one sample without engine ids: its first sampled span that is not the
    canonical encoding of its text, held to the engine's log-prob there."""
    for turn in turns:
        output = list(turn["output_ids"])
        again = canonical(tok, output)
        p = first_divergence(output, again)
        if p is not None and p < len(output):
            start = len(turn["prompt_ids"])
            break
    else:
        return
    counts = report.evidence
    engine = engine_side.logprob(start + p)
    if evidence.model is None or engine is None:
        key = "undetermined" if evidence.model is None else "no_logprobs"
        counts[key] = counts.get(key, 0) + 1
        return
    delta = evidence.delta(ids, start + p, engine, engine_side.nucleus(start + p))
    if delta <= EVIDENCE_NATS:
        counts["sampled"] = counts.get("sampled", 0) + 1
        return
    counts["retokenised"] = counts.get("retokenised", 0) + 1
    found = finding(
        tok,
        f"step {step} sample {i}",
        "response vs its canonical encoding",
        ids,
        ids[:start] + again,
        start + p,
        [],
        [],
        mode=("reencode", True),
    )
    found.where = (
        f"response token {start + p - prompt}: the engine's log-prob {engine:.4g} is not the trainer's for "
        f"this id (|delta| {delta:.3g} > {EVIDENCE_NATS}): it scored another id here"
    )
    report.findings.append(SampleFinding(step, i, found.where, found))
