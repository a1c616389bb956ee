"""`--async one-step` and `--async fully --max-staleness K` (rlbench/core/pipeline.py, issue 38): generation runs on a
thread while the step trains, yet which weights generate which group is the schedule's, so the bytes never depend
on timing. Each test states the schedule's arithmetic itself and holds the recording to it."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from rlbench.rundir import recording
from tests.conftest import cli, small_toml


@pytest.fixture
def run5(run_small, tmp_path):
    """run5(name, **overrides): the small config (tests/conftest.py) for five steps, at tmp_path/name."""

    def _run(name: str, **overrides):
        run_small(name, steps=5, **overrides)
        return tmp_path / name

    return _run


def _sums(path) -> bytes:
    return (path / "checksums.jsonl").read_bytes()


def _versions(path, steps: int) -> list[list[tuple[int, int, int]]]:
    """Each step's groups as the recording names them: (group number, weights version, lag)."""
    out = []
    for step in range(steps):
        samples = recording.read_step(path, step)[1]["samples"]
        seen = sorted({(s["async"]["group_id"], s["async"]["weight_version"], s["async"]["lag"]) for s in samples})
        assert all(s["weight_version"] == s["async"]["weight_version"] for s in samples)  # the engine's own word
        out.append(seen)
    return out


@pytest.fixture
def delays(monkeypatch):
    """Random sleeps (0-30 ms) in every engine generate and train step, and proof that generation overlaps
    training: where a step started a window ahead, its training waits (on an event, not a clock) until that
    window's generation has begun on its thread."""
    from rlbench.backends.hf_engine import HFEngine
    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.core.pipeline import Pipeline

    rng = random.Random()
    began, windows = threading.Event(), []
    overlapped = []
    generate, train_step, start = HFEngine.generate, TorchTrainer.train_step, Pipeline.start

    def slow_generate(self, requests):
        if threading.current_thread() is not threading.main_thread():
            began.set()
        time.sleep(rng.random() * 0.03)
        return generate(self, requests)

    def started(self, step):
        start(self, step)
        windows.append(self.thread is not None)

    def slow_train(self, batch, step):
        if windows.pop():
            overlapped.append(began.wait(timeout=300))  # set by the window's thread once it generates
            began.clear()
        time.sleep(rng.random() * 0.03)
        return train_step(self, batch, step)

    monkeypatch.setattr(HFEngine, "generate", slow_generate)
    monkeypatch.setattr(TorchTrainer, "train_step", slow_train)
    monkeypatch.setattr(Pipeline, "start", started)
    return overlapped


@pytest.mark.parametrize(("mode", "overrides"), [("one-step", {}), ("fully", {"rollout__max_staleness": 2})])
def test_two_runs_with_one_seed_write_the_same_bytes_whatever_the_timing(tmp_path, mode, overrides, delays, run5):
    settings = {"rollout__async_mode": mode, **overrides}
    slowed = run5("slowed", **settings)
    # a window at every step with a later step to feed: one-step's four; fully's three (K = 2: at step 2 the groups
    # of step 4 are generated, and step 3 has none left to start)
    assert delays == [True] * {"one-step": 4, "fully": 3}[mode], "generation did not run while steps trained"
    plain = run5("plain", **settings)
    assert _sums(slowed) == _sums(plain)
    for step in range(5):
        same = (slowed / "rollouts" / f"{step:06d}.safetensors").read_bytes() == (
            plain / "rollouts" / f"{step:06d}.safetensors"
        ).read_bytes()
        assert same, f"step {step}'s recording differs"


