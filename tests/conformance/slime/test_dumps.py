"""`rlbench import slime` on dumps written by slime's own code (dumps/, made by build_dumps.py from the slime
commit cases.json names): each imports with the verdict slime's semantics give, and each verdict is shown
both ways on an edited copy of the same dump.

- removed: not trained (loss mask 0), kept in its group, counted, not judged (its log-probs are another
  policy's: judged, they are a mismatch);
- top-p: log-probs recomputed over the recorded nucleus match slime's engine at float rounding (over the
  full vocabulary they would not);
- None log-probs: named and not judged (filled with 0.0, as before, they look like a huge mismatch);
- a tool observation (loss mask 0) inside the response: not judged as sampled ids (judged, it looks
  re-tokenised);
- unequal groups: accepted, each sample's group from its group_index;
- multimodal samples and evaluation dumps: refused in one line naming what, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlbench.checks.logprobs import check_logprobs
from rlbench.checks.tito_run import check_run
from rlbench.replay.slime_sample import FIELDS
from rlbench.rundir.recording import read_step
from tests.conftest import REPO, run_cli

DUMPS = Path(__file__).resolve().parent / "dumps"
CASES = json.loads((DUMPS / "cases.json").read_text())
FIXTURE_MODEL = REPO / CASES["model"]["path"]
_SEEDED: dict[str, Path] = {}


@pytest.fixture(autouse=True, scope="module")
def _seeded_model(tmp_path_factory):
    """The model the dumps' log-probs were computed with (cases.json: the fixture model, random weights of its seed),
    written with its weights, so the import and the checks load those weights whatever rlbench's default seed is."""
    from safetensors.torch import save_file

    from rlbench.core.model import build_model, named_weights

    directory = tmp_path_factory.mktemp("seeded-model")
    (directory / "config.json").write_text((FIXTURE_MODEL / "config.json").read_text())
    model = build_model(str(FIXTURE_MODEL), CASES["model"]["seed"], init=CASES["model"]["init"])
    save_file({k: v.contiguous() for k, v in named_weights(model).items()}, str(directory / "model.safetensors"))
    _SEEDED["model"] = directory
    yield


def _model() -> Path:
    return _SEEDED["model"]


FLOAT_ROUNDING = 1e-5


def _dump(case: str) -> Path:
    return DUMPS / CASES["cases"][case]["file"]


def _edited(tmp_path, case: str, edit) -> Path:
    """A copy of the case's dump with edit(samples) applied."""
    dump = torch.load(_dump(case), weights_only=True)
    edit(dump["samples"])
    path = tmp_path / "edited" / case / "rollout_0.pt"
    path.parent.mkdir(parents=True)
    torch.save(dump, path)
    return path


def _import(tmp_path, dump: Path, name: str = "imported") -> tuple[Path, dict]:
    out = tmp_path / name
    res = run_cli("import", "slime", str(dump), "--out", str(out), "--model", str(_model()), "--json")
    assert res.returncode == 0, res.stderr
    return out, json.loads(res.stdout)


def _response(tensors, i: int, key: str) -> list:
    a, b = int(tensors["offsets"][i]), int(tensors["offsets"][i + 1])
    return tensors[key][a + int(tensors["prompt_lengths"][i]) : b].tolist()


def test_the_dumps_are_slimes_and_every_sample_field_is_used_kept_or_refused():
    assert CASES["schema"] == "rlbench.conformance.slime-dumps/1" and len(CASES["slime"]["commit"]) == 40
    assert sorted(CASES["sample_fields"]) == sorted(FIELDS)
    for case in CASES["cases"]:
        samples = torch.load(_dump(case), weights_only=True)["samples"]
        assert len(samples) == CASES["cases"][case]["samples"]
        assert all(sorted(s) == sorted(CASES["sample_fields"]) for s in samples)  # Sample.to_dict(): every field


