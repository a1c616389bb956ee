"""slime's train-side dumps (rlbench/replay/slime_train.py) and `--dump-details` directories imported whole: the
fixtures in examples/slime-dump-details were written by slime's own writers (tests/slime_dumps/make_dumps.py, slime
624b824a8: three rollouts, two DP ranks). Each case plants one change in a copy and asserts where it is found."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, cli

V2 = REPO / "examples" / "slime-dump-details"


def _import(directory: Path, out: Path):
    return cli("import", "slime", str(directory), "--out", str(out))


def _copy(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(V2, target)
    return target


def _edit(path: Path, change) -> None:
    dump = torch.load(path, weights_only=True)
    change(dump)
    torch.save(dump, path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    done = _import(V2, out)
    assert done.returncode == 0, done.stderr
    return out


def test_a_dump_directory_imports_whole_and_two_imports_compare_equal(reference, tmp_path):
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["imported"]["rollout_ids"] == [0, 1, 2] and manifest["imported"]["train_format"] == 2
    assert manifest["stages"] == ["data", "rollout", "reward", "advantage", "logprob"]
    again = tmp_path / "again"
    done = _import(V2, again)
    assert "1 evaluation dumps (rollout_data/eval_<id>.pt) skipped" in done.stdout
    same = cli("diff", str(reference), str(again))
    assert same.returncode == 0
    assert "3 steps x 6 stages, 18 checksums compared" in same.stdout
    assert "advantages, old_logprobs" in same.stdout
    from rlbench.rundir import recording

    def leaves(value) -> int:
        if isinstance(value, dict):
            return sum(leaves(v) for v in value.values())
        return sum(leaves(v) for v in value) if isinstance(value, list) else 1

    kept = sum(
        leaves(s["slime_train"]) for step in range(3) for s in recording.read_step(reference, step)[1]["samples"]
    )
    assert f"the training schedules (DP shards, micro-batches) of 3 steps and {kept} values of the train dumps' " in (
        same.stdout
    )
    from rlbench.rundir import recording

    tensors, meta = recording.read_step(reference, 1)
    train = torch.load(V2 / "train_data" / "1.pt", weights_only=True)
    first = next(s for s in train["samples"] if s["rollout_position"] == 0)
    prompt = int(tensors["prompt_lengths"][0])
    mask = first["loss_masks"].tolist()
    expected = [v * m for v, m in zip(first["log_probs"].tolist(), mask)]
    assert tensors["old_logprobs"][prompt : prompt + len(mask)].tolist() == pytest.approx(expected)
    assert float(tensors["advantages"][0]) == pytest.approx(float(first["advantages"][0]))
    assert meta["samples"][0]["data_parallel_rank"] == 0 and "kl" in meta["samples"][0]["slime_train"]


def _log_prob(dump):
    dump["samples"][5]["log_probs"][0] += 0.5


def _advantage(dump):
    dump["samples"][3]["advantages"] += 1.0


def _rollout_log_prob(dump):  # both files say so: the engine's log-prob itself differs
    dump["samples"][2]["rollout_log_probs"][1] = -9.0


def _token(dump):  # a sampled id, in both files: the rollout itself differs
    sample = dump["samples"][4]
    tokens = sample["tokens"]
    tokens[-1] = 5 if tokens[-1] != 5 else 6


def _reward(dump):
    dump["samples"][6]["reward"] = 1.0 - dump["samples"][6]["reward"]


@pytest.mark.parametrize(
    ("files", "change", "stage", "sample"),
    [
        (["train_data/1.pt"], _log_prob, "old_logprobs", 5),
        (["train_data/1.pt"], _advantage, "advantages", 3),
        (["rollout_data/1.pt", "train_data/1.pt"], _rollout_log_prob, "rollout_logprobs", 2),
        (["rollout_data/1.pt"], _reward, "rewards", 6),
        (["rollout_data/1.pt", "train_data/1.pt"], _token, "rollout_tokens", 4),
    ],
)
def test_a_planted_change_is_found_at_its_rollout_stage_and_sample(reference, tmp_path, files, change, stage, sample):
    planted = _copy(tmp_path, "planted")
    for name in files:
        _edit(planted / name, change)
    out = tmp_path / "out"
    assert _import(planted, out).returncode == 0
    done = cli("diff", str(reference), str(out), "--json")
    assert done.returncode == 1, done.stdout
    first = json.loads(done.stdout)["first"]
    assert (first["step"], first["stage"]) == (1, stage), first
    assert f"sample {sample}" in first["where"], first


def _shorten(dump):
    """Train sample 3's response one token shorter in every per-token field (a dump that stays well formed)."""
    from rlbench.replay.slime_train import PER_TOKEN

    sample = dump["samples"][3]
    for key in PER_TOKEN:
        if sample.get(key) is not None:
            sample[key] = sample[key][:-1]
    sample["response_lengths"] -= 1


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d["samples"][4].update(rollout_position=40), "rollout_position 40"),
        (lambda d: d["samples"][2].update(sample_index=99), "sample_index 99 != the rollout dump's index"),
        (lambda d: d["samples"][1]["tokens"].__setitem__(0, 7), "tokens differ from the rollout dump's at token 0"),
        (
            lambda d: d.update(
                samples=[s for s in d["samples"] if s["data_parallel_rank"] == 0], dp_shards=d["dp_shards"][:1]
            ),
            "are missing from the train dump",
        ),
        (lambda d: d["dp_shards"][1]["micro_batch_indices"].pop(), "micro-batches do not cover its rows"),
        pytest.param(
            lambda d: d["samples"][2]["rollout_log_probs"].__setitem__(1, -9.0),
            "train sample 2 (rollout_position 2, sample_index 18): rollout_log_probs differ from the rollout dump's at "
            "response token 1 (-9.0 vs ",
            id="engine log-probs other than the rollout dump's",
        ),
        pytest.param(
            lambda d: d["samples"][3].update(total_lengths=10),
            "train sample 3 (rollout_position 3, sample_index 19): total_lengths 10 != len(tokens) 9",
            id="a total length other than the ids'",
        ),
        pytest.param(
            _shorten,
            "train sample 3 (rollout_position 3, sample_index 19): response_lengths 2 != the rollout dump's "
            "response_length 3",
            id="a response length other than the rollout dump's",
        ),
        pytest.param(
            lambda d: d["samples"][1].update(rollout_position=0, sample_index=16),
            "train sample 1 (rollout_position 0, sample_index 16): trained twice (also train sample 0)",
            id="a rollout sample trained twice",
        ),
        pytest.param(
            lambda d: d["dp_shards"].pop(),
            "rollout 2: DP shard(s) [1] missing from dp_shards (present: [0])",
            id="a DP shard missing",
        ),
        pytest.param(
            lambda d: d["dp_shards"][0].update(partition=[0, 2, 4, 7]),
            "rollout 2: DP rank 0's partition does not list the samples it trained",
            id="a partition other than the shard's samples",
        ),
        pytest.param(
            lambda d: d["dp_shards"].append(
                {"rank": 2, "data_parallel_rank": 2, "partition": [], "micro_batch_indices": []}
            ),
            "rollout 2: DP rank 2 trained no sample in this dump",
            id="a DP shard without its samples",
        ),
        pytest.param(
            lambda d: d["raw_reward"].pop(),
            "rollout 2: raw_reward holds 7 values, expected one per rollout dump sample (8)",
            id="a whole-batch raw_reward of another length",
        ),
        pytest.param(
            lambda d: d.update(raw_reward=0.5),
            "rollout 2: raw_reward holds float, expected one per rollout dump sample (8)",
            id="a raw_reward not a list",
        ),
        pytest.param(
            lambda d: d.update(samples=[], dp_shards=[]),
            "rollout 2: rollout samples at positions 0, 1, 2, 3, 4, 5, 6, 7 (index 16, 17, 18, 19, 20, 21, 22, 23) "
            "are missing from the train dump",
            id="nothing trained: not a trailing block dropped",
        ),
    ],
)
def test_a_train_dump_that_does_not_join_is_a_finding_by_sample_and_nothing_is_written(tmp_path, change, says):
    broken = _copy(tmp_path, "broken")
    _edit(broken / "train_data" / "2.pt", change)
    out = tmp_path / "out"
    done = _import(broken, out)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rollout 2" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_whole_batch_raw_reward_held_as_a_tensor_joins_as_the_list_of_its_values(tmp_path):
    """A raw_reward saved as a tensor (one value per rollout dump sample) is read as the list of its values: the
    dump joins with no finding, as the fixture's list does."""
    dump = _copy(tmp_path, "tensor")
    _edit(
        dump / "train_data" / "2.pt", lambda d: d.update(raw_reward=torch.tensor(d["raw_reward"], dtype=torch.float64))
    )
    done = _import(dump, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr


def _tool_span_trained(dump):  # train sample 5's tool span (response tokens 2-4, loss mask 0) trained from token 2
    dump["samples"][5]["loss_masks"][2] = 1


def _removed(dump):  # the rollout dump says slime removed sample 3
    dump["samples"][3]["remove_sample"] = True


def _mask_zeroed(dump):  # train sample 3's loss mask all 0, as slime's writer zeroes a removed sample's
    dump["samples"][3]["loss_masks"].zero_()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        pytest.param(
            {"train_data/2.pt": _tool_span_trained},
            "rollout 2, train sample 5 (rollout_position 5, sample_index 21): loss_masks differ from the rollout "
            "dump's loss_mask at response token 2",
            id="a tool span trained",
        ),
        pytest.param(
            {"rollout_data/2.pt": _removed},
            "rollout 2, train sample 3 (rollout_position 3, sample_index 19): loss_masks differ from the rollout "
            "dump's loss_mask at response token 0",
            id="a removed sample trained",
        ),
        pytest.param({"rollout_data/2.pt": _removed, "train_data/2.pt": _mask_zeroed}, None, id="removed, zeroed"),
    ],
)
def test_a_loss_mask_the_rollout_dump_does_not_hold_is_a_finding_naming_its_token(tmp_path, changes, says):
    """The join holds each train sample's loss_masks to its rollout sample's loss_mask, all 0 where the rollout dump
    says slime removed the sample (remove_sample): a token of a tool span trained (the train dump changed) and a
    removed sample trained (the rollout dump changed) are each a finding naming the rollout, the sample and the
    first token that differs: exit 1, one line, nothing written. The removed sample with its mask zeroed, as
    slime's writer zeroes it, joins."""
    train = torch.load(V2 / "train_data" / "2.pt", weights_only=True)
    assert train["samples"][5]["loss_masks"].tolist() == [1, 1, 0, 0, 0, 1]  # the fixture's tool span in sample 5
    planted = _copy(tmp_path, "planted")
    for file, change in changes.items():
        _edit(planted / file, change)
    out = tmp_path / "out"
    done = _import(planted, out)
    if says is None:
        assert done.returncode == 0, done.stderr
        assert "1 samples removed by slime (remove_sample)" in done.stdout
        return
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(1 findings): " + says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(
            lambda d: d["samples"][3].update(log_probs=d["samples"][3]["log_probs"][:-1]),
            "samples[3].log_probs: expected 3 values (response_lengths), got 2 values: a field left sliced by "
            "context parallelism?",
            id="a per-token field not restored from context parallelism",
        ),
        pytest.param(
            lambda d: d.update(sampler_state={"x": 1}),
            "top-level keys slime's format 2 does not write: sampler_state",
            id="a top-level key slime does not write",
        ),
    ],
)
def test_a_train_dump_slime_would_not_write_is_refused_naming_its_file_and_field(tmp_path, change, says):
    """What slime's format-2 writer never produces is bad input (exit 2), one line naming the file and the field,
    and nothing is written: never joined as if it were a dump."""
    odd = _copy(tmp_path, "odd")
    _edit(odd / "train_data" / "2.pt", change)
    out = tmp_path / "out"
    done = _import(odd, out)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{odd / 'train_data' / '2.pt'}: {says}" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_format_1_file_that_is_not_what_slime_writes_is_refused_by_name(tmp_path):
    old = _copy(tmp_path, "v1")
    for path in (old / "train_data").glob("*.pt"):
        path.unlink()
    torch.save({"rollout_id": 0, "rank": 0, "rollout_data": {"tokens": []}}, old / "train_data" / "0_0.pt")
    done = _import(old, tmp_path / "out")
    assert done.returncode == 2
    assert "rollout_data: expected a dict of columns with response_lengths" in done.stderr and "0_0.pt" in done.stderr


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            lambda d: [shard.update(micro_batch_indices=[[0, 1, 2], [3]]) for shard in d["dp_shards"]],
            "micro_batch_indices differs",
        ),
        (lambda d: d["dp_shards"][0].update(global_batch_sizes=[4, 4], num_microbatches=[1, 1]), "num_microbatches"),
    ],
)
def test_another_micro_batch_split_is_named_as_the_cause_before_the_numbers(reference, tmp_path, change, says):
    planted = _copy(tmp_path, "split")
    _edit(planted / "train_data" / "1.pt", change)
    out = tmp_path / "out"
    assert _import(planted, out).returncode == 0
    done = cli("diff", str(reference), str(out), "--json")
    assert done.returncode == 1, done.stdout
    first = json.loads(done.stdout)["first"]
    assert (first["step"], first["stage"]) == (1, "schedule") and says in first["where"], first