def test_the_schedule_names_each_groups_weights_and_lag(tmp_path, run5):
    """one-step (slime's train_async.py): step r's groups come from the weights of the last sync before r - 1
    trained, I * ((r - 1) // I); fully with bound K (interval 1): as far ahead as K allows, version max(0, r - K)."""
    for interval in (1, 2):
        one = run5(f"one-{interval}", rollout__async_mode="one-step", rollout__update_weights_interval=interval)
        expected = [
            [(2 * r + k, v, r - v) for k in range(2)]
            for r, v in enumerate([0] + [interval * ((r - 1) // interval) for r in range(1, 5)])
        ]
        assert _versions(one, 5) == expected
    fully = run5("fully", rollout__async_mode="fully", rollout__max_staleness=2)
    assert _versions(fully, 5) == [[(2 * r + k, max(0, r - 2), min(r, 2)) for k in range(2)] for r in range(5)]
    meta = recording.read_step(fully, 3)[1]
    assert meta["async"] == {"mode": "fully", "trained_version": 3, "engine_version": 3, "requeued": []}


def _pipeline(mode: str, bound: int | None, interval: int, per_step: int, steps: int, aborts, engine=None):
    """A Pipeline over a stand-in run holding only what core/pipeline.py reads: one sample a group, generated by a
    plugin that aborts group `gid` at attempt `attempt` where `aborts(gid, attempt)` says. The plugin keeps each
    call's groups, (number, attempt), in `.calls` and the prompt-id table it was handed in `.tables`; `engine`, if
    given, is held to the schedule's weights version (its `weight_version`)."""
    from types import SimpleNamespace as Stub

    from rlbench.core.pipeline import Pipeline

    class Plugin:
        def __init__(self):
            self.calls, self.tables = [], []

        def rollout_groups(self, groups, prompt_ids):
            self.calls.append([(gid, attempt) for gid, _, attempt in groups])
            self.tables.append(prompt_ids)
            return [([gid], [0] if aborts(gid, attempt) else []) for gid, _, attempt in groups]

    rollout = Stub(async_mode=mode, max_staleness=bound, update_weights_interval=interval, n_samples_per_prompt=1)
    config = Stub(rollout=rollout, data=Stub(prompts_per_step=per_step))
    cursor = Stub(indices=lambda step: list(range(per_step)))
    prompt_ids = {index: (100 + index,) for index in range(per_step)}
    run = Stub(config=config, cursor=cursor, dataset=list(range(per_step)), prompt_ids=prompt_ids)
    run.engine, run.plugin_rollout = engine, Plugin()  # the plugin generates; an engine only holds a version
    return Pipeline(run, steps)


def _drive(pipe, steps: int) -> list[tuple[list[tuple[int, int, int]], list[dict]]]:
    """Each step as session.py drives it (take, then start and wait while it trains): its groups, (number, attempt,
    weights version) in the order trained, and what is recorded with it."""
    out = []
    try:
        for step in range(steps):
            groups, log = pipe.take(step)
            out.append(([(g.gid, g.attempt, g.version) for g in groups], log))
            pipe.start(step)
            pipe.wait()
    finally:
        pipe.close()
    return out


def _requeued(gid: int, origin: int, attempt: int, version: int, step: int, reason: str = "aborted") -> dict:
    return {
        "group_id": gid,
        "origin_step": origin,
        "attempt": attempt,
        "weight_version": version,
        "step": step,
        "reason": reason,
    }


def test_no_schedule_trains_a_group_older_than_its_bound():
    """The bound is held where a group is started, so no group is ever too old when its step comes (nothing repairs
    it there). For each interval I (1-3), bound K (I - 1 .. I + 2 for fully; one-step's is I), prompts a step (1-3),
    run length (2, 5, 9) and pattern of a plugin's aborts (none, or a hash's share of first attempts, requeued and
    generated again on newer weights), each step driven as session.py drives it (take, start, wait): every trained
    group is at most K versions old, trained once, and requeued only for an abort; without aborts and with more
    steps than K, some group is exactly K old (the bound is not looser than it says)."""
    import hashlib
    import itertools

    def aborting(rate: float, salt: int):
        def aborts(gid: int, attempt: int) -> bool:
            digest = hashlib.sha256(f"{salt}/{gid}".encode()).digest()
            return attempt == 0 and digest[0] < rate * 256

        return aborts

    patterns = [(0.0, 0), *((rate, salt) for rate in (0.25, 0.5) for salt in range(4))]  # (share aborted, hash salt)
    runs = 0
    for mode, interval, per_step, steps in itertools.product(("one-step", "fully"), (1, 2, 3), (1, 2, 3), (2, 5, 9)):
        bounds = range(interval - 1, interval + 3) if mode == "fully" else [None]
        rates = patterns if mode == "fully" else patterns[:1]
        for bound, (rate, salt) in itertools.product(bounds, rates):
            pipe = _pipeline(mode, bound, interval, per_step, steps, aborting(rate, salt))
            limit = interval if bound is None else bound
            lags, trained, reasons = [], [], set()
            try:
                for step in range(steps):
                    groups, log = pipe.take(step)
                    lags += [step - g.version for g in groups]
                    trained += [g.gid for g in groups]
                    reasons |= {row["reason"] for row in log}
                    pipe.start(step)
                    pipe.wait()
            finally:
                pipe.close()
            where = (mode, interval, bound, per_step, steps, rate, salt)
            assert max(lags) <= limit, where
            assert len(trained) == len(set(trained)) and reasons <= {"aborted"}, where
            if rate == 0 and steps > limit:
                assert max(lags) == limit, where
            runs += 1
    assert runs == 27 + 27 * 4 * 9  # one-step: 27 runs without aborts; fully: four bounds, nine abort patterns each


def test_an_aborted_group_is_recorded_where_it_aborted_and_trained_later_on_newer_weights():
    """fully, K = 1, two prompts a step: group 2 (step 1's first prompt) aborts at attempts 0 and 1. Attempt 0 was
    generated ahead in window 0 (version 0) and is requeued there (recorded as at step 0); step 1 generates it
    again, with version 1 (attempt 1, aborted: requeued at step 1) and fills its place with group 4, since a
    requeued group waits for newer weights than its last attempt's; attempt 2 is generated in window 2 with
    version 2 and trained at step 3. Each requeue is recorded with the step that takes its groups next; each
    group's attempt reaches the plugin; every call is handed the run's prompt-id table."""
    pipe = _pipeline("fully", 1, 1, 2, 4, lambda gid, attempt: gid == 2 and attempt < 2)
    assert _drive(pipe, 4) == [
        ([(0, 0, 0), (1, 0, 0)], []),
        ([(3, 0, 0), (4, 0, 1)], [_requeued(2, 1, 0, 0, step=0), _requeued(2, 1, 1, 1, step=1)]),
        ([(5, 0, 1), (6, 0, 1)], []),
        ([(2, 2, 2), (7, 0, 2)], []),
    ]
    plugin = pipe.ctx.plugin_rollout
    assert plugin.calls == [[(0, 0), (1, 0)], [(2, 0), (3, 0)], [(2, 1)], [(4, 0)], [(5, 0), (6, 0)], [(2, 2), (7, 0)]]
    assert all(table is pipe.ctx.prompt_ids for table in plugin.tables)


def test_a_step_generates_at_most_max_attempts_groups_a_prompt():
    """A step that must generate its groups itself draws new ones while some abort, up to B * MAX_ATTEMPTS (8 for
    one prompt a step): seven aborted then one trained is a step; eight aborted stop the run, naming the step, the
    count and the setting."""
    from rlbench.core.pipeline import MAX_ATTEMPTS
    from rlbench.errors import BadInput

    assert MAX_ATTEMPTS == 8
    pipe = _pipeline("fully", 0, 1, 1, 1, lambda gid, attempt: gid < 7)
    assert _drive(pipe, 1) == [([(7, 0, 0)], [_requeued(gid, gid, 0, 0, step=0) for gid in range(7)])]
    pipe = _pipeline("fully", 0, 1, 1, 1, lambda gid, attempt: gid < 8)
    with pytest.raises(BadInput) as refused:
        _drive(pipe, 1)
    assert refused.value.field == "rollout.async_mode"
    assert str(refused.value) == (
        "rollout.async_mode: step 0: 9 groups generated for it, too few without an aborted sample"
    )


def test_a_group_aborted_max_attempts_times_stops_the_run():
    """fully, K = 0: group 0 aborts at every attempt. Each step generates it again with that step's weights (its
    attempt number the step's), records it requeued and trains the next group instead; its eighth abort (attempt
    7, step 7) is the last: step 8 stops the run, naming the group, its prompt and the count."""
    from rlbench.errors import BadInput

    pipe = _pipeline("fully", 0, 1, 1, 9, lambda gid, attempt: gid == 0)
    for step in range(8):
        groups, log = pipe.take(step)
        assert [(g.gid, g.attempt, g.version) for g in groups] == [(step + 1, 0, step)]
        assert log == [_requeued(0, 0, step, step, step=step)]
        pipe.start(step)
        pipe.wait()
    with pytest.raises(BadInput) as refused:
        pipe.take(8)
    assert refused.value.field == "rollout.async_mode"
    assert str(refused.value) == "rollout.async_mode: group 0 (step 0's prompt 0) was aborted 8 times"


def test_one_step_keeps_an_aborted_groups_place_untrained_and_refuses_a_step_with_none_to_train():
    """one-step (as on-policy): a group with an aborted sample keeps its place in its step, untrained, recorded as
    "aborted: not trained" with the step; a step whose every group aborted has nothing to train and stops the run,
    naming the plugin's setting."""
    from rlbench.errors import BadInput

    pipe = _pipeline("one-step", None, 1, 2, 2, lambda gid, attempt: gid in (1, 2))
    assert _drive(pipe, 2) == [
        ([(0, 0, 0)], [_requeued(1, 0, 0, 0, step=0, reason="aborted: not trained")]),
        ([(3, 0, 0)], [_requeued(2, 1, 0, 0, step=1, reason="aborted: not trained")]),
    ]
    pipe = _pipeline("one-step", None, 1, 1, 1, lambda gid, attempt: True)
    with pytest.raises(BadInput) as refused:
        _drive(pipe, 1)
    assert refused.value.field == "rollout.custom_generate_function_path"
    assert str(refused.value) == (
        "rollout.custom_generate_function_path: step 0: every group held an aborted sample (1 groups): nothing to train"
    )


def test_one_step_generates_in_each_window_only_the_next_steps_groups():
    """With update interval 2 the bound (I = 2) would let a window reach two steps ahead; one-step (slime's
    train_async.py) generates in window r exactly step r + 1's groups, while fully with K = 2 generates all K
    allows (steps 1 and 2 in window 0, nothing in window 1, whose engine still holds version 0)."""
    one = _pipeline("one-step", None, 2, 2, 5, lambda gid, attempt: False)
    _drive(one, 5)
    assert one.ctx.plugin_rollout.calls == [[(2 * k, 0), (2 * k + 1, 0)] for k in range(5)]
    fully = _pipeline("fully", 2, 2, 2, 5, lambda gid, attempt: False)
    _drive(fully, 5)
    assert fully.ctx.plugin_rollout.calls == [[(g, 0) for g in gids] for gids in ([0, 1], range(2, 6), range(6, 10))]


def test_the_window_thread_is_a_daemon_joined_by_close():
    """The window generates on a daemon thread, so a run interrupted while its engine hangs (a second Ctrl-C in
    close's join) can still exit; close() joins it and forgets it, and closing again is a no-op."""
    import threading

    release = threading.Event()

    def aborts(gid, attempt):  # the window's generation hangs until released
        if threading.current_thread() is not threading.main_thread():
            release.wait(timeout=60)
        return False

    pipe = _pipeline("fully", 1, 1, 1, 3, aborts)
    pipe.take(0)
    pipe.start(0)
    assert pipe.thread.daemon and pipe.thread.is_alive()
    release.set()
    pipe.close()
    assert pipe.thread is None
    pipe.close()
    assert pipe.thread is None


def test_an_error_generating_ahead_is_raised_where_the_step_waits_once():
    """An error on the window's thread is kept and raised, itself, by the wait that joins it (the step's sync),
    which stops the run before the step commits; raised once: the pipeline holds no failure after it."""

    class EngineGone(RuntimeError):
        pass

    gone = EngineGone("engine gone")

    def aborts(gid, attempt):
        if gid == 1:
            raise gone
        return False

    pipe = _pipeline("fully", 1, 1, 1, 3, aborts)
    pipe.take(0)
    pipe.start(0)
    with pytest.raises(EngineGone) as raised:
        pipe.wait()
    assert raised.value is gone
    assert pipe.failure is None and pipe.thread is None and pipe.ready == []
    pipe.wait()


def test_generation_refuses_an_engine_holding_other_weights_than_the_schedule_names():
    """Each generation is held to the engine's own word: the schedule's version for the window, or the run stops
    (a missed or early sync would otherwise generate with other weights than the recording names)."""
    from types import SimpleNamespace as Stub

    engine = Stub(weight_version=0)
    pipe = _pipeline("fully", 1, 1, 1, 3, lambda gid, attempt: False, engine=engine)
    pipe.take(0)
    pipe.start(0)
    pipe.wait()
    engine.weight_version = 1  # the sync after step 0
    pipe.take(1)
    pipe.start(1)  # generates step 2's group with version 1
    pipe.wait()
    pipe = _pipeline("fully", 1, 1, 1, 3, lambda gid, attempt: False, engine=Stub(weight_version=1))
    with pytest.raises(RuntimeError) as refused:
        pipe.take(0)
    assert str(refused.value) == "the engine holds weights version 1, the schedule says 0"


def test_a_steps_samples_are_numbered_by_their_place_in_it():
    """samples(): the groups' samples in the order given, each with group_index its group's place in the step and
    index its own, whatever the generator numbered them; a slime plugin's extra["group"] renumbered likewise (a
    sample without one gets none); extra["async"] names the group, the step that drew it, the attempt, the weights
    version and the lag; the generator's samples are left as they were."""
    from types import SimpleNamespace as Stub

    from rlbench.core.pipeline import Group, Pipeline
    from rlbench.core.types import Prompt, Sample

    prompt = Prompt(0, ({"role": "user", "content": "2 + 2"},), "4")

    def sample(tag: int, extra: dict) -> Sample:
        return Sample(9, 9, prompt, (1,), (tag,), "", (0.0,), (1,), "stop", tag, "e", 0, None, extra)

    plugin = [sample(10, {"group": 9, "turns": 1}), sample(11, {"group": 9, "turns": 2})]
    engine = [sample(12, {})]
    groups = [Group(5, 2, 1, prompt, attempt=2, version=3, samples=plugin), Group(3, 1, 1, prompt, version=2)]
    groups[1].samples = engine
    rollout = Stub(async_mode="fully", max_staleness=2, update_weights_interval=1)
    pipe = Pipeline(Stub(config=Stub(rollout=rollout, data=Stub(prompts_per_step=2))), 9)
    out = pipe.samples(groups, 4)
    assert [(s.response_ids, s.group_index, s.index) for s in out] == [((10,), 0, 0), ((11,), 0, 1), ((12,), 1, 2)]
    first = {"group_id": 5, "origin_step": 2, "attempt": 2, "weight_version": 3, "lag": 1}
    second = {"group_id": 3, "origin_step": 1, "attempt": 0, "weight_version": 2, "lag": 2}
    assert [s.extra for s in out] == [
        {"group": 0, "turns": 1, "async": first},
        {"group": 0, "turns": 2, "async": first},
        {"async": second},
    ]
    assert [s.extra for s in plugin + engine] == [{"group": 9, "turns": 1}, {"group": 9, "turns": 2}, {}]


def test_a_staleness_bound_of_zero_is_the_on_policy_run_and_one_is_one_step(tmp_path, run5):
    on_policy = run5("sync")
    assert _sums(run5("k0", rollout__async_mode="fully", rollout__max_staleness=0)) == _sums(on_policy)
    one = run5("one", rollout__async_mode="one-step")
    assert _sums(one) != _sums(on_policy)
    assert _sums(run5("k1", rollout__async_mode="fully", rollout__max_staleness=1)) == _sums(one)


def test_between_syncs_the_engine_keeps_its_weights_and_is_held_to_them(tmp_path, run5):
    """--update-weights-interval 2: steps 0 and 2 do not sync; their engine_weights checksum is the last sync's,
    read back from the engine; steps 1 and 3 sync."""
    run_dir = run5("i2", rollout__async_mode="one-step", rollout__update_weights_interval=2)
    rows = [json.loads(line) for line in _sums(run_dir).decode().splitlines()]
    assert rows[0]["engine_weights"] != rows[1]["engine_weights"] == rows[2]["engine_weights"]
    assert rows[1]["engine_weights"] == rows[1]["weights"] and rows[2]["engine_weights"] != rows[2]["weights"]


def test_replay_and_resume_reproduce_an_async_run(tmp_path, run5):
    one = run5("one", rollout__async_mode="one-step")
    done = cli("replay", str(one), "--out", str(tmp_path / "one-replayed"))
    assert done.returncode == 0 and "reproduced" in done.stdout.lower(), done.stdout + done.stderr
    run_dir = run5("a", rollout__async_mode="fully", rollout__max_staleness=2)
    done = cli("replay", str(run_dir), "--out", str(tmp_path / "replayed"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reproduced" in done.stdout.lower()
    # resume: a copy cut back to two committed steps goes on from its start and ends as the whole run did
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    for log in ("metrics.jsonl", "checksums.jsonl"):
        lines = (cut / log).read_text().splitlines(keepends=True)
        (cut / log).write_text("".join(lines[:2]))
    done = cli("run", "--resume", str(cut))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _sums(cut) == _sums(run_dir)


def test_async_settings_that_cannot_hold_are_refused(tmp_path):
    for args, message in (
        (["--async", "fully"], "rollout.max_staleness: expected a bound for --async fully"),
        (["--async", "one-step", "--max-staleness", "1"], "unset unless --async fully"),
        (["--update-weights-interval", "2"], "1 without --async"),
        (["--async", "fully", "--max-staleness", "0", "--update-weights-interval", "3"], "at least update_weights"),
        (["--async", "one-step", "--mode", "rollout-only"], "off in a rollout-only or train-only run"),
    ):
        done = cli("run", "--steps", "1", "--out", str(tmp_path / "x"), *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1


def test_check_logprobs_gives_the_mismatch_per_lag(tmp_path, run5):
    """Every judged sample counted under its recorded lag, each row's statistics those of its samples alone
    (recomputed here from the recording); an on-policy run has no per-lag rows."""
    import torch

    from rlbench.checks.logprobs import check_logprobs, statistics

    fully = run5("fully", rollout__async_mode="fully", rollout__max_staleness=2)
    report = check_logprobs(fully)
    by_lag: dict[int, tuple[list, list]] = {}
    for step in range(5):
        tensors, meta = recording.read_step(fully, step)
        offsets, mask = tensors["offsets"], tensors["loss_mask"].bool()
        delta = tensors["old_logprobs"] - tensors["rollout_logprobs"]
        for i, sample in enumerate(meta["samples"]):
            span = slice(int(offsets[i]), int(offsets[i + 1]))
            pieces, counts = by_lag.setdefault(sample["async"]["lag"], ([], []))
            pieces.append(delta[span][mask[span]])
            counts.append(int(mask[span].sum()))
    assert [row["lag"] for row in report.per_lag] == [0, 1, 2] == sorted(by_lag)
    for row in report.per_lag:
        pieces, counts = by_lag[row["lag"]]
        assert row["tokens"] == sum(counts) and row["samples"] == sum(c > 0 for c in counts)
        expected = statistics(torch.cat(pieces), counts)
        assert row["train_rollout_logprob_abs_diff"] == pytest.approx(expected["train_rollout_logprob_abs_diff"])
    assert sum(row["tokens"] for row in report.per_lag) == report.tokens
    shown = cli("check", "logprobs", str(fully))
    assert shown.returncode == 0 and "by policy lag" in shown.stdout
    assert check_logprobs(run5("sync")).per_lag == []


def test_diff_names_the_weights_version_before_the_rollout_it_changed(tmp_path, run5):
    """On-policy against one-step: the same prompts at step 1, sampled by version 1 in A and 0 in B; diff names
    that (stage weight_version) in place of the rollout's stages, before any stage it could change is compared. Two
    one-step runs: no difference, versions counted."""
    sync, one = run5("sync"), run5("one", rollout__async_mode="one-step")
    done = cli("diff", str(sync), str(one), "--json")
    found = json.loads(done.stdout)
    first = found["first"]
    assert done.returncode == 1 and (first["step"], first["stage"]) == (1, "weight_version")
    # named in place of the rollout's stages, not after comparing them: step 0's every stage, then step 1's data
    stages = len(found["stages_compared"])
    assert found["comparisons"] == stages + 1 and found["stages_compared"][:2] == ["data", "rollout_tokens"]
    assert first["where"].startswith("sample 0: generated by weights version 1 in A, 0 in B, lag 0 in A, 1 in B")
    again = run5("again", rollout__async_mode="one-step")
    same = cli("diff", str(one), str(again))
    assert same.returncode == 0 and "the weights versions of 40 samples compared" in same.stdout
    # equal versions stop nothing: every stage of every step compared
    counted = json.loads(cli("diff", str(one), str(again), "--json").stdout)
    assert counted["comparisons"] == 5 * len(counted["stages_compared"]) and counted["versions_compared"] == 40


@pytest.mark.slow
def test_the_report_of_an_async_run_shows_the_mismatch_per_lag(tmp_path, run5):
    from tests.cpu.test_report import open_in_browser

    fully = run5("fully", rollout__async_mode="fully", rollout__max_staleness=2)
    page = tmp_path / "page.html"
    assert cli("report", str(fully), "--out", str(page)).returncode == 0
    dom, console = open_in_browser(page, tmp_path / "page.png")
    assert console == [] and "By policy lag" in dom


@pytest.mark.slow
def test_an_async_run_over_http_is_the_embedded_async_run(tmp_path):
    """The window ahead generating through SGLang's HTTP API (`rlbench serve` behind sglang-router, from the
    pipeline's thread) writes what the embedded engine does."""
    config = tmp_path / "small.toml"
    config.write_text(small_toml(3))
    outs = []
    for name, more in (("embedded", []), ("http", ["--rollout", "sglang", "--sglang-server", "rlbench"])):
        outs.append(tmp_path / name)
        done = cli("run", "-c", str(config), "--async", "one-step", "--out", str(outs[-1]), *more)
        assert done.returncode == 0, done.stderr
    assert _sums(outs[0]) == _sums(outs[1])


def test_diff_names_another_weights_version_where_the_runs_share_no_rollout_stage(tmp_path, run5):
    """A pair whose manifests name no rollout stage (no mode of rlbench's writes one; a hand-made or trimmed
    manifest does): the weights version is still compared, and named once no stage it shares differs."""
    for name, overrides in (("sync", {}), ("one", {"rollout__async_mode": "one-step"})):
        run = run5(name, **overrides)
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["stages"] = [stage for stage in manifest["stages"] if stage != "rollout"]
        (run / "manifest.json").write_text(json.dumps(manifest))
    done = cli("diff", str(tmp_path / "sync"), str(tmp_path / "one"), "--json")
    found = json.loads(done.stdout)
    assert "rollout_tokens" not in found["stages_compared"], found["stages_compared"]
    assert done.returncode == 1 and (found["first"]["step"], found["first"]["stage"]) == (1, "weight_version")
