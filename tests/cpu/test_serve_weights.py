"""`rlbench serve`'s weight loads (/update_weights_from_disk, /pull_weights' reload) copy the new weights into the
served parameters in place, once read whole: the engine's captured CUDA graphs read its parameters by address,
and a model swapped in under them left them replaying the freed old weights (at the Qwen3-0.6B shape on a GPU the
SGLang run's rollout log-probs sat 11 nats from the trainer's after the first update). The same on the GPU, with
graphs captured before the load: tests/gpu/test_engine_cuda.py."""

from __future__ import annotations

import torch

from rlbench.core.model import named_weights
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