def test_diff_check_and_report_take_a_dump_directory_itself(tmp_path, monkeypatch):
    """No import step: diff, check logprobs and report read a --dump-details directory as they read a run (its
    tokenizer the one slime saved beside the dumps), and name it, not a temporary copy."""
    from tests.cpu.test_report import open_in_browser

    made = []  # the temporary directories this test's commands make (other tests' come and go elsewhere)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    same = cli("diff", str(V2), str(V2))
    assert same.returncode == 0 and "3 steps x 6 stages, 18 checksums compared" in same.stdout, same.stderr
    planted = _copy(tmp_path, "planted")
    _edit(planted / "train_data" / "2.pt", _log_prob)
    differ = cli("diff", str(V2), str(planted), "--json")
    assert differ.returncode == 1
    found = json.loads(differ.stdout)
    assert (found["first"]["step"], found["first"]["stage"]) == (2, "old_logprobs") and found["b"] == str(planted)
    check = cli("check", "logprobs", str(V2), "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["source"] == "recorded"
    tito = cli("check", "tito", str(V2))  # no engine ids in slime's dumps: judged by evidence, never "no drift"
    assert tito.stdout.startswith(f"{V2}: the recording holds no engine ids") and "no drift" not in tito.stdout
    for name, runs in (("one", [V2]), ("pair", [V2, planted])):
        page = tmp_path / f"{name}.html"
        done = cli("report", *map(str, runs), "--out", str(page))
        assert done.returncode == 0, done.stderr
        dom, console = open_in_browser(page, tmp_path / f"{name}.png")
        assert console == []
        if name == "pair":
            assert "First divergence at <b>step 2</b>, stage <b>old_logprobs</b>" in dom
    imports = [d for d in made if Path(d).name.startswith("rlbench-slime-dump-")]
    assert len(imports) >= 6 and not any(Path(d).exists() for d in imports)  # every import made was removed


def test_check_logprobs_gives_slimes_own_metric_for_each_rollout():
    """slime's train_rollout_logprob_abs_diff of each rollout, computed by slime's own reducer on the same tensors
    (tests/slime_dumps/make_dumps.py `expected_metrics`, committed in tests/slime_dumps/expected.json), against
    `check logprobs` on the dump directory, run from its relative path as a user types it."""
    expected = json.loads((REPO / "tests" / "slime_dumps" / "expected.json").read_text())
    done = cli("check", "logprobs", "examples/slime-dump-details", "--json", cwd=REPO)
    assert done.returncode == 0, done.stderr
    got = {str(row["step"]): row["train_rollout_logprob_abs_diff"] for row in json.loads(done.stdout)["per_step"]}
    slime = expected["train_rollout_logprob_abs_diff"]
    assert set(got) == set(slime) == {"0", "1", "2"}
    for rollout, value in slime.items():
        assert abs(got[rollout] - value) <= 1e-6, (rollout, got[rollout], value)


def test_miles_rollout_dump_metadata_is_kept_and_an_unknown_top_level_key_refused(tmp_path):
    """Miles' rollout dumps carry a top-level `metadata` (radixark/miles e0540eb29): kept in the step's JSON and
    named; a key neither writes is refused by name, never dropped."""
    from rlbench.rundir import recording

    miles = _copy(tmp_path, "miles")
    _edit(miles / "rollout_data" / "1.pt", lambda d: d.update(metadata={"prompt_group_sizes": [4, 4]}))
    out = tmp_path / "out"
    done = _import(miles, out)
    assert done.returncode == 0, done.stderr
    assert "Miles' rollout-dump metadata (prompt_group_sizes) of 1 rollout ids kept" in done.stdout
    _, meta = recording.read_step(out, 1)
    assert meta["miles_metadata"] == {"prompt_group_sizes": [4, 4]}
    odd = _copy(tmp_path, "odd")
    _edit(odd / "rollout_data" / "2.pt", lambda d: d.update(sampler_state={"x": 1}))
    done = _import(odd, tmp_path / "odd-out")
    assert done.returncode == 2 and "does not write: sampler_state" in done.stderr and "2.pt" in done.stderr


def _v1_directory(tmp_path: Path, layout: str = "v1") -> Path:
    """The same rollouts with their train dumps in format 1 (a file per rank), written from the same ranks' data
    (make_dumps.py): "v1" by slime's own format-1 writer, 2 DP x 2 TP copies; "v1-cp" by the same writer, 2 DP x 2
    CP x 2 pipeline stages, slices cut by slime's own slice_log_prob_with_cp, no CP rank recorded; "miles-cp" by
    Miles' own writer (radixark/miles 31f1ca961), 2 DP x 2 CP, cp_rank and cp_size recorded."""
    v1 = tmp_path / layout
    shutil.copytree(V2 / "rollout_data", v1 / "rollout_data")
    shutil.copytree(V2 / "tokenizer", v1 / "tokenizer")
    shutil.copytree(REPO / "tests" / "slime_dumps" / layout / "train_data", v1 / "train_data")
    return v1


def test_format_1_per_rank_files_read_as_the_same_run(reference, tmp_path):
    v1 = _v1_directory(tmp_path)
    out = tmp_path / "out"
    done = _import(v1, out)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "manifest.json").read_text())["imported"]["train_format"] == 1
    same = cli("diff", str(reference), str(out))
    assert same.returncode == 0, same.stdout
    assert "3 steps x 6 stages" in same.stdout and "schedules (DP shards, micro-batches) of 3 steps" in same.stdout