def test_a_removed_sample_is_not_trained_not_judged_and_counted(tmp_path):
    run, summary = _import(tmp_path, _dump("removed"))
    [removed] = CASES["cases"]["removed"]["removed"]
    assert summary["removed"] == 1
    tensors, meta = read_step(run, 0)
    assert set(_response(tensors, removed, "loss_mask")) == {0} and meta["samples"][removed]["remove_sample"]
    assert tensors["rewards"].tolist() == CASES["cases"]["removed"]["rewards"]  # its reward stays in its group
    assert [s["group"] for s in meta["samples"]] == [0, 0, 1, 1]
    report = check_logprobs(run, recompute=True)
    assert (report.removed, report.samples) == (1, 3)
    assert report.stats["train_rollout_logprob_abs_diff"] <= FLOAT_ROUNDING
    tito = check_run(run, model_dir=_model())
    assert (tito.removed, tito.samples, tito.findings) == (1, 3, [])
    # not removed, the same sample is trained and judged: its log-probs are another policy's
    kept = _edited(tmp_path, "removed", lambda samples: samples[removed].update(remove_sample=False))
    run, summary = _import(tmp_path, kept, "kept")
    assert summary["removed"] == 0 and set(_response(read_step(run, 0)[0], removed, "loss_mask")) == {1}
    assert check_logprobs(run, recompute=True).stats["max_abs"] > 0.1


def _no_nucleus(samples):
    for s in samples:
        s.update(rollout_top_p_token_ids=None, rollout_top_p_token_offsets=None)


def test_top_p_logprobs_recomputed_over_the_recorded_nucleus_match_slimes_engine(tmp_path):
    run, summary = _import(tmp_path, _dump("top_p"))
    assert summary["top_p"] == 4
    tensors, meta = read_step(run, 0)
    assert all(s["top_p"] for s in meta["samples"])
    assert tensors["top_p_ids"].numel() == sum(CASES["cases"]["top_p"]["nucleus_sizes"])
    report = check_logprobs(run, recompute=True)
    assert report.top_p == 4 and report.stats["train_rollout_logprob_abs_diff"] <= FLOAT_ROUNDING
    assert report.stats["max_abs"] <= FLOAT_ROUNDING
    tito = check_run(run, model_dir=_model())  # the sampled ids are not canonical; their log-probs agree
    assert tito.findings == [] and tito.evidence == {"sampled": tito.non_canonical} and tito.non_canonical > 0
    # over the full vocabulary, as before: the renormalisation itself (about -log top-p) looks like a mismatch,
    # and like ids the engine never scored
    run, _ = _import(tmp_path, _edited(tmp_path, "top_p", _no_nucleus), "full")
    assert check_logprobs(run, recompute=True).stats["train_rollout_logprob_abs_diff"] > 0.1
    assert check_run(run, model_dir=_model()).evidence == {"retokenised": tito.non_canonical}


