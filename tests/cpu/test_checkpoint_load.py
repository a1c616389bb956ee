"""Real checkpoints, loaded as transformers loads them or refused: a sharded safetensors checkpoint
with its index, the single file, bf16 weights into a float32 model; a missing shard, a shard of the
wrong shape, pickled weights, weights where random ones were asked for and none where a checkpoint
was: exit 2 with one line, for `rlbench run` and `rlbench serve`. A run says which weights it starts
from: the default, the committed warm start; random weights, their seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlbench.config import ModelConfig, config_from_dict, load_config
from rlbench.core.model import build_model, file_digest, named_weights, weight_files
from rlbench.errors import BadInput
from rlbench.rundir.digest import weights_digest
from tests.conftest import cli, small_toml, RANDOM_INIT_MODEL


def _checkpoint(tmp_path, shards: int = 2, dtype=torch.float32, seed: int = 99, name: str = "ckpt"):
    """The fixture model's config with weights of another seed, saved in `shards` safetensors files
    (1: the single model.safetensors) and, for more, an index as transformers writes it."""
    directory = tmp_path / name
    directory.mkdir()
    shutil.copy(f"{RANDOM_INIT_MODEL}/config.json", directory)
    weights = {
        k: v.to(dtype).contiguous()
        for k, v in named_weights(build_model(RANDOM_INIT_MODEL, seed, init="random")).items()
    }
    if shards == 1:
        save_file(weights, str(directory / "model.safetensors"))
        return directory, weights
    names = sorted(weights)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: weights[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                "weight_map": weight_map,
            }
        )
    )
    return directory, weights


def _one_line(res, *needles):
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _run(tmp_path, model_dir, *extra, init: str | None = None):
    config = tmp_path / "c.toml"
    table = f"[model]\npath = '{model_dir}'\n" + (f"init = '{init}'\n" if init else "")
    config.write_text(small_toml(1).replace("[data]", table + "[data]"))
    return cli("run", "-c", str(config), "--out", str(tmp_path / "out"), *extra)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_checkpoint_loads_bit_for_bit_and_the_engine_exports_it(tmp_path, shards):
    from rlbench.backends.hf_engine import HFEngine

    directory, weights = _checkpoint(tmp_path, shards)
    assert len(weight_files(directory)) == shards
    engine = HFEngine(build_model(directory, 0, init="checkpoint"))
    exported = engine.export_weights("test", sorted(weights))
    assert sorted(exported) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(exported[name], tensor), name


def test_bf16_weights_go_into_the_configured_dtype(tmp_path):
    directory, weights = _checkpoint(tmp_path, 2, dtype=torch.bfloat16)
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = named_weights(build_model(directory, 0, dtype, init="checkpoint"))
        for name, tensor in weights.items():
            assert model[name].dtype == torch_dtype and torch.equal(model[name], tensor.to(torch_dtype)), name


def test_a_run_from_a_sharded_checkpoint_starts_from_its_weights_and_says_so(tmp_path):
    directory, weights = _checkpoint(tmp_path, 2)
    res = _run(tmp_path, directory, "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["weights"].startswith(f"checkpoint {directory} (2 files, first sha256 ")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["model"]["init"] == "checkpoint"
    assert manifest["weights"]["init"] == "checkpoint" and sorted(manifest["weights"]["files"]) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert manifest["hashes"]["initial_weights"] == weights_digest(dict(sorted(weights.items())))


def test_the_default_run_says_it_starts_from_the_committed_warm_start(tmp_path):
    """The default model is the warm-started fixture policy (issue 52): its one committed file, named with
    its digest in the report and the manifest."""
    config = tmp_path / "c.toml"
    config.write_text(small_toml(1))
    res = cli("run", "-c", str(config), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    path = ModelConfig().path
    digest = file_digest(Path(path) / "model.safetensors")
    assert f"checkpoint {path} (1 file, first sha256 {digest[:12]})" in res.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["weights"] == {"init": "checkpoint", "path": path, "files": {"model.safetensors": digest}}
    assert manifest["config"]["model"]["init"] == "checkpoint"


def test_a_run_from_random_weights_says_so_with_its_seed(tmp_path):
    # the seed pinned: the line names the seed the weights were drawn from, whatever the default seed is
    res = _run(tmp_path, RANDOM_INIT_MODEL, "--seed", "19", init="random")
    assert res.returncode == 0, res.stderr
    assert "random weights, seed 19" in res.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["weights"] == {"init": "random", "seed": 19}
    assert manifest["config"]["model"]["init"] == "random"


def test_a_missing_shard_is_named(tmp_path):
    directory, _ = _checkpoint(tmp_path, 2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    _one_line(_run(tmp_path, directory), "model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing")


def test_a_shard_of_the_wrong_shape_is_named(tmp_path):
    directory, weights = _checkpoint(tmp_path, 2)
    shard = directory / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if tensors[n].dim() == 2)[0]
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(shard))
    _one_line(_run(tmp_path, directory), name, "model-00001-of-00002.safetensors", "shape")


def test_a_shard_that_does_not_hold_what_the_index_says_is_named(tmp_path):
    directory, _ = _checkpoint(tmp_path, 2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    moved = sorted(index["weight_map"])[0]
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"  # it is in shard 1
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line(_run(tmp_path, directory), "the shard does not hold what the index says", moved)


@pytest.mark.parametrize(
    "index", ['{"weight_map": {}}', "[1, 2]", '{"weight_map": {"a": "../x.safetensors"}}', "{not json"]
)
def test_a_broken_index_is_bad_input(tmp_path, index):
    directory, _ = _checkpoint(tmp_path, 2)
    (directory / "model.safetensors.index.json").write_text(index)
    _one_line(_run(tmp_path, directory), "model.safetensors.index.json")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin"])
def test_pickled_weights_are_refused_unread(tmp_path, name):
    directory = tmp_path / "pickled"
    directory.mkdir()
    shutil.copy(f"{RANDOM_INIT_MODEL}/config.json", directory)
    (directory / name).write_bytes(b"\x80\x04 not to be unpickled")
    _one_line(_run(tmp_path, directory), "rlbench loads no pickle", str(directory))


def test_a_model_without_weights_needs_random_asked_for(tmp_path):
    directory = tmp_path / "bare"
    directory.mkdir()
    shutil.copy(f"{RANDOM_INIT_MODEL}/config.json", directory)
    _one_line(_run(tmp_path, directory), "no weights here", 'model.init = "random"')
    assert _run(tmp_path, directory, init="random").returncode == 0


def test_random_weights_asked_for_a_directory_with_weights_is_refused(tmp_path):
    directory, _ = _checkpoint(tmp_path, 1)
    _one_line(_run(tmp_path, directory, init="random"), "model.init is random", "model.safetensors")


def test_a_tied_alias_is_taken_only_equal_to_what_it_is_tied_to(tmp_path):
    directory, weights = _checkpoint(tmp_path, 1)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"))
    assert torch.equal(
        named_weights(build_model(directory, 0, init="checkpoint"))["model.embed_tokens.weight"],
        weights["model.embed_tokens.weight"],
    )
    tensors["lm_head.weight"][0, 0] += 1
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(BadInput, match="lm_head.weight' is tied"):
        build_model(directory, 0, init="checkpoint")


def test_a_model_path_given_means_its_checkpoint_unless_init_says_otherwise(tmp_path):
    assert load_config().model.init == "checkpoint"  # the default: the warm-started fixture's weights
    # a config that asks for random weights, so that a path given after it has an init to override
    toml = tmp_path / "c.toml"
    toml.write_text(f"[model]\npath = '{RANDOM_INIT_MODEL}'\ninit = 'random'\n")
    assert load_config(toml).model.init == "random"
    assert load_config(toml, model__path=str(tmp_path)).model.init == "checkpoint"
    assert load_config(toml, model__path=str(tmp_path), model__init="random").model.init == "random"
    toml.write_text("[model]\npath = 'm'\n")
    assert load_config(toml).model.init == "checkpoint"
    toml.write_text("[model]\ninit = 'sometimes'\n")
    with pytest.raises(BadInput, match="model.init"):
        load_config(toml)


def test_a_manifest_from_before_model_init_reads_back_as_what_the_run_did(tmp_path):
    """Such a run loaded model.safetensors where there was one, else drew random weights."""
    table = load_config().to_dict()
    del table["model"]["init"]
    # the model such a default run had: the fixture directory without weights
    table["model"]["path"] = str(RANDOM_INIT_MODEL)
    assert config_from_dict(table, "m.json").model.init == "random"
    directory, _ = _checkpoint(tmp_path, 1)
    table["model"]["path"] = str(directory)
    assert config_from_dict(table, "m.json").model.init == "checkpoint"


def test_rlbench_serve_refuses_a_broken_checkpoint_before_it_listens(tmp_path):
    directory, _ = _checkpoint(tmp_path, 2)
    (directory / "model-00001-of-00002.safetensors").unlink()
    res = cli("serve", "--model-path", str(directory), "--port", "0")
    line = _one_line(res, "model-00001-of-00002.safetensors", "missing")
    assert "listening" not in res.stdout, line
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(f"{RANDOM_INIT_MODEL}/config.json", bare)
    _one_line(cli("serve", "--model-path", str(bare), "--port", "0"), "no weights here")
    _one_line(cli("serve", "--model-path", str(directory.parent / "nowhere"), "--port", "0"), "no config.json")


def test_the_model_example_of_docs_usage_runs(tmp_path):
    """docs/usage.md's "Your own model" TOML, with its model directory made here (a checkpoint and the
    fixture tokenizer in one directory, as a Hugging Face model ships)."""
    import re

    from tests.conftest import REPO

    text = (REPO / "docs" / "usage.md").read_text()
    block = re.search(r"## Your own model\n.*?```toml\n(.*?)```", text, re.S).group(1)
    directory, _ = _checkpoint(tmp_path, 2, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{ModelConfig().tokenizer}/{name}", directory)
    config = tmp_path / "c.toml"
    config.write_text(small_toml(1) + block.replace("/models/Qwen3-0.6B", str(directory)))
    res = cli("run", "-c", str(config), "--out", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["model"]["dtype"] == "bfloat16" and manifest["weights"]["init"] == "checkpoint"