def test_format_1_copies_that_disagree_and_rows_without_a_sample_are_findings(tmp_path):
    v1 = _v1_directory(tmp_path)
    _edit(v1 / "train_data" / "1_1.pt", lambda d: d["rollout_data"]["log_probs"][0].add_(1.0))
    _edit(v1 / "train_data" / "2_2.pt", lambda d: d["rollout_data"]["sample_indices"].__setitem__(0, 999))
    done = _import(v1, tmp_path / "out")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ranks 0 and 1 hold the same rows and disagree" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_format_1_rows_of_no_rollout_sample_and_ranks_of_two_cp_sizes_are_findings(tmp_path):
    """A DP shard whose rows (both tensor-parallel copies) name an index the rollout dump does not hold, and a
    Miles shard whose ranks record different context-parallel sizes: each a finding naming the rollout, the ranks
    and what is wrong (exit 1, one line, nothing written), never joined by a guess."""
    rows = _v1_directory(tmp_path / "a")
    for rank in (2, 3):  # the two copies of DP shard [17, 19, 21, 23]
        _edit(rows / "train_data" / f"2_{rank}.pt", lambda d: d["rollout_data"]["sample_indices"].__setitem__(0, 999))
    sizes = _v1_directory(tmp_path / "b", "miles-cp")
    _edit(sizes / "train_data" / "2_1.pt", lambda d: d.update(cp_size=4))
    for directory, says in (
        (rows, "rollout 2, rank 2 row 0 (sample_index 999): no sample of that index in the rollout dump"),
        (sizes, "rollout 2, DP shard of ranks [0, 1]: the ranks record different context-parallel sizes ([2, 4] or"),
    ):
        out = directory.parent / "out"
        done = _import(directory, out)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "findings): " + says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_with_a_tolerance_each_stage_reports_its_largest_difference(reference, tmp_path):
    """Two changes in train log-probs: 0.5 at rollout 1, 1e-4 at rollout 2. Within rtol 1e-2 the runs part at the
    first; within atol 1 they agree; either way the stage's largest difference is named, step and place."""
    planted = _copy(tmp_path, "near")
    _edit(planted / "train_data" / "1.pt", _log_prob)
    _edit(
        planted / "train_data" / "2.pt",
        lambda d: d["samples"][0]["log_probs"].__setitem__(0, d["samples"][0]["log_probs"][0] + 1e-4),
    )
    out = tmp_path / "out"
    assert _import(planted, out).returncode == 0
    for tolerance, code in ((["--rtol", "1e-2"], 1), (["--atol", "1"], 0)):
        done = cli("diff", str(reference), str(out), *tolerance, "--json")
        assert done.returncode == code, done.stdout
        largest = json.loads(done.stdout)["largest"]
        assert set(largest) == {"old_logprobs"}
        assert largest["old_logprobs"]["step"] == 1 and "sample 5" in largest["old_logprobs"]["where"]
        assert abs(largest["old_logprobs"]["max_abs"] - 0.5) < 1e-6
    text = cli("diff", str(reference), str(out), "--atol", "1")
    assert text.stdout.startswith("no difference (within atol=1")
    assert "largest difference, old_logprobs: 5.000e-01" in text.stdout and "at step 1, sample 5" in text.stdout


@pytest.mark.parametrize(
    ("layout", "ranks", "how"),
    [
        (
            "v1-cp",
            "[[0, 4], [1, 5]], [[2, 6], [3, 7]]",
            "inferred: ranks with equal rollout_log_probs slices are one CP rank",
        ),
        ("miles-cp", "[[0], [1]], [[2], [3]]", "recorded by the ranks (cp_rank)"),
    ],
)
def test_context_parallel_slices_reassembled_to_the_same_run(reference, tmp_path, layout, ranks, how):
    """Format-1 files sliced by context parallelism 2 (slime's: no CP rank recorded, two pipeline stages, the first
    without the trainer's fields; Miles': cp_rank recorded) import as the format-2 dump of the same data: diff
    finds no difference in any stage or schedule."""
    out = tmp_path / "out"
    done = _import(_v1_directory(tmp_path, layout), out)
    assert done.returncode == 0, done.stderr
    assert f"rollout 2: context parallelism 2 reassembled in 2 DP shards, CP ranks {ranks} ({how}" in done.stdout
    same = cli("diff", str(reference), str(out))
    assert same.returncode == 0, same.stdout
    assert "3 steps x 6 stages" in same.stdout and "schedules (DP shards, micro-batches) of 3 steps" in same.stdout


