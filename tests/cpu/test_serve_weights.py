"""`rlbench serve`'s weight loads (/update_weights_from_disk, /pull_weights' reload) copy the new weights into the
served parameters in place, once read whole: the engine's captured CUDA graphs read its parameters by address,
and a model swapped in under them left them replaying the freed old weights (at the Qwen3-0.6B shape on a GPU the
SGLang run's rollout log-probs sat 11 nats from the trainer's after the first update). The same on the GPU, with
graphs captured before the load: tests/gpu/test_engine_cuda.py."""

from __future__ import annotations

import pytest
import torch

from rlbench.core.model import named_weights
from rlbench.errors import BadInput
from rlbench.serve.server import ServeConfig, ServerState
from tests.conformance.sglang.conftest import write_checkpoint
from tests.helpers import fixture_requests


def test_a_weight_load_goes_into_the_served_parameters_in_place(tmp_path):
    first, second = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    state = ServerState(ServeConfig(model_path=str(first), load_format="auto"))
    served = state.engine.model
    addresses = {name: p.data_ptr() for name, p in served.named_parameters()}
    before = state.engine.generate(fixture_requests())
    assert state.load_weights(str(second), "auto") == "Succeeded to update model weights."
    assert state.engine.model is served
    assert {name: p.data_ptr() for name, p in served.named_parameters()} == addresses
    fresh = ServerState(ServeConfig(model_path=str(second), load_format="auto"))
    loaded, wanted = named_weights(served), named_weights(fresh.engine.model)
    assert loaded.keys() == wanted.keys()
    assert all(torch.equal(loaded[name], wanted[name]) for name in wanted)
    after = state.engine.generate(fixture_requests())
    assert after == fresh.engine.generate(fixture_requests())
    assert after != before  # the new weights were read


def test_pull_weights_takes_slimes_request_body_and_answers_a_refusal_as_its_patch_does(tmp_path):
    """/pull_weights' body is PullWeightsReqInput's (slime's SGLang patch): a body and its three fields required,
    a version >= 0 (0: the server's own model, pulled as the host's first full version); a refusal is 400 with
    {success: false, message} naming what was refused."""
    import requests

    from rlbench.serve.server import serve_in_thread

    base = write_checkpoint(tmp_path / "base")
    serving = serve_in_thread(ServeConfig(model_path=str(base), load_format="auto", port=0, weights_dir=str(tmp_path)))
    url = serving.url + "/pull_weights"
    body = {"local_checkpoint_dir": str(tmp_path / "local"), "source_dir": str(tmp_path / "chain"), "target_version": 0}
    try:
        no_body = requests.post(url, timeout=60)
        assert no_body.status_code == 400 and "'type': 'missing', 'loc': ('body',)" in no_body.text, no_body.text
        for field in body:
            short = requests.post(url, json={k: v for k, v in body.items() if k != field}, timeout=60)
            assert short.status_code == 400 and f"'type': 'missing', 'loc': ('body', '{field}')" in short.text
        negative = requests.post(url, json=body | {"target_version": -1}, timeout=60)
        assert (negative.status_code, negative.json()) == (
            400,
            {"success": False, "message": "target_version -1: expected a version >= 0"},
        )
        outside = requests.post(url, json=body | {"source_dir": "/etc"}, timeout=60)
        assert outside.status_code == 400 and outside.json()["success"] is False
        assert "outside the directory this server reads weights from" in outside.json()["message"]
        assert not (tmp_path / "local").exists()  # nothing pulled by a refused request
        done = requests.post(url, json=body, timeout=60)
        assert (done.status_code, done.json()) == (200, {"success": True, "message": "Success."})
        assert {p.name for p in (tmp_path / "local").glob("*.safetensors")} == {
            p.name for p in base.glob("*.safetensors")
        }
    finally:
        serving.close()


# ------------------------------------------------------------------------- read_candidate and the weights checker
# (rlbench/serve/weights.py) on the fixture model, without a server: each answer as SGLang gives it


def _served(seed: int = 1234):
    from rlbench.core.model import build_model
    from tests.conformance.sglang.conftest import FIXTURE_MODEL

    return build_model(FIXTURE_MODEL, seed, init="random")


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in named_weights(model).items()}


def _same(model, weights: dict[str, torch.Tensor]) -> bool:
    now = named_weights(model)
    return now.keys() == weights.keys() and all(torch.equal(now[n], weights[n]) for n in weights)


