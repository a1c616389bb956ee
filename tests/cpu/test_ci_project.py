"""A team's own CI suite on rlbench's pytest plugin, as the team runs it: examples/ci-project (a reward function, a
chat template, a run config and tests written against the plugin's fixtures and rlbench.testing alone), copied out
of the checkout, run by `pytest` in a fresh virtual environment where rlbench is installed from its wheel (not
editable; tests/cpu/test_wheel.py builds it offline). Its suite passes; a planted change fails it with rlbench's
verdict text; a golden update with a reason makes it pass again, the reason kept in the file. Then the plugin's
surface, frozen as the CLI's is."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.cpu.test_wheel import fresh_venv, wheel  # noqa: F401 - the wheel fixture, built once for this module

pytestmark = pytest.mark.slow
pytest_plugins = ["pytester"]
PROJECT = REPO / "examples" / "ci-project"
GOLDEN = Path("tests") / "golden" / "test_the_loop_did_not_move.json"


def _pytest(bin_dir: Path, project: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_teams_suite_passes_fails_on_a_planted_change_and_passes_after_an_update(wheel, tmp_path):  # noqa: F811
    bin_dir, _, env = fresh_venv(wheel, tmp_path)
    project = tmp_path / "ci-project"
    shutil.copytree(PROJECT, project)
    first = _pytest(bin_dir, project, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    assert "3 passed" in first.stdout

    rewards = project / "parity_ci" / "rewards.py"  # answers that say odd scored otherwise
    line = "    return parity(sample) - 0.01 * extra"
    planted = "    if sample.response.strip().endswith('odd'):\n        return 0.5\n" + line
    rewards.write_text(rewards.read_text().replace(line, planted))
    moved = _pytest(bin_dir, project, env, "-k", "loop_did_not_move")
    assert moved.returncode == 1, moved.stdout[-3000:]
    assert "$ rlbench check golden " in moved.stdout and "golden check, exact tier:" in moved.stdout
    assert "rollout/raw_reward" in moved.stdout, moved.stdout[-3000:]
    assert "9 of 12 metrics regressed (36 values compared, steps 0..2)" in moved.stdout  # docs/ci.md says so

    reason = "reward: an answer that says odd scores 0.5"
    updated = _pytest(bin_dir, project, env, "--rlbench-update-golden", "--rlbench-reason", reason, "-k", "loop_did")
    assert updated.returncode == 0, updated.stdout[-3000:]
    history = json.loads((project / GOLDEN).read_text())["header"]["history"]
    assert history[-1]["reason"] == reason and len(history) == 2

    again = _pytest(bin_dir, project, env, "-k", "loop_did_not_move")
    assert again.returncode == 0, again.stdout[-3000:]

    config = project / "parity_ci" / "tokenizer" / "tokenizer_config.json"  # history re-rendered without separators
    settings = json.loads(config.read_text())
    settings["chat_template"] = settings["chat_template"].replace(
        "{%- if not loop.first or tools %}{{- '\\n' }}{%- endif %}", ""
    )
    config.write_text(json.dumps(settings))
    template = _pytest(bin_dir, project, env, "-k", "loop_did_not_move or chat_template")
    assert template.returncode == 1 and "2 failed" in template.stdout, template.stdout[-3000:]
    # the curve's file is one configuration's, the tokenizer's contents part of it; the audit names the drift
    assert "header.config: the run's configuration is not the golden's: model.tokenizer" in template.stdout
    assert "$ rlbench check tito --audit --tokenizer" in template.stdout
    assert "token-in-token-out drift" in template.stdout


def test_a_missing_golden_file_fails_and_says_how_to_write_it_and_an_update_needs_a_reason(pytester):
    pytester.makepyfile(
        """
        def test_curve(golden, tmp_path):
            golden.check(tmp_path)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*golden/test_curve.json: no golden file; write it with pytest --rlbench-update-golden*"]
    )
    assert not (pytester.path / "golden").exists()
    refused = pytester.runpytest("-p", "no:cacheprovider", "--rlbench-update-golden")  # an update needs its reason
    assert refused.ret == 4 and "--rlbench-update-golden needs --rlbench-reason" in refused.stderr.str()
    assert not (pytester.path / "golden").exists()


def test_the_plugins_public_surface_is_what_the_docs_name(pytester):
    """Fixtures, flags and helpers: changed only on purpose (docs/usage.md, "Your CI")."""
    import rlbench.testing
    from rlbench import pytest_plugin

    fixtures = {
        name for name, value in vars(pytest_plugin).items() if type(value).__name__ == "FixtureFunctionDefinition"
    }
    assert fixtures == {"rlbench_run", "golden"}
    assert sorted(rlbench.testing.__all__) == [
        "Outcome",
        "VerdictFailed",
        "assert_logprobs_agree",
        "assert_no_tito_drift",
        "assert_replay_reproduces",
        "assert_same_run",
        "assert_template_clean",
        "check_golden",
        "rlbench",
        "run",
        "update_golden",
    ]
    help_text = pytester.runpytest("--help").stdout.str()
    assert "--rlbench-update-golden" in help_text and "--rlbench-reason=TEXT" in help_text


def test_a_run_config_and_the_same_options_give_the_same_run_and_a_failed_verdict_reads_as_the_cli(tmp_path):
    """rlbench.testing.run: a RunConfig through the library and the same settings as `rlbench run` options are one
    run (diff: the same at every step); a verdict that does not hold raises VerdictFailed with the command's text."""
    from rlbench.config import RunConfig
    from rlbench.testing import VerdictFailed, assert_same_run, run

    a = run(RunConfig(steps=2, record=False), out=tmp_path / "a")
    b = run(out=tmp_path / "b", steps=2, record=False)
    assert assert_same_run(a, b).code == 0
    c = run(out=tmp_path / "c", steps=2, record=False, seed=1)
    with pytest.raises(VerdictFailed) as failed:
        assert_same_run(a, c)
    assert failed.value.outcome.code == 1
    assert str(failed.value).startswith(f"$ rlbench diff {a} {c}  (exit 1)\n")
    assert "first difference" in str(failed.value)