def test_context_parallel_slices_that_do_not_fit_or_a_missing_cp_rank_are_findings(tmp_path):
    """A slice one value short, and a shard's CP rank whose files are gone: exit 1, one line naming the rollout
    and the ranks, nothing written."""
    short = _v1_directory(tmp_path, "v1-cp")
    _edit(
        short / "train_data" / "1_5.pt",
        lambda d: d["rollout_data"]["log_probs"].__setitem__(0, d["rollout_data"]["log_probs"][0][:-1]),
    )
    done = _import(short, tmp_path / "out")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "rollout 1, DP shard of ranks [0, 1, 4, 5]: log_probs of row 0 does not fit context parallelism 2's split"
        in done.stderr
    )
    assert not (tmp_path / "out").exists()
    gone = _v1_directory(tmp_path / "b", "miles-cp")
    (gone / "train_data" / "2_3.pt").unlink()
    done = _import(gone, tmp_path / "out2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rollout 2, DP shard of ranks [2]: context-parallel ranks [1] of 2 missing" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_train_dumps_other_fields_are_compared_value_by_value(reference, tmp_path):
    """What no stage holds is compared too, each found where planted (exit 1): a kl value, the trainer's log-prob of
    a token outside the loss mask (a tool span: 0 in old_logprobs), and per-token advantages (PPO's, which vary
    within a sample: no advantages stage, kept per token)."""
    cases = {
        "kl": (lambda d: d["samples"][3]["kl"].__setitem__(0, 5.0), "sample 3, kl[0]"),
        "untrained": (
            lambda d: d["samples"][5]["log_probs"].__setitem__(2, 5.0),
            "sample 5, untrained_tokens.log_probs[0]",
        ),
        # the top-level raw_reward, the whole batch in the rollout dump's order: kept with the sample at position 6
        "raw_reward": (lambda d: d["raw_reward"].__setitem__(6, 0.25), "sample 6, raw_reward"),
    }
    train = torch.load(V2 / "train_data" / "1.pt", weights_only=True)
    assert train["samples"][5]["loss_masks"].tolist() == [1, 1, 0, 1]  # the fixture's tool span in sample 5
    for name, (change, where) in cases.items():
        planted = _copy(tmp_path, name)
        _edit(planted / "train_data" / "1.pt", change)
        done = cli("diff", str(reference), str(planted), "--json")
        assert done.returncode == 1, done.stdout
        first = json.loads(done.stdout)["first"]
        assert (first["step"], first["stage"], first["where"]) == (1, "train_fields", where), first
    per_token = _copy(tmp_path, "ppo")
    for rid in range(3):
        _edit(
            per_token / "train_data" / f"{rid}.pt",
            lambda d: [s["advantages"].__setitem__(0, -7.0) for s in d["samples"]],
        )
    ppo = tmp_path / "ppo-run"
    done = _import(per_token, ppo)
    assert "advantages vary within samples (a per-token estimator): kept per token" in done.stdout
    changed = tmp_path / "ppo2"
    shutil.copytree(per_token, changed)
    _edit(changed / "train_data" / "2.pt", lambda d: d["samples"][4]["advantages"].__setitem__(1, 3.0))
    done = cli("diff", str(ppo), str(changed), "--json")
    first = json.loads(done.stdout)["first"]
    assert done.returncode == 1 and (first["step"], first["stage"], first["where"]) == (
        2,
        "train_fields",
        "sample 4, advantages[1]",
    )


def test_a_miles_dump_directory_with_its_sidecars(reference, tmp_path):
    """Miles' own writers (radixark/miles 31f1ca961): rollout dumps with `metadata` and trajectory JSONL (each
    conversation Miles popped from its sample's metadata), train dumps a file per rank with context parallelism 2.
    The conversations are put back where Miles took them from; the parquet copy is named as not read; the run
    equals slime's import of the same data, and diff says what it did not compare."""
    miles = tmp_path / "miles"
    shutil.copytree(REPO / "tests" / "slime_dumps" / "miles-rollout", miles)
    shutil.copytree(REPO / "tests" / "slime_dumps" / "miles-cp" / "train_data", miles / "train_data")
    shutil.copytree(V2 / "tokenizer", miles / "tokenizer")
    (miles / "dashboard_columns").mkdir()
    out = tmp_path / "out"
    done = _import(miles, out)
    assert done.returncode == 0, done.stderr
    assert "dashboard_columns/ (Miles' parquet copy of the rollout dumps' per-token columns) not read" in done.stdout
    assert "Miles' trajectory/ conversations of 6 samples put back in their metadata.messages" in done.stdout
    from rlbench.rundir import recording

    rows = [json.loads(line) for line in (miles / "trajectory" / "1.jsonl").read_text().splitlines()]
    samples = recording.read_step(out, 1)[1]["samples"]
    for row in rows:
        sample = next(s for s in samples if s["index"] == row["sample_index"])
        assert sample["slime"]["metadata"]["messages"] == row["messages"]
    same = cli("diff", str(reference), str(out))
    assert same.returncode == 0, same.stdout
    assert "B: the rollout dumps' other sample fields (kept in each sample's `slime` metadata" in same.stderr
    bad = tmp_path / "bad"
    shutil.copytree(miles, bad)
    lines = (bad / "trajectory" / "2.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"status":"completed"', '"status":"aborted"')
    (bad / "trajectory" / "2.jsonl").write_text("\n".join(lines) + "\n")
    done = _import(bad, tmp_path / "bad-out")
    assert done.returncode == 2 and "2.jsonl: line 2, status: 'aborted' differs from the sample's" in done.stderr


def test_slime_rollout_dumps_before_2025_07_are_named_and_refused(tmp_path):
    """slime's first two rollout-dump formats: the train data's columns (torch.save, 2025-06) and a plain pickle of
    the samples (pickle.dump, 2025-06-24 to 2025-07-23; no rollout id, no group_index): each named, exit 2, and
    the pickle never loaded (a pickle that would run code if loaded stays unrun)."""
    import pickle

    columns = tmp_path / "3.pt"
    torch.save({"tokens": [[1, 2, 3]], "response_lengths": [1], "rewards": [1.0]}, columns)
    done = cli("import", "slime", str(columns), "--tokenizer", str(V2 / "tokenizer"), "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "slime's first rollout dump format (2025-06, e0be9a075..1dc85516d^)" in done.stderr
    plain = tmp_path / "4.pt"
    marker = tmp_path / "ran"

    class Runs:
        def __reduce__(self):
            return (Path.touch, (marker,))

    with open(plain, "wb") as f:
        pickle.dump([{"index": 0, "tokens": [1, 2], "response_length": 1, "status": "completed"}, Runs()], f)
    done = cli("import", "slime", str(plain), "--tokenizer", str(V2 / "tokenizer"), "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "a plain pickle of a list, not a torch.save file" in done.stderr
    assert "(1dc85516d..ed2f3a999^)" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "o").exists()


# The reader and the join called directly (no CLI, no import): each case one planted change in rollout 2's dumps,
# loaded once; the refusal's whole line and the join's whole findings are the contract, word for word.


@pytest.fixture(scope="module")
def rollout_2() -> tuple[dict, list[dict]]:
    train = torch.load(V2 / "train_data" / "2.pt", weights_only=True)
    return train, torch.load(V2 / "rollout_data" / "2.pt", weights_only=True)["samples"]


def _setting(*keys, value):
    """A change setting dump[k1][k2]... to value."""

    def change(dump):
        target = dump
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        return dump

    return change


def _saved(tmp_path: Path, dump) -> Path:
    path = tmp_path / "2.pt"
    torch.save(dump, path)
    return path


NOT_RESTORED = "expected 3 values (response_lengths), got not numbers: a field left sliced by context parallelism?"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(lambda d: [1, 2], "expected a dict (slime's train dump), got list", id="not a dict"),
        pytest.param(
            lambda d: {"rollout_id": 0, "rank": 0, "rollout_data": {}},
            "format_version: a train dump of slime's format 1 (a file per rank, named {rollout_id}_{rank}.pt): give "
            "the --dump-details directory, whose train_data/ holds every rank's file",
            id="format 1 given as a file",
        ),
        pytest.param(
            lambda d: {k: v for k, v in d.items() if k != "format_version"},
            "format_version: format_version None: rlbench reads slime's format 2",
            id="no format_version",
        ),
        pytest.param(
            _setting("format_version", value=3),
            "format_version: format_version 3: rlbench reads slime's format 2",
            id="format 3",
        ),
        pytest.param(_setting("rank", value=True), "rank: expected int, got True", id="a bool rank"),
        pytest.param(_setting("samples", value={}), "samples: expected list, got {}", id="samples not a list"),
        pytest.param(
            lambda d: d | {"sampler_state": {}, "epoch": 1},
            "top-level keys slime's format 2 does not write: epoch, sampler_state",
            id="two top-level keys slime does not write",
        ),
        pytest.param(_setting("samples", 2, value=7), "samples[2]: expected a dict, got int", id="a sample not a dict"),
        pytest.param(
            _setting("samples", 0, "rollout_position", value=-1),
            "samples[0].rollout_position: expected an integer >= 0, got -1",
            id="a negative rollout_position",
        ),
        pytest.param(
            _setting("samples", 1, "data_parallel_rank", value=True),
            "samples[1].data_parallel_rank: expected an integer >= 0, got True",
            id="a bool data_parallel_rank",
        ),
        pytest.param(
            _setting("samples", 0, "multimodal_train_inputs", value={"pixel_values": [0.5]}),
            "samples[0].multimodal_train_inputs: refused: rlbench's models are text only",
            id="multimodal train inputs",
        ),
        pytest.param(
            _setting("samples", 0, "tokens", value="abc"),
            "samples[0].tokens: expected the sample's token ids",
            id="tokens not ids",
        ),
        pytest.param(
            _setting("samples", 3, "log_probs", value=["a", "b", "c"]),
            "samples[3].log_probs: " + NOT_RESTORED,
            id="per-token values not numbers",
        ),
        pytest.param(
            _setting("samples", 3, "advantages", value=5), "samples[3].advantages: " + NOT_RESTORED, id="a scalar"
        ),
        pytest.param(
            _setting("samples", 3, "loss_masks", value=[1.0, 1.0, 1.0]),
            "samples[3].loss_masks: expected integers, got [1.0, 1.0, 1.0]",
            id="loss masks as floats",
        ),
        pytest.param(
            _setting("samples", 3, "sample_index", value=[19]),
            "samples[3].sample_index: expected an integer, got [19]",
            id="a list as sample_index",
        ),
        pytest.param(
            _setting("samples", 3, "sample_index", value=True),
            "samples[3].sample_index: expected an integer, got True",
            id="a bool sample_index",
        ),
        pytest.param(
            _setting("dp_shards", 1, value=5), "dp_shards[1]: expected a dict, got int", id="a shard not a dict"
        ),
        pytest.param(
            _setting("dp_shards", 0, "data_parallel_rank", value="0"),
            "dp_shards[0].data_parallel_rank: expected an integer",
            id="a shard's rank not an integer",
        ),
        pytest.param(
            _setting("dp_shards", 1, "micro_batch_indices", value=[[0, 1], ["a"]]),
            "dp_shards[1].micro_batch_indices: expected lists of row indices",
            id="a micro-batch not row indices",
        ),
    ],
)
def test_each_malformed_train_dump_is_refused_in_one_line_naming_file_field_and_what_was_expected(
    rollout_2, tmp_path, change, says
):
    from rlbench.errors import BadInput
    from rlbench.replay.slime_train import read_train_dump

    path = _saved(tmp_path, change(copy.deepcopy(rollout_2[0])))
    with pytest.raises(BadInput) as refused:
        read_train_dump(path)
    assert str(refused.value) == f"{path}: {says}"


def test_a_train_dump_is_read_whole_and_what_slime_may_leave_out_joins(rollout_2, tmp_path):
    """The reader keeps the file's own fields (path, ids, raw_reward, the fields slime's writer does not produce,
    named); per-token fields as plain lists, a shard without micro-batches, a rollout sample without loss_mask
    (all trained) or without rollout_log_probs are what slime may write: read, and joined with no finding."""
    from rlbench.replay.slime_train import join, read_train_dump

    train, rollout = copy.deepcopy(rollout_2)
    train["samples"][3] |= {k: train["samples"][3][k].tolist() for k in ("log_probs", "rollout_log_probs")}
    train["samples"][4]["my_field"] = 1
    del train["dp_shards"][0]["micro_batch_indices"]
    rollout[0]["loss_mask"] = None
    rollout[1]["rollout_log_probs"] = None
    path = _saved(tmp_path, train)
    read = read_train_dump(path)
    assert (read.path, read.rollout_id, read.rank, read.raw_reward) == (path, 2, 0, train["raw_reward"])
    assert read.unknown == ["my_field"] and read.format_version == 2
    joined = join(rollout, read)
    assert (joined.rollout_id, joined.findings, joined.notes) == (2, [], [])
    assert joined.pairs == [(k, k) for k in range(8)]


def test_a_sample_index_slime_left_none_and_loss_masks_as_a_list_of_ints_are_read(rollout_2, tmp_path):
    """slime's writer copies each sample's `index`, which may be None (observability/train_data_utils.py), and a
    per-token column may be a plain list: both read as they are."""
    from rlbench.replay.slime_train import read_train_dump

    train = copy.deepcopy(rollout_2[0])
    train["samples"][3] |= {"sample_index": None, "loss_masks": [1, 0, 1]}
    read = read_train_dump(_saved(tmp_path, train))
    assert (read.samples[3]["sample_index"], read.samples[3]["loss_masks"]) == (None, [1, 0, 1])


def _extra_rollout_samples(count: int):
    def change(rollout):
        return rollout + [dict(rollout[0], index=24 + i) for i in range(count)]

    return change


def _whole_batch_rewards(count: int):
    """raw_reward as slime writes it for a rollout batch of `count` samples (the whole batch, trained or not)."""

    def change(dump):
        return dump | {"raw_reward": [0.5] * count}

    return change


def _tokens(k: int, change):
    def planted(dump):
        dump["samples"][k]["tokens"] = change(dump["samples"][k]["tokens"])
        return dump

    return planted


LABEL_2 = "rollout 2, train sample 2 (rollout_position 2, sample_index 18)"


@pytest.mark.parametrize(
    ("train_change", "rollout_change", "findings", "notes"),
    [
        pytest.param(
            _setting("samples", 0, "rollout_position", value=8),
            None,
            [
                "rollout 2, train sample 0 (rollout_position 8, sample_index 16): no such sample in the rollout dump "
                "(8 samples)",
                "rollout 2: DP rank 0's partition does not list the samples it trained",
                "rollout 2: rollout samples at positions 0 (index 16) are missing from the train dump",
            ],
            [],
            id="a position one past the rollout dump, the others still joined",
        ),
        pytest.param(
            lambda d: d["samples"][1].update(rollout_position=0, sample_index=16) or d,
            None,
            [
                "rollout 2, train sample 1 (rollout_position 0, sample_index 16): trained twice (also train sample 0)",
                "rollout 2: DP rank 1's partition does not list the samples it trained",
                "rollout 2: rollout samples at positions 1 (index 17) are missing from the train dump",
            ],
            [],
            id="trained twice, the others still joined",
        ),
        pytest.param(
            _tokens(2, lambda t: torch.cat([t[:8], t[8:] + 1])),
            None,
            [f"{LABEL_2}: tokens differ from the rollout dump's at token 8"],
            [],
            id="the first differing token named",
        ),
        pytest.param(
            _tokens(2, lambda t: torch.cat([t, torch.tensor([5])])),
            None,
            [
                f"{LABEL_2}: tokens differ from the rollout dump's at token 9",
                f"{LABEL_2}: total_lengths 9 != len(tokens) 10",
            ],
            [],
            id="one token more: the first past the shorter",
        ),
        pytest.param(
            _setting("samples", 2, "sample_index", value=99),
            None,
            [
                "rollout 2, train sample 2 (rollout_position 2, sample_index 99): sample_index 99 != the rollout "
                "dump's index 18"
            ],
            [],
            id="both indices named",
        ),
        pytest.param(
            _whole_batch_rewards(11),
            _extra_rollout_samples(3),
            [],
            [
                "rollout 2: the last 3 of 11 rollout samples were not trained (positions 8..10): slime's schedule "
                "keeps whole global batches and drops the rest"
            ],
            id="a trailing block dropped: a note",
        ),
        pytest.param(
            lambda d: _whole_batch_rewards(9)(d) | {"samples": [], "dp_shards": []},
            _extra_rollout_samples(1),
            [
                "rollout 2: rollout samples at positions 0, 1, 2, 3, 4, 5, 6, 7 and 1 more (index 16, 17, 18, 19, 20, "
                "21, 22, 23 and 1 more) are missing from the train dump"
            ],
            [],
            id="nine untrained, eight named",
        ),
        pytest.param(
            lambda d: d["dp_shards"].append(copy.deepcopy(d["dp_shards"][0])) or d,
            None,
            ["rollout 2: DP shard(s) repeated missing from dp_shards (present: [0, 0, 1])"],
            [],
            id="a shard given twice",
        ),
    ],
)
def test_each_join_that_does_not_hold_is_named_by_sample_and_the_rest_still_joined(
    rollout_2, tmp_path, train_change, rollout_change, findings, notes
):
    from rlbench.replay.slime_train import join, read_train_dump

    train, rollout = copy.deepcopy(rollout_2)
    train = train_change(train) if train_change else train
    rollout = rollout_change(rollout) if rollout_change else rollout
    joined = join(rollout, read_train_dump(_saved(tmp_path, train)))
    assert (joined.findings, joined.notes) == (findings, notes)


def test_engine_log_probs_are_held_at_float32_whatever_either_file_or_torchs_default_dtype(rollout_2, tmp_path):
    """slime trains on float32 log-probs; the rollout dump holds the engine's as Python floats (float64). A train
    dump holding them at float64 too, read where torch's default dtype is float64, still joins: both sides are
    rounded to float32 before they are compared, never to the default dtype."""
    from rlbench.replay.slime_train import join, read_train_dump

    train, rollout = copy.deepcopy(rollout_2)
    train["samples"][3]["rollout_log_probs"] = torch.tensor(rollout[3]["rollout_log_probs"], dtype=torch.float64)
    read = read_train_dump(_saved(tmp_path, train))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        joined = join(rollout, read)
    finally:
        torch.set_default_dtype(default)
    assert joined.findings == []


# Format 1 read directly (read_train_dump_v1, cp_spans, assemble): small rank files written to tmp_path, one property
# a test; expected values worked by hand from slime's writer and megatron's split as slime and Miles compute it
# (cp_utils.get_logits_and_tokens_offset_with_cp).

V1_RESPONSE = [k / 10 + 0.01 for k in range(10)]  # a response of 10 tokens after a prompt of 1 token: total 11
V1_REFUSED = "expected {'rollout_id', 'rank', 'rollout_data'} (slime's format 1)"
V1_NO_INDEX = "expected every row's Sample.index: format 1 joins by it (a sample without one cannot be joined)"


def _v1_rows(indices=(7,), **columns) -> dict:
    """A rank's rollout_data as slime writes it: rows of 3 tokens (prompt 1, response 2) with the trainer's
    log_probs."""
    return {
        "tokens": [torch.tensor([1, 2, 3]) for _ in indices],
        "response_lengths": [2] * len(indices),
        "sample_indices": list(indices),
        "log_probs": [torch.tensor([-0.5, -0.25]) for _ in indices],
        **columns,
    }


def _v1_file(tmp_path: Path, rank: int, data: dict, **top) -> Path:
    path = tmp_path / f"3_{rank}.pt"
    torch.save({"rollout_id": 3, "rank": rank, "rollout_data": data, **top}, path)
    return path


def _v1_read(paths: list[Path], indices: list[int]):
    from rlbench.replay.slime_train_v1 import read_train_dump_v1

    findings: list[str] = []
    return read_train_dump_v1(paths, [{"index": i} for i in indices], findings), findings


def _plain(value):
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(lambda d: [d], V1_REFUSED, id="not a dict"),
        pytest.param(lambda d: {k: v for k, v in d.items() if k != "rank"}, V1_REFUSED, id="no rank"),
        pytest.param(
            lambda d: d | {"sampler_state": {}, "epoch": 1},
            "top-level keys format 1 does not write: epoch, sampler_state",
            id="two top-level keys format 1 does not write",
        ),
        pytest.param(lambda d: d | {"cp_rank": True}, "cp_rank: expected an integer >= 0, got True", id="bool cp_rank"),
        pytest.param(lambda d: d | {"cp_rank": -1}, "cp_rank: expected an integer >= 0, got -1", id="cp_rank -1"),
        pytest.param(lambda d: d | {"cp_size": 0}, "cp_size: expected an integer >= 1, got 0", id="cp_size 0"),
        pytest.param(lambda d: d | {"cp_size": "2"}, "cp_size: expected an integer >= 1, got '2'", id="cp_size text"),
        pytest.param(
            lambda d: d | {"qkv_format": "sbhd"}, "qkv_format: expected 'thd' or 'bshd', got 'sbhd'", id="sbhd"
        ),
        pytest.param(
            _setting("rollout_data", value=[]),
            "rollout_data: expected a dict of columns with response_lengths",
            id="rollout_data not a dict",
        ),
        pytest.param(
            _setting("rollout_data", "sample_indices", value=[None]),
            "rollout_data.sample_indices: " + V1_NO_INDEX,
            id="a row without its index",
        ),
        pytest.param(
            _setting("rollout_data", "sample_indices", value=None),
            "rollout_data.sample_indices: " + V1_NO_INDEX,
            id="no sample_indices",
        ),
        pytest.param(
            _setting("rollout_data", "log_probs", value=[["a", "b"]]),
            "rollout_data.log_probs: expected each row a 1-D tensor or list of numbers (a value per token), row 0 is "
            "['a', 'b']",
            id="text in a log-prob row",
        ),
        pytest.param(
            _setting("rollout_data", "rollout_log_probs", value=[[-0.5, True]]),
            "rollout_data.rollout_log_probs: expected each row a 1-D tensor or list of numbers (a value per token), "
            "row 0 is [-0.5, True]",
            id="a bool in a list row",
        ),
        pytest.param(
            _setting("rollout_data", "log_probs", value=[torch.zeros(2, 1)]),
            "rollout_data.log_probs: expected each row a 1-D tensor or list of numbers (a value per token), row 0 is "
            "a 2-D float32 tensor",
            id="a 2-D row",
        ),
        pytest.param(
            _setting("rollout_data", "teacher_log_probs", value=[torch.tensor([True, False])]),
            "rollout_data.teacher_log_probs: expected each row a 1-D tensor or list of numbers (a value per token), "
            "row 0 is a 1-D bool tensor",
            id="a bool tensor row",
        ),
        pytest.param(
            _setting("rollout_data", "log_probs", value=[torch.tensor([1j, 2j])]),
            "rollout_data.log_probs: expected each row a 1-D tensor or list of numbers (a value per token), row 0 is "
            "a 1-D complex64 tensor",
            id="a complex row",
        ),
        pytest.param(
            lambda d: d | {"qkv_format": "bshd", "cp_size": 2},
            "qkv_format: qkv_format bshd splits the padded length, and no rollout_data.max_seq_lens says what it was",
            id="bshd split without max_seq_lens",
        ),
    ],
)
def test_a_malformed_format_1_file_is_refused_in_one_line_naming_file_field_and_what_was_expected(
    tmp_path, change, says
):
    """Each way a rank's file is not what slime's or Miles' format-1 writer writes is bad input (exit 2) in one
    line naming that file (not another rank's), the field and what was expected."""
    from rlbench.errors import BadInput

    good = _v1_file(tmp_path, 0, _v1_rows())
    path = tmp_path / "3_1.pt"
    torch.save(change({"rollout_id": 3, "rank": 1, "rollout_data": _v1_rows()}), path)
    with pytest.raises(BadInput) as refused:
        _v1_read([good, path], [7])
    assert str(refused.value) == f"{path}: {says}" and refused.value.exit_code == 2