def test_samples_without_engine_logprobs_are_named_never_zero(tmp_path):
    run, summary = _import(tmp_path, _dump("no_logprobs"))
    without = CASES["cases"]["no_logprobs"]["without_logprobs"]
    assert summary["without_logprobs"] == len(without)
    _, meta = read_step(run, 0)
    assert [i for i, s in enumerate(meta["samples"]) if not s["has_rollout_logprobs"]] == without
    res = run_cli("check", "logprobs", str(run), "--recompute", "--max-mean", str(FLOAT_ROUNDING), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert (report["without_logprobs"], report["samples"]) == (2, 2)
    assert "2 samples without engine log-probs: not judged" in report["notes"]
    tito = check_run(run, model_dir=_model())  # the non-canonical one is undetermined, not drift
    assert tito.findings == [] and tito.evidence == {"no_logprobs": len(CASES["cases"]["no_logprobs"]["non_canonical"])}
    # filled with 0.0, as before: a huge mismatch, and the non-canonical sample looks re-tokenised
    zeros = _edited(
        tmp_path,
        "no_logprobs",
        lambda samples: [
            s.update(rollout_log_probs=[0.0] * s["response_length"]) for s in samples if s["rollout_log_probs"] is None
        ],
    )
    run, _ = _import(tmp_path, zeros, "zeros")
    assert check_logprobs(run, recompute=True).stats["train_rollout_logprob_abs_diff"] > 1.0
    assert [f.finding.mode for f in check_run(run, model_dir=_model()).findings] == ["reencode"]


def test_a_tool_observation_inside_the_response_is_not_judged_as_sampled_ids(tmp_path):
    run, _ = _import(tmp_path, _dump("tool_span"))
    start, end = CASES["cases"]["tool_span"]["tool_span"]
    tensors, meta = read_step(run, 0)
    for i in range(2):
        mask, logprobs = _response(tensors, i, "loss_mask"), _response(tensors, i, "rollout_logprobs")
        assert set(mask[start:end]) == {0} and set(logprobs[start:end]) == {0.0} and set(mask[:start]) == {1}
    assert meta["samples"][0]["messages"][2]["content"] is None  # a tool call, as slime's prompt holds it
    assert meta["samples"][0]["messages"][0]["content"][0]["type"] == "text"  # a content-part list
    tito = check_run(run, model_dir=_model())
    assert (tito.findings, tito.non_canonical) == ([], 0)
    assert check_logprobs(run, recompute=True).stats["max_abs"] <= FLOAT_ROUNDING
    # the observation judged as if sampled: its log-prob 0.0 is no engine's, and its ids look re-tokenised
    trained = _edited(
        tmp_path, "tool_span", lambda samples: [s.update(loss_mask=[1] * s["response_length"]) for s in samples]
    )
    run, _ = _import(tmp_path, trained, "trained")
    findings = check_run(run, model_dir=_model()).findings
    prompt = int(read_step(run, 0)[0]["prompt_lengths"][0])
    assert len(findings) == 2 and all(start <= f.finding.index - prompt < end for f in findings)


def test_unequal_groups_are_accepted_with_each_samples_group(tmp_path):
    run, summary = _import(tmp_path, _dump("unequal_groups"))
    sizes = CASES["cases"]["unequal_groups"]["group_sizes"]
    assert summary["group_sizes"] == [sizes] and summary["group_size"] is None
    tensors, meta = read_step(run, 0)
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    assert [s["group"] for s in meta["samples"]] == groups == tensors["group_index"].tolist()
    # kept in the metadata, and named as what replay does not train with
    assert all(
        s["slime"]["teacher_log_probs"] and s["slime"]["train_metadata"] == {"loss": "policy"} for s in meta["samples"]
    )
    assert any(n.startswith("teacher_log_probs kept in 5 samples") for n in summary["notes"])
    assert any(n.startswith("train_metadata kept in 5 samples") for n in summary["notes"])
    # the groups come from group_index, not from where a sample sits in the dump
    reversed_dump = _edited(tmp_path, "unequal_groups", lambda samples: samples.reverse())
    run, _ = _import(tmp_path, reversed_dump, "reversed")
    assert [s["group"] for s in read_step(run, 0)[1]["samples"]] == groups


def test_a_multimodal_sample_is_refused_in_one_line_naming_the_field(tmp_path):
    res = run_cli("import", "slime", str(_dump("multimodal")), "--out", str(tmp_path / "mm"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert (
        f"samples[1].{CASES['cases']['multimodal']['refused_field']}: set, and multimodal samples are not supported"
        in res.stderr
        and not (tmp_path / "mm").exists()
    )
    text_only = _edited(
        tmp_path, "multimodal", lambda samples: samples[1].update(multimodal_inputs=None, multimodal_train_inputs=None)
    )
    _import(tmp_path, text_only)


def test_an_eval_dump_is_refused_for_training_in_one_line(tmp_path):
    res = run_cli("import", "slime", str(_dump("eval")), "--out", str(tmp_path / "ev"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "an evaluation dump" in res.stderr and "eval_0" in res.stderr and not (tmp_path / "ev").exists()
    renamed = tmp_path / "rollout_0.pt"  # the same samples under a training dump's name
    renamed.write_bytes(_dump("eval").read_bytes())
    _import(tmp_path, renamed)


@pytest.mark.parametrize(
    "name, is_eval",
    [
        ("rollout_eval_3.pt", True),
        ("eval_3.pt", True),
        ("eval_3/data.pt", True),
        ("rollout_3.pt", False),
        ("eval_31.pt", False),
        ("medieval_3.pt", False),
    ],
)
def test_eval_dumps_are_told_by_slimes_name_for_them(name, is_eval):
    from rlbench.replay.slime import is_eval_dump

    assert is_eval_dump(Path("/runs/dumps") / name, 3) is is_eval
