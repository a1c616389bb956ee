"""No code from a directory rlbench reads, ever (issue 51): a tokenizer or model directory whose JSON asks for code
of its own is refused by name before transformers is asked, so its "run the custom code? [y/N]" prompt never
comes, whatever standard input holds.

Each trap is a directory that works (the fixture tokenizer or model config, copied) given a Python file whose
import creates a tripwire file, and an `auto_map` naming a class in it (the tokenizer's `tokenizer_class` that
class too: with a transformers class there, transformers would use its own and never ask). Every place a directory
is read (run, import of a `--dump-details` directory, check tito, check logprobs, serve) answers it with exit 2 and
one line naming the file and `auto_map`, with "y" on standard input, and the tripwire stays unfired; the same
directory without the auto_map still works.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlbench.core.model import NO_CODE, load_model_config, load_tokenizer
from rlbench.errors import BadInput
from tests.conftest import REPO, cli, small_toml, word_level_tokenizer

FIXTURES = REPO / "rlbench" / "fixtures"
TOKENIZER = FIXTURES / "tokenizers" / "qwen-tiny"
MODEL = FIXTURES / "models" / "tiny-qwen3"
# What a hostile directory ships: importing it is the code running.
TRIP = """import pathlib
pathlib.Path({fired!r}).write_text("fired")
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
class TripTokenizer(PreTrainedTokenizerFast):
    pass
class TripConfig(Qwen3Config):
    pass
class TripModel(Qwen3ForCausalLM):
    config_class = TripConfig
"""
AUTO_MAP = {
    "tokenizer_config.json": {"AutoTokenizer": [None, "trip.TripTokenizer"]},
    "config.json": {"AutoConfig": "trip.TripConfig", "AutoModelForCausalLM": "trip.TripModel"},
}


def _armed(source: Path, directory: Path, auto_map: bool = True) -> Path:
    """`source` copied to `directory` with trip.py beside its files (its import creates directory/../FIRED) and,
    with `auto_map`, its JSON naming a class in it."""
    shutil.copytree(source, directory)
    (directory / "trip.py").write_text(TRIP.format(fired=str(_fired(directory))))
    for name, entry in AUTO_MAP.items():
        file = directory / name
        if auto_map and file.is_file():
            table = json.loads(file.read_text())
            table["auto_map"] = entry
            if name == "tokenizer_config.json":
                table["tokenizer_class"] = "TripTokenizer"
            file.write_text(json.dumps(table, indent=2))
    return directory


def _fired(directory: Path) -> Path:
    return directory.parent / "FIRED"


@pytest.fixture
def yes(monkeypatch):
    """ "y" on standard input, for any prompt that would read it (input() reads sys.stdin)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))