def test_a_format_1_row_of_plain_numbers_is_read_as_a_tensor_row_would_be(tmp_path):
    """A per-token row held as a Python list (a writer's `.tolist()`) of ints and floats is read, its values kept,
    as the same row held as a tensor: the reader refuses bools and text in a row (above), not numbers."""
    path = _v1_file(tmp_path, 0, _v1_rows(log_probs=[[-1, -0.25]]))
    train, findings = _v1_read([path], [7])
    assert findings == [] and _plain(train.samples)[0]["log_probs"] == [-1, -0.25]


@pytest.mark.parametrize(
    "top",
    [
        {},
        {"qkv_format": "bshd"},
        {"qkv_format": "bshd", "cp_size": 1},
        {"cp_size": 1},
        {"cp_rank": 0, "cp_size": 1, "qkv_format": "thd"},
    ],
    ids=["slime's", "bshd, no cp_size", "bshd, cp_size 1", "cp_size without cp_rank", "Miles' without CP"],
)
def test_one_format_1_file_without_context_parallelism_is_its_dp_shard_read_whole(tmp_path, top):
    """One rank's file, with or without Miles' cp_rank, cp_size and qkv_format (bshd wants no max_seq_lens where
    nothing is split; a cp_size without a cp_rank is CP rank 0), is one DP shard read whole: each row a sample at
    its rollout position, the file's path, rollout and rank kept, no finding and no note."""
    path = _v1_file(tmp_path, 4, _v1_rows((7, 5)), **top)
    train, findings = _v1_read([path], [5, 7])
    assert (findings, train.notes, train.unknown, train.format_version) == ([], [], [], 1)
    assert (train.path, train.rollout_id, train.rank, train.raw_reward) == (path, 3, 4, None)
    row = {"tokens": [1, 2, 3], "response_lengths": 2, "log_probs": [-0.5, -0.25], "data_parallel_rank": 0}
    assert _plain(train.samples) == [
        row | {"rollout_position": 0, "sample_index": 5},
        row | {"rollout_position": 1, "sample_index": 7},
    ]
    layout = dict.fromkeys(("micro_batch_indices", "num_microbatches", "global_batch_sizes"))
    assert _plain(train.shards) == [
        {"rank": 4, "data_parallel_rank": 0, "sample_indices": [7, 5], "partition": [1, 0], **layout}
    ]


