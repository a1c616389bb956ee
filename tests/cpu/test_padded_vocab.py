"""A model whose vocabulary exceeds its tokenizer's (core/vocab.py), as real models' do (Qwen3: 151,936 logits,
151,669 token ids): the engine samples padded ids, the run records them and the manifest both sizes, and every
reader accepts what `rlbench run` wrote (check logprobs, check tito, replay, diff, report), with the torch and
the megatron trainer and through `rlbench serve`. An id the model has no logit for stays bad input."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from rlbench.core.model import load_tokenizer
from rlbench.rundir.recording import read_step
from tests.conftest import REPO, cli, small_toml
from tests.cpu.recordings import copy_run, edit_step

FIXTURES = REPO / "rlbench" / "fixtures"
TOKENIZER = len(load_tokenizer(FIXTURES / "tokenizers" / "qwen-tiny"))
# Seven padded rows per tokenizer id: random weights give near-uniform logits, so about 7 of 8 sampled ids are
# padded, and a run of a few dozen sampled tokens without one would take odds of about 1e-30.
MODEL = 8 * TOKENIZER


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The fixture model with MODEL logits (random weights) and a run of it with the torch trainer."""
    root = tmp_path_factory.mktemp("padded")
    config = json.loads((FIXTURES / "models" / "tiny-qwen3" / "config.json").read_text())
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({**config, "vocab_size": MODEL}))
    (root / "s.toml").write_text(small_toml(2) + f'[model]\npath = "{root / "model"}"\ninit = "random"\n')
    res = cli("run", "-c", str(root / "s.toml"), "--out", str(root / "torch"), "--json")
    assert res.returncode == 0, res.stderr
    return root


def _padded(run: Path) -> int:
    """How many padded ids the run's recording holds."""
    steps = sorted(int(p.stem) for p in (run / "rollouts").glob("*.safetensors"))
    return sum(int(((t >= TOKENIZER) & (t < MODEL)).sum()) for t in (read_step(run, s)[0]["tokens"] for s in steps))


def _accepted(run: Path) -> None:
    """check logprobs and check tito accept the run: exit 0, a padded id shown as such, the padded ids noted."""
    assert _padded(run) > 0
    res = cli("check", "logprobs", str(run), "--top", "1000", "--json")
    assert res.returncode == 0, res.stderr
    worst = json.loads(res.stdout)["worst"]
    assert any(w["text"] == f"<padded id {w['token_id']}>" for w in worst)
    assert all(w["text"] != f"<padded id {w['token_id']}>" for w in worst if w["token_id"] < TOKENIZER)
    res = cli("check", "tito", str(run))
    assert res.returncode == 0, res.stderr
    assert "no drift" in res.stdout
    assert f"padded ids (>= the tokenizer's {TOKENIZER} ids, < the model's {MODEL})" in res.stderr


def test_a_run_records_padded_ids_and_both_vocabulary_sizes(root):
    manifest = json.loads((root / "torch" / "manifest.json").read_text())
    assert manifest["vocab"] == {"model": MODEL, "tokenizer": TOKENIZER}
    _accepted(root / "torch")


def test_replay_diff_and_report_accept_padded_ids(root, tmp_path):
    res = cli("replay", str(root / "torch"))
    assert res.returncode == 0 and "reproduced 2 steps" in res.stdout, res.stdout + res.stderr
    res = cli("diff", str(root / "torch"), str(root / "torch"))
    assert res.returncode == 0 and "no difference" in res.stdout, res.stdout + res.stderr
    res = cli("report", str(root / "torch"), "--out", str(tmp_path / "page.html"))
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "page.html").read_text()
    assert "&lt;padded id " in page and f"&quot;model&quot;: {MODEL}" in page  # the manifest's vocabulary
    # the two runs' first differing sample, id by id (a difference this pair of runs does not have)
    from rlbench.report.collect import _token_texts
    from rlbench.rundir.directory import read_run

    texts = _token_texts(read_run(root / "torch"), [2, TOKENIZER - 1, TOKENIZER, MODEL - 1])
    assert texts[2] == "<|im_end|>" and "padded" not in texts[TOKENIZER - 1]
    assert (texts[TOKENIZER], texts[MODEL - 1]) == (f"<padded id {TOKENIZER}>", f"<padded id {MODEL - 1}>")


def test_the_megatron_trainer_records_and_accepts_padded_ids(root):
    res = cli(
        "run",
        "-c",
        str(root / "s.toml"),
        "--trainer",
        "megatron",
        "--steps",
        "1",
        "--out",
        str(root / "megatron"),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    _accepted(root / "megatron")
    res = cli("replay", str(root / "megatron"))
    assert res.returncode == 0 and "reproduced 1 steps" in res.stdout, res.stdout + res.stderr


def test_rlbench_serve_samples_padded_ids_and_the_client_keeps_them(root):
    """`--rollout sglang` against `rlbench serve` (on a thread of this process: a server process would cost
    seconds of start-up, not a line of other code): the SGLang client keeps the padded ids the server samples,
    the same ids as the embedded engine's."""
    from rlbench.serve.server import ServeConfig, serve_in_thread

    serving = serve_in_thread(
        ServeConfig(model_path=str(root / "model"), load_format="dummy", port=0, weights_dir=tempfile.gettempdir())
    )  # where the run writes its weights
    toml = (root / "s.toml").read_text().replace("[rollout]\n", "[rollout]\nuse_router = false\n")  # one server
    (root / "serve.toml").write_text(toml)
    try:
        res = cli(
            "run",
            "-c",
            str(root / "serve.toml"),
            "--rollout",
            "sglang",
            "--rollout-external-engine-addrs",
            serving.url,
            "--steps",
            "1",
            "--out",
            str(root / "serve"),
            "--json",
        )
    finally:
        serving.close()
    assert res.returncode == 0, res.stderr
    _accepted(root / "serve")
    assert read_step(root / "serve", 0)[0]["tokens"].equal(read_step(root / "torch", 0)[0]["tokens"])


def test_an_id_the_model_has_no_logit_for_is_bad_input(root, tmp_path):
    run = copy_run(root / "torch", tmp_path / "run")

    def outside(tensors, meta):
        tensors["tokens"][-1] = MODEL

    edit_step(run, 0, outside)
    for command in (["check", "logprobs", str(run)], ["check", "tito", str(run)]):
        res = cli(*command)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert res.stderr == (
            f"rlbench: error: {run}/rollouts/000000.safetensors: tokens: token id {MODEL} is outside "
            f"the model's vocabulary ({MODEL} ids; the tokenizer has {TOKENIZER})\n"
        )


def test_a_run_from_before_the_vocab_section_reads_the_models_config(root, tmp_path):
    run = copy_run(root / "torch", tmp_path / "old")
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["vocab"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    res = cli("check", "tito", str(run))
    assert res.returncode == 0 and f"< the model's {MODEL})" in res.stderr, res.stderr
    (run / "manifest.json").write_text(json.dumps({**manifest, "vocab": {"model": 0, "tokenizer": TOKENIZER}}))
    res = cli("check", "tito", str(run))
    assert res.returncode == 2 and res.stderr == (
        f"rlbench: error: {run}/manifest.json: vocab.model: expected an integer in [1, 2**31 - 1], got 0\n"
    ), res.stderr
