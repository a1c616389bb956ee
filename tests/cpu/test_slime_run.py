"""slime plugins under `rlbench run` (rlbench/slime_rollout.py): slime-shaped generate and reward functions of
rlbench's own writing (tests/slime_plugins/examples.py) on a real slime Sample (Miles'), against the run's engine
behind /generate; deterministic whatever the concurrency and the order answers come back in; held to the engine's
request log by `check tito`; replayed without the plugin; resumed after a kill mid-step."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlbench.rundir import recording
from tests.conftest import MILES, RANDOM_INIT_MODEL, REPO, cli

PLUGINS = "tests.slime_plugins.examples"
# Seeded random weights (not the default's warm start, which answers in 3 tokens and then stops): every turn
# samples its 6 tokens, bytes that re-tokenise otherwise among them, which the plugins' tests count on.
TOML = (
    "steps = {steps}\ncheckpoint_every = 1\n[data]\nprompts_per_step = 2\n[rollout]\nn_samples_per_prompt = 4\n"
    "max_new_tokens = 6\nsglang_server_concurrency = {concurrency}\n[train]\nminibatches = 2\nmicro_batch_size = 4\n"
    f"[model]\npath = '{RANDOM_INIT_MODEL}'\ninit = 'random'\n"
)


def _config(tmp_path: Path, steps: int = 2, concurrency: int = 512) -> Path:
    path = tmp_path / f"slime-{steps}-{concurrency}.toml"
    path.write_text(TOML.format(steps=steps, concurrency=concurrency))
    return path


def _run(tmp_path, name, generate, *more, steps=2, concurrency=512, rm="reward"):
    out = tmp_path / name
    args = ["run", "-c", str(_config(tmp_path, steps, concurrency)), "--out", str(out)]
    args += ["--custom-generate-function-path", f"{PLUGINS}.{generate}"]
    if rm:
        args += ["--custom-rm-path", f"{PLUGINS}.{rm}"]
    done = cli(*args, *more)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _checksums(run: Path) -> bytes:
    return (run / "checksums.jsonl").read_bytes()


def _process(*args: str, env_path: str, cwd: Path = REPO, extra_env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": env_path, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlbench.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_token_appending_plugin_passes_tito_and_two_runs_write_the_same_bytes(tmp_path, miles):
    first = _run(tmp_path, "a", "append_tokens")
    second = _run(tmp_path, "b", "append_tokens")
    assert _checksums(first) == _checksums(second)
    shown = cli(
        "run",
        "-c",
        str(_config(tmp_path, steps=1)),
        "--out",
        str(tmp_path / "c"),
        "--custom-generate-function-path",
        f"{PLUGINS}.append_tokens",
    )
    assert "slime's contract, miles.utils.types.Sample: tests.slime_plugins.examples.append_tokens" in shown.stdout
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["plugins"]["contract"] == "slime"
    assert manifest["plugins"]["sample_class"] == "miles.utils.types.Sample"
    _, meta = recording.read_step(first, 1)
    sample = meta["samples"][0]
    assert [len(t["output_ids"]) for t in sample["turns"]] == [6, 6]  # two sampled turns, the tool span between
    assert sample["plugin"]["generate"] == f"{PLUGINS}.append_tokens" and sample["reward_from"] == "plugin"
    tensors, _ = recording.read_step(first, 1)
    assert 0 in tensors["loss_mask"].tolist()  # tool output: loss mask 0, not judged
    done = cli("check", "tito", str(first))
    assert done.returncode == 0, done.stdout
    assert "no drift" in done.stdout and "all 16 samples" in done.stdout


def test_text_resending_plugin_is_flagged_by_sample_turn_and_position(tmp_path, miles):
    run = _run(tmp_path, "resend", "resend_text")
    done = cli("check", "tito", str(run), "--json")
    assert done.returncode == 1, done.stdout
    report = json.loads(done.stdout)
    findings = report["findings"]
    assert findings and all(f["where"] == "turn 0 vs turn 1's prompt" for f in findings)
    flagged = {(f["step"], f["sample"]) for f in findings}
    # Independently of the check: a sample is flagged exactly where the engine's second input (the re-sent text,
    # tokenised by the server) is not the sample's own ids before its second turn.
    expected = {}
    for step in (0, 1):
        tensors, meta = recording.read_step(run, step)
        offsets, tokens = tensors["offsets"].tolist(), tensors["tokens"].tolist()
        for i, sample in enumerate(meta["samples"]):
            second, own = sample["turns"][1]["prompt_ids"], tokens[offsets[i] : offsets[i + 1]]
            if own[: len(second)] != second:
                expected[(step, i)] = next(k for k, (a, b) in enumerate(zip(own, second)) if a != b)
    assert flagged == set(expected) and len(flagged) > 0
    for f in findings:  # the position where the ids part, in the sample's tokens
        assert f["finding"]["index"] == expected[(f["step"], f["sample"])]
    page = cli("report", str(run), "--out", str(tmp_path / "report.html"))
    assert page.returncode == 0, page.stderr
    assert "turn 0 vs turn 1" in (tmp_path / "report.html").read_text()


def test_concurrency_and_random_answer_delays_change_no_bit(tmp_path, miles, monkeypatch):
    """Concurrency 1 against 64 with every answer held back a random while, so that answers come back and
    second turns reach the engine in another order and other batches: the same bytes."""
    serial = _run(tmp_path, "serial", "append_tokens", concurrency=1)
    from rlbench.serve import app

    answer = app.Handlers.generate
    rng = random.Random(7)
    delays = []

    async def delayed(self, request):
        response = await answer(self, request)
        delays.append(rng.uniform(0, 0.03))
        await asyncio.sleep(delays[-1])
        return response

    monkeypatch.setattr(app.Handlers, "generate", delayed)
    shuffled = _run(tmp_path, "shuffled", "append_tokens", concurrency=64)
    assert len(delays) == 2 * 2 * 4 * 2  # steps x prompts x samples x turns: every answer was delayed
    assert _checksums(serial) == _checksums(shuffled)


def test_fan_out_trains_in_one_step_and_replays_without_the_plugin(tmp_path, miles):
    run = _run(tmp_path, "fan", "multi_agent")
    tensors, meta = recording.read_step(run, 0)
    samples = meta["samples"]
    assert len(samples) == 2 * 4 * 2  # prompts x samples x agents, in one step
    pairs = [(s["rollout"], s["plugin"]["fan_out"]) for s in samples]
    assert pairs[:4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s["group"] for s in samples] == [0] * 8 + [1] * 8
    # replay: neither the plugin's package nor Miles on the path, and not run from the checkout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _process("replay", str(run), "--json", env_path=str(REPO / "rlbench" / ".."), cwd=elsewhere)
    assert done.returncode == 0, done.stderr[-2000:]
    replayed = json.loads(done.stdout)
    assert replayed["ok"] is True and replayed["reproduced"] == 2 and replayed["first_difference"] is None
    assert replayed["checksums_compared"] == 2 * 9  # every stage of both steps (sync: no engine in a replay)


def test_resume_after_a_kill_mid_rollout_continues_to_the_same_bytes(tmp_path, miles):
    path = os.pathsep.join([str(REPO), str(MILES)])
    clean = tmp_path / "clean"
    args = ["run", "-c", str(_config(tmp_path, steps=3)), "--custom-generate-function-path", f"{PLUGINS}.append_tokens"]
    done = _process(*args, "--out", str(clean), env_path=path)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = tmp_path / "killed"
    # 16 requests a step (8 samples, 2 turns): the 20th is step 1's fourth
    done = _process(*args, "--out", str(killed), env_path=path, extra_env={"RLBENCH_FAILPOINT": "serve.generate@20"})
    assert done.returncode == -9, done.stderr[-2000:]
    # step 0 computed; committed or still in the run writer's hands when the kill came (it writes off the loop)
    assert len((killed / "checksums.jsonl").read_text().splitlines()) in (0, 1)
    done = _process("run", "--resume", str(killed), env_path=path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _checksums(killed) == _checksums(clean)


@pytest.mark.parametrize(
    ("generate", "says"),
    [
        (
            "tests.slime_plugins.contract_cases.wrong_names",
            "slime's contract starts them (args, sample, sampling_params)",
        ),
        (f"{PLUGINS}.returns_text", "returned str, expected a Sample or a list of Samples"),
        (f"{PLUGINS}.no_logprobs", "trainable response tokens require rollout log probabilities."),
        (f"{PLUGINS}.raises", "raised ValueError: the tool server is down"),
    ],
)
def test_a_plugin_breaking_slimes_contract_exits_2_with_one_line(tmp_path, miles, generate, says):
    done = cli(
        "run",
        "-c",
        str(_config(tmp_path, steps=1)),
        "--out",
        str(tmp_path / "bad"),
        "--custom-generate-function-path",
        generate,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and generate in lines[0], lines
    assert not (tmp_path / "bad").exists()


def test_group_reward_reward_set_by_the_plugin_and_aborted_groups(tmp_path, miles):
    grouped = _run(tmp_path, "grouped", "single_turn", "--group-rm", rm="group_reward")
    tensors, meta = recording.read_step(grouped, 0)
    rewards = tensors["rewards"].tolist()
    assert all(r in (0.5, 1.5) for r in rewards[0::4]) and all(r in (0.0, 1.0) for r in rewards[1:4])
    own = _run(tmp_path, "own", "sets_reward", rm=None)
    tensors, meta = recording.read_step(own, 0)
    assert {s["reward_from"] for s in meta["samples"]} == {"plugin"}
    assert set(tensors["rewards"].tolist()) <= {0.0, 0.5, 1.0}
    aborted = _run(tmp_path, "aborted", "aborts_some")
    _, meta = recording.read_step(aborted, 0)
    dropped = meta.get("extra", {}).get("dropped_groups") or meta.get("dropped_groups")
    assert dropped == [{"group": 0, "prompt_index": dropped[0]["prompt_index"], "aborted": [[3, 0]]}]
    assert len(meta["samples"]) == 4 and {s["group"] for s in meta["samples"]} == {1}


def test_a_slime_reward_without_a_slime_generate_function_is_refused(tmp_path, miles):
    done = cli("run", "-c", str(_config(tmp_path, steps=1)), "--custom-rm-path", f"{PLUGINS}.reward")
    assert done.returncode == 2
    assert "is a slime reward function" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_same_plugin_runs_against_an_sglang_fleet_unchanged(tmp_path, miles):
    """`--rollout sglang`: two `rlbench serve` processes behind sglang-router, the plugin posting to the router.
    No request log there: the samples carry no turns, and the rollout is the embedded run's, bit for bit."""
    embedded = _run(tmp_path, "embedded", "append_tokens")
    fleet = _run(
        tmp_path,
        "fleet",
        "append_tokens",
        "--rollout",
        "sglang",
        "--sglang-server",
        "rlbench",
        "--rollout-num-engines",
        "2",
    )
    assert _checksums(fleet) == _checksums(embedded)
    _, meta = recording.read_step(fleet, 0)
    assert all("turns" not in s for s in meta["samples"]) and meta["samples"][0]["engine_id"] == "sglang"
    done = cli("check", "tito", str(fleet))  # judged by evidence: never "no drift" without the engine's ids
    assert "the recording holds no engine ids" in done.stdout and "no drift" not in done.stdout, done.stdout
    assert "cannot be told sampled from re-tokenised" in done.stdout