def test_format_1_dp_shards_are_numbered_by_lowest_rank_and_read_from_the_lowest_rank_holding_the_trainers_fields(
    tmp_path,
):
    """Ranks holding the same rows are one DP shard, numbered by its lowest rank (not by its rows); its columns
    are read from its lowest rank holding log_probs (rank 2: not the first pipeline stage 0, nor rank 10 whose
    file name sorts first), or where none holds them (a shard of one first pipeline stage) from its lowest rank;
    a field of another length than the rows stays with the shard; raw_reward is kept from the shard that holds
    it."""
    stage_0, untrained = _v1_rows((9,)), _v1_rows((7,))
    del stage_0["log_probs"], untrained["log_probs"]
    own = {"step_stats": [1.0, 2.0, 3.0], "global_stats": torch.tensor([4.0, 5.0]), "scale": torch.tensor(0.5)}
    paths = [
        _v1_file(tmp_path, 0, stage_0),
        _v1_file(tmp_path, 1, untrained | own),
        _v1_file(tmp_path, 2, _v1_rows((9,), raw_reward=[0.0, 1.0])),
        _v1_file(tmp_path, 10, _v1_rows((9,), raw_reward=[0.0, 1.0])),
    ]
    train, findings = _v1_read(paths, [7, 9])
    assert (findings, train.rank, train.raw_reward, train.unknown) == ([], 0, [0.0, 1.0], [])
    read = [
        (s["sample_index"], s["rollout_position"], s["data_parallel_rank"], s.get("log_probs")) for s in train.samples
    ]
    assert _plain(read) == [[7, 0, 1, None], [9, 1, 0, [-0.5, -0.25]]]
    layout = dict.fromkeys(("micro_batch_indices", "num_microbatches", "global_batch_sizes"))
    assert _plain(train.shards) == [
        {"rank": 2, "data_parallel_rank": 0, "sample_indices": [9], "partition": [1], **layout},
        {"rank": 1, "data_parallel_rank": 1, "sample_indices": [7], "partition": [0], **layout} | _plain(own),
    ]