def _refused(res, file: Path, fired: Path | None = None) -> None:
    """Exit 2, one line naming `file` and auto_map, no traceback, the tripwire (`fired`: the file's) unfired."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert lines[0] == f"rlbench: error: {file}: auto_map: names custom code to import; {NO_CODE}", lines[0]
    assert not (fired or _fired(file.parent)).exists()


def _toml(tmp_path: Path, tokenizer: Path = TOKENIZER, model: Path = MODEL) -> Path:
    toml = small_toml(1) + f'[model]\npath = "{model}"\ninit = "random"\ntokenizer = "{tokenizer}"\n'
    (tmp_path / "run.toml").write_text(toml)
    return tmp_path / "run.toml"


# ---- the loaders themselves ----------------------------------------------------------------------------------


def test_a_tokenizer_that_names_custom_code_is_refused_by_name_and_the_same_without_it_loads(tmp_path, yes):
    """The throwaway word-level tokenizer, saved: with an auto_map (and its class in trip.py), with a class that is
    not transformers' and no auto_map, or with an auto_map in a config.json beside it, refused naming the file and
    the field, "y" on standard input and the tripwire unfired; as saved (trip.py beside it, named by nothing) it
    loads, transformers' own class."""
    saved = tmp_path / "saved"
    word_level_tokenizer().save_pretrained(saved)

    armed = _armed(saved, tmp_path / "a" / "tok")
    with pytest.raises(BadInput, match="auto_map: names custom code to import") as caught:
        load_tokenizer(armed)
    assert caught.value.path == str(armed / "tokenizer_config.json") and caught.value.field == "auto_map"

    unknown = _armed(saved, tmp_path / "b" / "tok", auto_map=False)
    table = json.loads((unknown / "tokenizer_config.json").read_text())
    (unknown / "tokenizer_config.json").write_text(json.dumps({**table, "tokenizer_class": "TripTokenizer"}))
    with pytest.raises(BadInput, match=f"'TripTokenizer' is not a transformers class; {NO_CODE}") as caught:
        load_tokenizer(unknown)
    assert caught.value.field == "tokenizer_class"

    beside = _armed(saved, tmp_path / "c" / "tok", auto_map=False)
    (beside / "config.json").write_text(json.dumps({"model_type": "qwen3", "auto_map": AUTO_MAP["config.json"]}))
    with pytest.raises(BadInput, match="auto_map") as caught:
        load_tokenizer(beside)
    assert caught.value.path == str(beside / "config.json")

    plain = _armed(saved, tmp_path / "d" / "tok", auto_map=False)
    tok = load_tokenizer(plain)
    assert type(tok).__module__.startswith("transformers.") and tok.encode("odd even") == [1, 2]
    assert not any(_fired(d / "tok").exists() for d in (tmp_path / "a", tmp_path / "b", tmp_path / "c", plain.parent))


def test_a_model_config_that_names_custom_code_is_refused_by_name(tmp_path, yes):
    armed = _armed(MODEL, tmp_path / "m" / "model")
    with pytest.raises(BadInput, match="auto_map: names custom code") as caught:
        load_model_config(armed)
    assert caught.value.path == str(armed / "config.json")
    assert load_model_config(_armed(MODEL, tmp_path / "p" / "model", auto_map=False)).model_type == "qwen3"
    assert not _fired(armed).exists()


# ---- every command that reads a directory ---------------------------------------------------------------------


def test_run_refuses_a_tokenizer_or_model_with_custom_code_and_runs_with_the_same_without(tmp_path, yes):
    tokenizer = _armed(TOKENIZER, tmp_path / "t" / "tok")
    res = cli("run", "-c", str(_toml(tmp_path, tokenizer=tokenizer)), "--out", str(tmp_path / "r1"))
    _refused(res, tokenizer / "tokenizer_config.json")
    model = _armed(MODEL, tmp_path / "m" / "model")
    res = cli("run", "-c", str(_toml(tmp_path, model=model)), "--out", str(tmp_path / "r2"))
    _refused(res, model / "config.json")

    plain_tok = _armed(TOKENIZER, tmp_path / "pt" / "tok", auto_map=False)
    plain_model = _armed(MODEL, tmp_path / "pm" / "model", auto_map=False)
    res = cli("run", "-c", str(_toml(tmp_path, plain_tok, plain_model)), "--out", str(tmp_path / "ok"))
    assert res.returncode == 0, res.stderr
    assert not _fired(plain_tok).exists() and not _fired(plain_model).exists()


def _dump_directory(directory: Path, tokenizer: Path) -> Path:
    """A slime `--dump-details` directory: rollout_data/{id}.pt and the run's tokenizer/ (here `tokenizer`)."""
    from tests.cpu.test_import_slime import write_dumps

    (directory / "rollout_data").mkdir(parents=True)
    for path in write_dumps(directory / "rollout_data", rollout_ids=(0,)):
        path.rename(path.with_name(path.name.removeprefix("rollout_")))
    shutil.copytree(tokenizer, directory / "tokenizer")
    return directory