def test_fully_async_requeues_a_group_a_plugin_aborted_and_generates_it_again_on_newer_weights(tmp_path, miles):
    """slime's fully-async worker pushes an aborted group back to the data buffer; rlbench regenerates it once the
    weights have moved on. The plugin aborts odd groups generated by version 0. With 2 prompts a step and K = 2:
    step 0 generates groups 0, 1 (1 aborts), then 2; window 0 generates 3-6 for steps 1-2 (3 and 5 abort); step 1
    trains 4, 6 (lag 1); window 1 (version 1) regenerates 1 and 3 (attempt 1), which step 2 trains; 5 waits."""
    out = _run(tmp_path, "requeue", "aborts_on_first_weights", "--async", "fully", "--max-staleness", "2", steps=3)
    trained = []
    for step in range(3):
        _, meta = recording.read_step(out, step)
        groups = sorted(
            {(s["async"]["group_id"], s["async"]["attempt"], s["async"]["weight_version"]) for s in meta["samples"]}
        )
        trained.append(groups)
        assert all(s["status"] != "aborted" for s in meta["samples"]), {s["status"] for s in meta["samples"]}
        requeued = [(r["group_id"], r["attempt"], r["weight_version"], r["reason"]) for r in meta["async"]["requeued"]]
        assert requeued == [[(1, 0, 0, "aborted")], [(3, 0, 0, "aborted"), (5, 0, 0, "aborted")], []][step]
    assert trained == [[(0, 0, 0), (2, 0, 0)], [(4, 0, 0), (6, 0, 0)], [(1, 1, 1), (3, 1, 1)]]
    again = _run(tmp_path, "again", "aborts_on_first_weights", "--async", "fully", "--max-staleness", "2", steps=3)
    assert _checksums(again) == _checksums(out)