def test_format_1_shards_that_cannot_be_put_together_are_each_a_finding_and_the_rest_still_read(tmp_path):
    """Each DP shard or row that cannot be put together is its own finding, word for word, in rank order, and what
    can be is still read: a row of no rollout sample (its shard's other row still read), a CP rank no file holds,
    a CP rank beyond the recorded size, a field one CP rank lacks, slices that no field every rank holds tells
    apart."""
    v = V1_RESPONSE

    def sliced(index: int, **fields) -> dict:  # one row of 11 tokens, response 10, fields CP-sliced
        columns = {name: [torch.tensor(values)] for name, values in fields.items()}
        return {"tokens": [torch.arange(11)], "response_lengths": [10], "sample_indices": [index], **columns}

    paths = [
        _v1_file(tmp_path, 0, _v1_rows((999, 7))),
        _v1_file(tmp_path, 1, sliced(5, log_probs=v[3:9]), cp_rank=1, cp_size=2),
        *[_v1_file(tmp_path, r, sliced(6, log_probs=v[3:9]), cp_rank=r - 2, cp_size=2) for r in (2, 3, 4)],
        _v1_file(tmp_path, 6, sliced(8, log_probs=v[:3] + v[9:], advantages=v[:3] + v[9:]), cp_rank=0, cp_size=2),
        _v1_file(tmp_path, 7, sliced(8, log_probs=v[3:9]), cp_rank=1, cp_size=2),
        _v1_file(tmp_path, 8, sliced(4, rollout_log_probs=v[:3] + v[9:])),
        _v1_file(tmp_path, 9, sliced(4, log_probs=v[3:9])),
    ]
    train, findings = _v1_read(paths, [4, 5, 6, 7, 8])
    assert findings == [
        "rollout 3, rank 0 row 0 (sample_index 999): no sample of that index in the rollout dump",
        "rollout 3, DP shard of ranks [1]: context-parallel ranks [0] of 2 missing",
        "rollout 3, DP shard of ranks [2, 3, 4]: context-parallel ranks [0, 1, 2] of 2 missing",
        "rollout 3, DP shard of ranks [6, 7]: advantages held by CP ranks [0] of 2 only",
        "rollout 3, DP shard of ranks [8, 9]: fields are sliced by context parallelism and no field every rank "
        "holds tells its CP ranks apart",
    ]
    assert [(s["sample_index"], s["rollout_position"]) for s in train.samples] == [(7, 3)]