def test_a_candidate_is_a_copy_holding_the_directorys_weights_and_the_served_model_keeps_its_own(tmp_path):
    """read_candidate reads a directory's safetensors into a copy (whatever the load format, dummy included) and
    leaves the model it copied as it was: only the caller's swap changes the served weights."""
    from rlbench.serve.weights import read_candidate

    served = _served()
    before = _weights(served)
    directory = write_checkpoint(tmp_path / "new", seed=2)
    for load_format in ("auto", "safetensors", "dummy"):
        candidate = read_candidate(served, str(directory), load_format, seed=5)
        assert candidate is not served and _same(candidate, _weights(_served(2))), load_format
        assert _same(served, before), load_format


def test_dummy_weights_are_the_seeded_initial_ones_only_for_a_model_directory_without_weights(tmp_path):
    """load_format dummy on a directory with config.json and no weights gives the seeded initial weights, as a
    server started with --load-format dummy --random-seed has them; any other format on it, a directory without
    config.json or a path that is no directory finds no weights."""
    import shutil

    from rlbench.serve.weights import LoadFailed, read_candidate
    from tests.conformance.sglang.conftest import FIXTURE_MODEL

    served = _served()
    before = _weights(served)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(FIXTURE_MODEL / "config.json", bare / "config.json")
    assert _same(read_candidate(served, str(bare), "dummy", seed=77), _weights(_served(77)))
    assert _same(served, before)
    empty, nowhere, a_file = tmp_path / "empty", tmp_path / "nowhere", bare / "config.json"
    empty.mkdir()
    for path, load_format in [
        (bare, "auto"),
        (bare, "safetensors"),
        (empty, "dummy"),
        (nowhere, "dummy"),
        (a_file, "dummy"),
    ]:
        with pytest.raises(LoadFailed) as failed:
            read_candidate(served, str(path), load_format, seed=77)
        assert str(failed.value) == f"Failed to get weights iterator: Cannot find any model weights with `{path}`."


def test_a_load_that_cannot_be_read_whole_fails_with_sglangs_message_and_the_reason(tmp_path):
    """An unknown load format, weights that cannot be listed and weights that cannot be loaded: LoadFailed with
    SGLang's words and the reason (an OSError by its class and strerror, any reason cut at 400 characters)."""
    from safetensors.torch import save_file

    from rlbench.core.model import weight_files
    from rlbench.serve.weights import LoadFailed, _reason, read_candidate

    served = _served()
    before = _weights(served)

    def fails(path, load_format: str = "auto") -> str:
        with pytest.raises(LoadFailed) as failed:
            read_candidate(served, str(path), load_format, seed=1)
        assert _same(served, before)
        return str(failed.value)

    assert fails(tmp_path, "pt") == (
        "Failed to get model loader: load_format 'pt' (rlbench serve reads auto, safetensors, dummy)."
    )
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    said = fails(pickled)
    assert said.startswith(
        f"Failed to get weights iterator: {pickled}: holds pytorch_model.bin, a pickle"
    ) and said.endswith(".")
    deep = tmp_path / ("d" * 200) / ("e" * 200)  # the reason, which names the path, is longer than 400 characters
    deep.mkdir(parents=True)
    (deep / "pytorch_model.bin").write_bytes(b"\x80\x04")
    said = fails(deep)
    with pytest.raises(BadInput) as reason:
        weight_files(deep)
    assert len(str(reason.value)) > 400 and said == f"Failed to get weights iterator: {str(reason.value)[:400]}."
    assert len(said) == len("Failed to get weights iterator: ") + 400 + len(".")
    assert _reason(FileNotFoundError(2, "No such file or directory", "/w/model.safetensors")) == (
        "FileNotFoundError: No such file or directory"
    )
    assert _reason(OSError("the disk went away")) == "OSError: the disk went away"  # an OSError without strerror
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    weights = named_weights(served)
    save_file(
        {n: (torch.zeros(3) if n == "model.norm.weight" else t.contiguous()) for n, t in weights.items()},
        str(wrong / "model.safetensors"),
    )
    said = fails(wrong)
    assert said.startswith("Failed to update weights: ") and said.endswith(".\nRolling back to original weights.")
    assert "'model.norm.weight' is torch.float32 of shape (3,), the model expects a float tensor of shape (64,)" in said