def test_import_of_a_dump_directory_whose_tokenizer_names_custom_code_refuses_it_with_y_on_stdin(tmp_path):
    """The issue's own case, through a process of its own whose standard input holds "y": refused, the tripwire
    unfired; the same directory without the auto_map imports."""
    dumps = _dump_directory(tmp_path / "dumps", _armed(TOKENIZER, tmp_path / "src" / "tok"))
    res = subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "import", "slime", str(dumps), "--out", str(tmp_path / "imp")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
        input="y\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    _refused(res, (dumps / "tokenizer" / "tokenizer_config.json").resolve(), fired=tmp_path / "src" / "FIRED")
    assert not (tmp_path / "imp").exists()

    plain = _dump_directory(tmp_path / "plain", _armed(TOKENIZER, tmp_path / "psrc" / "tok", auto_map=False))
    res = cli("import", "slime", str(plain), "--out", str(tmp_path / "ok"))
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "psrc" / "FIRED").exists()


def test_check_tito_refuses_a_tokenizer_with_custom_code_in_each_lens(tmp_path, yes):
    tokenizer = _armed(TOKENIZER, tmp_path / "t" / "tok")
    said = tokenizer / "tokenizer_config.json"
    _refused(cli("check", "tito", "--audit", "--tokenizer", str(tokenizer)), said)
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({"messages": [], "token_ids": []}) + "\n")
    _refused(cli("check", "tito", str(tmp_path / "trajectories.jsonl"), "--tokenizer", str(tokenizer)), said)

    plain = _armed(TOKENIZER, tmp_path / "p" / "tok", auto_map=False)
    fixture = cli("check", "tito", "--audit", "--tokenizer", str(TOKENIZER))
    res = cli("check", "tito", "--audit", "--tokenizer", str(plain))
    assert res.returncode == fixture.returncode and res.returncode in (0, 1), res.stderr
    assert not _fired(plain).exists()


def test_check_logprobs_never_loads_a_tokenizer_given_custom_code_after_the_run(tmp_path, yes):
    """A run made with a plain tokenizer whose directory then names custom code: check logprobs stops at exit 2
    with one line naming the tokenizer (the run was made with another), the tripwire unfired."""
    tokenizer = _armed(TOKENIZER, tmp_path / "t" / "tok", auto_map=False)
    res = cli("run", "-c", str(_toml(tmp_path, tokenizer=tokenizer)), "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    shutil.rmtree(tokenizer)
    _armed(TOKENIZER, tokenizer)
    res = cli("check", "logprobs", str(tmp_path / "run"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and str(tokenizer) in lines[0], res.stderr
    assert not _fired(tokenizer).exists()


def test_serve_refuses_a_tokenizer_or_model_with_custom_code_and_serves_the_same_without(tmp_path, yes):
    """Refused before anything listens; the plain directories served (on a thread) and stopped."""
    from rlbench.serve.server import ServeConfig, serve_in_thread

    tokenizer = _armed(TOKENIZER, tmp_path / "t" / "tok")
    _refused(cli("serve", "--tokenizer-path", str(tokenizer), "--port", "0"), tokenizer / "tokenizer_config.json")
    model = _armed(MODEL, tmp_path / "m" / "model")
    res = cli("serve", "--model-path", str(model), "--load-format", "dummy", "--port", "0")
    _refused(res, model / "config.json")

    plain_tok = _armed(TOKENIZER, tmp_path / "pt" / "tok", auto_map=False)
    plain_model = _armed(MODEL, tmp_path / "pm" / "model", auto_map=False)
    server = serve_in_thread(
        ServeConfig(model_path=str(plain_model), tokenizer_path=str(plain_tok), load_format="dummy", port=0)
    )
    try:
        assert server.state.tokenizer is not None and server.url.startswith("http://127.0.0.1:")
    finally:
        server.close()
    assert not _fired(plain_tok).exists() and not _fired(plain_model).exists()