@pytest.mark.parametrize(
    ("change", "disagree"),
    [
        pytest.param(lambda d: None, False, id="equal copies"),
        pytest.param(lambda d: d["rewards"].__setitem__(0, torch.tensor(0.5)), False, id="a number as a tensor"),
        pytest.param(lambda d: d.update(entropy=[torch.tensor([0.1, 0.2])]), True, id="a column one lacks"),
        pytest.param(lambda d: d.update(rollout_mask_sums=torch.tensor([2.0])), True, id="a tensor one lacks"),
        pytest.param(lambda d: d.update(num_microbatches=[2, 2]), True, id="a list one entry longer"),
        pytest.param(lambda d: d.update(step=4), True, id="a number"),
        pytest.param(lambda d: d.update(mask_sums=torch.tensor([3.0])), True, id="a tensor"),
    ],
)
def test_format_1_copies_of_one_rank_agree_in_every_field_or_are_one_finding(tmp_path, change, disagree):
    """Ranks holding the same rows and the trainer's fields (tensor-parallel copies) are compared in every field,
    one that only one copy holds included, by value (0.5 as a number or as a tensor alike): any difference is one
    finding naming both ranks, word for word, and the shard is still read from the lower rank."""
    first = _v1_rows(rewards=[0.5], step=3, num_microbatches=[2], mask_sums=torch.tensor([2.0]))
    second = copy.deepcopy(first)
    change(second)
    train, findings = _v1_read([_v1_file(tmp_path, 0, first), _v1_file(tmp_path, 1, second)], [7])
    says = (
        "rollout 3, DP shard of ranks [0, 1]: ranks 0 and 1 hold the same rows and disagree (tensor-parallel copies "
        "should be equal)"
    )
    assert findings == ([says] if disagree else [])
    assert train.shards[0]["rank"] == 0 and [s["sample_index"] for s in train.samples] == [7]


def test_a_format_1_row_slime_would_not_write_is_refused_naming_the_first_file_and_the_samples_place(tmp_path):
    """A row that is no sample format 2 would hold (tokens not ids) is bad input naming the rollout's first file
    and the sample's place in rollout order."""
    from rlbench.errors import BadInput

    paths = [_v1_file(tmp_path, 0, _v1_rows((5,))), _v1_file(tmp_path, 1, _v1_rows((7,), tokens=["abc"]))]
    with pytest.raises(BadInput) as refused:
        _v1_read(paths, [5, 7])
    assert str(refused.value) == f"{paths[0]}: samples[1].tokens: expected the sample's token ids"


@pytest.mark.parametrize(
    ("total", "response", "padded", "spans"),
    [
        pytest.param(11, 10, None, [[(0, 3), (9, 10)], [(3, 6), (6, 9)]], id="both chunks in the response"),
        pytest.param(8, 5, None, [[(4, 5)], [(0, 2), (2, 4)]], id="a chunk wholly in the prompt"),
        pytest.param(11, 10, 16, [[(0, 4)], [(4, 8), (8, 10)]], id="bshd: chunks of the padded length"),
    ],
)
def test_each_cp_rank_holds_megatrons_zigzag_chunks_of_the_response_one_position_early(total, response, padded, spans):
    """The response positions each of 2 CP ranks holds, worked by hand from get_logits_and_tokens_offset_with_cp:
    chunk size ceil(length / 4) of the sequence (of the padded length under bshd), rank r holding chunks r and
    3 - r, each log-prob from the logits one position before its token, a chunk wholly in the prompt holding
    nothing."""
    from rlbench.replay.slime_train_v1 import cp_spans

    assert [cp_spans(total, response, r, 2, padded) for r in range(2)] == spans


def test_cp_slices_reassemble_bit_for_bit_at_the_first_slices_dtype_and_lists_at_float32(tmp_path):
    """Slices reassemble bit for bit at the first CP rank's dtype (float64 kept, a list of floats beside it kept
    exact); slices held as lists of numbers at float32, whatever torch's default dtype; CP size 1 is its one slice;
    slices that leave part of the response uncovered (a padded length shorter than the sequence) are None."""
    from rlbench.replay.slime_train_v1 import assemble

    whole = torch.tensor(V1_RESPONSE, dtype=torch.float64)
    low, high = whole[[0, 1, 2, 9]], whole[3:9]
    for chunks in ([low, high], [low, high.tolist()], [whole]):
        out = assemble(chunks, 11, 10)
        assert out.dtype == torch.float64 and torch.equal(out, whole)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        lists = [assemble([low.tolist(), high.tolist()], 11, 10), assemble([whole.tolist()], 11, 10)]
    finally:
        torch.set_default_dtype(default)
    for out in lists:
        assert out.dtype == torch.float32 and torch.equal(out, whole.float())
    assert assemble([whole[:2], whole[2:4]], 11, 10, padded=4) is None


@pytest.mark.parametrize(
    ("top", "columns", "held"),
    [
        pytest.param(
            {"qkv_format": "bshd"},
            {"total_lengths": [11], "max_seq_lens": [16]},
            ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9]),
            id="bshd: by the padded length",
        ),
        pytest.param(
            {"qkv_format": "thd"}, {"max_seq_lens": [16]}, ([0, 1, 2, 9], [3, 4, 5, 6, 7, 8]), id="thd: by tokens"
        ),
        pytest.param({}, {"total_lengths": [12]}, ([0, 1, 8, 9], [2, 3, 4, 5, 6, 7]), id="by total_lengths"),
    ],
)
def test_format_1_cp_slices_reassemble_by_the_split_that_cut_them(tmp_path, top, columns, held):
    """Two CP ranks' slices (Miles': cp_rank recorded) reassemble to the response as megatron's split cut them: by
    the padded length (max_seq_lens) under qkv_format bshd, by the sequence length under thd (max_seq_lens then
    aside), that length read from total_lengths where recorded, else counted from tokens."""
    v = torch.tensor(V1_RESPONSE)
    paths = [
        _v1_file(
            tmp_path,
            cp_rank,
            {
                "tokens": [torch.arange(11)],
                "response_lengths": [10],
                "sample_indices": [7],
                "log_probs": [v[held[cp_rank]]],
            }
            | columns,
            cp_rank=cp_rank,
            cp_size=2,
            **top,
        )
        for cp_rank in (0, 1)
    ]
    train, findings = _v1_read(paths, [7])
    assert findings == [] and torch.equal(train.samples[0]["log_probs"], v)
    assert train.notes == [
        "rollout 3: context parallelism 2 reassembled in 1 DP shards, CP ranks [[0], [1]] (recorded by the ranks "
        "(cp_rank))"
    ]


def _renumbered(path: Path, target: Path, rollout_id: int) -> None:
    dump = torch.load(path, weights_only=True)
    torch.save(dump | {"rollout_id": rollout_id}, target)


@pytest.mark.parametrize(
    ("layout", "files"),
    [
        pytest.param("v2", "train_data/7.pt", id="format 2"),
        pytest.param("v1", "train_data/7_0.pt, train_data/7_1.pt, train_data/7_2.pt, train_data/7_3.pt", id="format 1"),
    ],
)
def test_a_train_dump_without_its_rollout_dump_is_a_finding_naming_it_and_read_with_it(tmp_path, layout, files):
    """train_data/7.pt (or format 1's 7_{rank}.pt) with no rollout_data/7.pt: a finding naming the files, nothing
    written (issue 51: dropped silently); with rollout_data/7.pt beside it, rollout 7 is read and joined."""
    directory = _copy(tmp_path, "v2") if layout == "v2" else _v1_directory(tmp_path)
    for name in (directory / "train_data").glob("2*.pt"):
        _renumbered(name, name.with_name("7" + name.name[1:]), 7)
    done = _import(directory, tmp_path / "out")
    assert done.returncode == 1 and not (tmp_path / "out").exists()
    assert done.stderr.splitlines() == [
        "rlbench: check failed: the train dumps do not join their rollout dumps (1 findings): rollout 7: no rollout "
        f"dump (rollout_data/7.pt) for {files}"
    ]
    _renumbered(directory / "rollout_data" / "2.pt", directory / "rollout_data" / "7.pt", 7)
    done = _import(directory, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["imported"]["rollout_ids"] == [0, 1, 2, 7]
