"""`rlbench report`: the page of the default run and of a diverging pair, opened in a real headless
browser (Debian's Chromium; .ci/run installs it where it is missing and sets RLBENCH_REQUIRE_BROWSER, so
CI fails rather than skips without it; elsewhere the browser tests skip, saying how to run them): no script error
or console
message, every section present, a screenshot written for a human to look at. The divergence shown is
the one `rlbench diff` names. Bad input: exit 2, one line, no file left."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rlbench.replay.diff import diff
from tests.conftest import cli, small_toml

pytestmark = pytest.mark.slow
SECTIONS = ("verdicts", "metrics", "timings", "mismatch", "tito", "manifest")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def open_in_browser(page: Path, screenshot: Path) -> tuple[str, list[str]]:
    """(the DOM after the page's script ran, every console message) from headless Chromium; a screenshot
    of the page is written to `screenshot`."""
    if not CHROMIUM:
        assert not os.environ.get("RLBENCH_REQUIRE_BROWSER"), "RLBENCH_REQUIRE_BROWSER is set and chromium is missing"
        pytest.skip(
            "needs Debian's chromium (apt-get install chromium); .ci/run installs it and sets "
            "RLBENCH_REQUIRE_BROWSER=1, so CI never skips this"
        )
    profile = screenshot.parent / f".chromium-{screenshot.stem}"
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--hide-scrollbars",
    ]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    shot = subprocess.run(
        flags + ["--window-size=1280,3000", f"--screenshot={screenshot}", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    console = [line for out in (dom.stderr, shot.stderr) for line in out.splitlines() if ":CONSOLE" in line]
    assert dom.returncode == 0 and shot.returncode == 0, dom.stderr[-2000:] + shot.stderr[-2000:]
    return dom.stdout, console


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A, B with an entropy bonus (they part at step 0, in the loss, after the rollouts agree), and C with
    A's seed and config (the same bits)."""
    root = tmp_path_factory.mktemp("report")
    base = root / "base.toml"
    base.write_text(small_toml(3))
    other = root / "other.toml"
    other.write_text(small_toml(3) + "[algo]\nentropy_coef = 0.01\n")
    for name, config in (("a", base), ("b", other), ("c", base)):
        res = cli("run", "-c", str(config), "--out", str(root / name), "--json")
        assert res.returncode == 0, res.stderr
    return root


def test_the_page_of_one_run_opens_without_a_console_message(runs):
    out = runs / "one.html"
    res = cli("report", str(runs / "a"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    dom, console = open_in_browser(out, runs / "one.png")
    assert console == []
    for section in SECTIONS:
        assert f'<section id="{section}">' in dom, section
    assert 'id="divergence"' not in dom
    assert (runs / "one.png").stat().st_size > 10_000
    assert "no drift" in dom and "measured" in dom  # check tito and check logprobs, with what they compared


def test_the_page_of_two_runs_shows_where_diff_says_they_part(runs):
    out = runs / "two.html"
    res = cli("report", str(runs / "a"), str(runs / "b"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    first = diff(runs / "a", runs / "b").first
    assert first is not None and first.stage not in ("data", "rollout_tokens")
    dom, console = open_in_browser(out, runs / "two.png")
    assert console == []
    assert '<section id="divergence">' in dom
    assert f"First divergence at <b>step {first.step}</b>, stage <b>{first.stage}</b>" in dom


def test_two_equal_runs_say_no_difference_with_the_count(runs):
    out = runs / "same.html"
    assert cli("report", str(runs / "a"), str(runs / "c"), "--out", str(out)).returncode == 0
    text = out.read_text()
    assert "No difference" in text and re.search(r"\d+ \(step, stage\) checksums compared over 3 steps", text)


def test_the_first_differing_sample_is_shown_side_by_side(runs, tmp_path):
    """Two runs whose rollouts differ (another seed): the first differing sample's ids, highlighted."""
    other = tmp_path / "seed.toml"
    other.write_text(small_toml(1))
    assert cli("run", "-c", str(other), "--seed", "9", "--out", str(tmp_path / "s"), "--json").returncode == 0
    out = tmp_path / "r.html"
    assert cli("report", str(runs / "a"), str(tmp_path / "s"), "--out", str(out)).returncode == 0
    text = out.read_text()
    first = diff(runs / "a", tmp_path / "s").first
    assert "sample" in first.where and f"of step {first.step}:" in text
    assert "response token -" not in first.where  # a prompt token is named as one
    assert text.count('class="tok diff"') >= 2  # the same positions, in A and in B


def test_a_golden_file_draws_its_band_and_gives_its_verdict(runs):
    golden = runs / "golden.json"
    assert cli("golden", "update", str(runs / "a"), str(golden), "--reason", "test").returncode == 0
    out = runs / "golden.html"
    res = cli("report", str(runs / "c"), "--golden", str(golden), "--ignore", "perf/*", "--out", str(out))
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert 'class="band"' in text and "check golden (approx)" in text and ">passed<" in text


def test_the_console_check_sees_a_script_error(tmp_path):
    """The browser check itself, the other way: a page whose script fails is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>notDefined();</script></body></html>")
    _, console = open_in_browser(page, tmp_path / "bad.png")
    assert any("Uncaught ReferenceError" in line for line in console)


@pytest.mark.parametrize("case", ["not a run", "corrupt recording", "existing out", "missing out dir"])
def test_bad_input_is_one_line_and_leaves_no_file(runs, tmp_path, case):
    run, out = runs / "a", tmp_path / "r.html"
    if case == "not a run":
        run = tmp_path / "nothing"
        run.mkdir()
    elif case == "corrupt recording":
        run = tmp_path / "copy"
        shutil.copytree(runs / "a", run)
        path = run / "rollouts" / "000001.safetensors"
        path.write_bytes(path.read_bytes()[:-7])
    elif case == "existing out":
        out.write_text("mine")
    else:
        out = tmp_path / "no" / "r.html"
    res = cli("report", str(run), "--out", str(out))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert (out.read_text() == "mine") if case == "existing out" else not out.exists()
    assert not list(out.parent.glob(".report-*")) if out.parent.exists() else True


def test_the_page_holds_no_network_reference(runs):
    text = (runs / "one.html").read_text() if (runs / "one.html").exists() else ""
    if not text:
        assert cli("report", str(runs / "a"), "--out", str(runs / "one.html")).returncode == 0
        text = (runs / "one.html").read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", text)
    json.dumps(text)  # plain text, nothing binary