def test_the_weights_checkers_checksum_is_sglangs_hash_of_every_checked_tensor():
    """action checksum: each parameter's and persistent buffer's SGLang hash (sha256 of its bytes, 16 hex digits),
    the rank's checksum a sha256 over the names and hashes in name order, the engine's the sha256 of the rank's."""
    import hashlib

    from rlbench.serve.weights import Checker

    served = _served()
    checked = {n: t for n, t in list(served.named_parameters()) + list(served.named_buffers()) if "inv_freq" not in n}
    hashes = {
        n: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        for n, t in checked.items()
    }
    rank = hashlib.sha256("".join(n + hashes[n] for n in sorted(hashes)).encode()).hexdigest()
    answer = Checker().handle(served, "checksum", None)
    assert answer == {
        "success": True,
        "message": "Success.",
        "ranks": [
            {
                "checksums": hashes,
                "per_gpu_checksum": rank,
                "parallelism_info": [
                    {
                        "role": "target",
                        "tp_rank": 0,
                        "tp_size": 1,
                        "dp_rank": 0,
                        "dp_size": 1,
                        "pp_rank": 0,
                        "pp_size": 1,
                        "rank": 0,
                        "size": 1,
                    }
                ],
            }
        ],
        "per_engine_checksum": hashlib.sha256(rank.encode()).hexdigest(),
    }


def test_the_weights_checkers_snapshot_and_compare_name_each_changed_tensor_and_skip_what_is_asked():
    """snapshot then compare: success while nothing changed, else every changed tensor named with its largest and
    mean absolute difference and how many values differ; tensors whose name holds a `skip` pattern are not
    compared; a compare consumes the snapshot, and one without a snapshot fails with SGLang's empty message."""
    from rlbench.serve.weights import Checker

    served, checker = _served(), Checker()
    ok = {"success": True, "message": "Success."}
    assert checker.handle(served, "compare", None) == {"success": False, "message": ""}
    assert checker.handle(served, "snapshot", None) == ok
    assert checker.handle(served, "compare", None) == ok
    assert checker.handle(served, "compare", None) == {"success": False, "message": ""}  # the snapshot was used
    assert checker.handle(served, "snapshot", None) == ok
    norms = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]  # ones (64), in this order in the model
    params = dict(served.named_parameters())
    with torch.no_grad():
        params[norms[0]][:3] += 0.5  # 1.5 - 1.0 exactly: 3 of 64 values
        params[norms[1]][:1] -= 0.25
    assert checker.handle(served, "compare", ["layers.0.input", "model.norm"]) == ok  # both skipped
    assert checker.handle(served, "snapshot", None) == ok
    with torch.no_grad():
        params[norms[0]][:3] -= 0.5
        params[norms[1]][:1] += 0.25
    assert checker.handle(served, "compare", ["mlp"]) == {
        "success": False,
        "message": "check tensor equality failed:\n"
        f"name={norms[0]} max_abs_err=0.5 mean_abs_err={1.5 / 64} num_exceed=3 \n"
        f"name={norms[1]} max_abs_err=0.25 mean_abs_err={0.25 / 64} num_exceed=1 ",
    }
    assert checker.handle(served, "snapshot", None) == ok
    with torch.no_grad():
        params[norms[1]][:1] += 0.25
    # the first tensor skipped, the one after it still compared
    said = checker.handle(served, "compare", ["layers.0.input"])
    assert said["success"] is False and said["message"].splitlines()[1].startswith(f"name={norms[1]} ")
    assert checker.handle(served, "frobnicate", None) == {
        "success": False,
        "message": "Unsupported action='frobnicate'",
    }


def test_reset_tensors_draws_every_checked_float_tensor_from_its_own_generator_and_skips_what_is_asked():
    """action reset_tensors: new values in every float tensor not skipped, the same values on every call and
    whatever torch's default dtype, and the process's global random state untouched."""
    from rlbench.serve.weights import Checker

    def reset(skip, default=torch.float32):
        served = _served()
        before = _weights(served)
        torch.manual_seed(3)
        rng = torch.get_rng_state()
        old = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            assert Checker().handle(served, "reset_tensors", skip) == {"success": True, "message": "Success."}
        finally:
            torch.set_default_dtype(old)
        assert torch.equal(torch.get_rng_state(), rng)
        after = _weights(served)
        return {n for n in before if not torch.equal(before[n], after[n])}, after

    changed, first = reset(None)
    assert changed == set(first)
    changed, _ = reset(["layers.0.", "embed"])
    assert changed == {n for n in first if "layers.0." not in n and "embed" not in n} and changed
    assert _same_values(reset(None, torch.float64)[1], first)


def _same_values(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
