"""Weight updates, weight versions and the weight checker, as SGLang's own tests hold them.

Sources: test/registered/rl/test_update_weights_from_disk.py @02901e17 (TestServerUpdateWeightsFromDisk),
test/manual/test_weight_version.py @134db069, test/registered/rl/test_weight_checker_e2e.py @03a364cf, read
against SGLang 0.5.23's server code (srt/entrypoints/http_server.py, srt/managers/io_struct.py, srt/utils/
weight_checker.py), whose /weights_checker answers `parallelism_info` as a list (one entry per role), where
the older test reads one object. And, rlbench's own (issue 22): a failed update leaves the weights
byte-identical.
"""

from __future__ import annotations

import pytest

from tests.conformance.sglang.conftest import write_checkpoint

# One xdist worker runs the whole module (--dist loadgroup): one server for it, not one per worker.
pytestmark = pytest.mark.xdist_group("sglang-conformance-weights")


PROMPT = "The capital of France is"


def _decode(server, with_logprobs: bool = False):
    """The greedy output (SGLang's tests compare its text), with its log-probs where asked: the tiny
    random model's greedy tokens can agree across two sets of weights, their log-probs do not."""
    answer = server.generate(
        {
            "text": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
            "return_logprob": with_logprobs,
        }
    )
    if not with_logprobs:
        return answer["output_ids"]
    return answer["output_ids"], [x[0] for x in answer["meta_info"]["output_token_logprobs"]]


def _update(server, model_path: str, **fields) -> tuple[int, dict]:
    response = server.post("/update_weights_from_disk", {"model_path": model_path, **fields})
    return response.status_code, response.json()


def _checksums(server) -> dict:
    answer = server.post("/weights_checker", {"action": "checksum"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_update_weights(server, tmp_path):
    """TestServerUpdateWeightsFromDisk.test_update_weights: an update to another model succeeds, moves
    /get_model_info's model_path to it, and changes the greedy output; updating back to the model the
    server started from succeeds, moves the path back, and gives the first output again (compared with its
    log-probs here)."""
    server.needs_local("it writes a second model directory the server reads")
    origin = server.get("/get_model_info").json()["model_path"]
    before = _decode(server, with_logprobs=True)
    other = str(write_checkpoint(tmp_path / "other", seed=99))
    status, answer = _update(server, other)
    assert status == 200 and answer["success"] is True
    assert answer["message"] == "Succeeded to update model weights." and answer["num_paused_requests"] == 0
    moved = server.get("/get_model_info").json()["model_path"]
    assert moved == other and moved != origin
    assert _decode(server, with_logprobs=True) != before
    status, answer = _update(server, origin)
    assert status == 200 and answer["success"] is True
    assert server.get("/get_model_info").json()["model_path"] == origin
    assert _decode(server, with_logprobs=True) == before


def test_update_weights_unexist_model(server):
    """TestServerUpdateWeightsFromDisk.test_update_weights_unexist_model: a path that does not exist is a
    failed update (400, success false) that leaves the model path and the output as they were."""
    origin = server.get("/get_model_info").json()["model_path"]
    before = _decode(server)
    status, answer = _update(server, origin.rstrip("/") + "wrong")
    assert status == 400 and answer["success"] is False
    assert server.get("/get_model_info").json()["model_path"] == origin
    assert _decode(server) == before


def test_a_failed_update_changes_no_weight(server, tmp_path):
    """rlbench's own (issue 22): a directory whose last tensor has the wrong shape, or a path component too
    long for the file system, is refused (400) and leaves every tensor byte-identical (the checker's hashes)."""
    server.needs_local("it writes a broken model directory the server reads")
    from safetensors.torch import load_file, save_file

    broken = write_checkpoint(tmp_path / "broken", seed=7)
    tensors = load_file(str(broken / "model.safetensors"))
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last][..., :-1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    before = _checksums(server)
    for path in (str(broken), str(tmp_path / ("x" * 300) / "model")):
        status, answer = _update(server, path)
        assert status == 400 and answer["success"] is False, answer
    assert _checksums(server) == before


def test_weight_version(server):
    """test_weight_version.py test_weight_version_comprehensive: /update_weight_version answers success and
    the new version; /model_info and every later /generate carry it (also after an update that aborts
    running requests). 0.5.23 has no /weight_version: /model_info says it."""
    for new, abort in (("updated_version_2.0", False), ("final_version_3.0", True)):
        response = server.post("/update_weight_version", {"new_version": new, "abort_all_requests": abort})
        assert response.status_code == 200
        assert response.json()["success"] is True and response.json()["new_version"] == new
        assert server.get("/model_info").json()["weight_version"] == new
        answer = server.generate(
            {"text": "Test persistence", "sampling_params": {"temperature": 0.0, "max_new_tokens": 3}}
        )
        assert answer["meta_info"]["weight_version"] == new


def test_update_weight_version_with_weight_updates(server):
    """test_weight_version.py test_update_weight_version_with_weight_updates: reloading the model's own
    directory (load_format auto) with a weight_version succeeds and sets it, the message ending with
    "Weight version updated to X." (tokenizer_manager.update_weights_from_disk, 0.5.23)."""
    info = server.get("/model_info").json()
    if info["load_format"] == "dummy":
        pytest.skip("the server started from dummy weights: its directory holds none to reload")
    status, answer = _update(
        server, info["model_path"], load_format="auto", abort_all_requests=False, weight_version="disk_update_v2.0.0"
    )
    assert status == 200 and answer["message"].endswith(" Weight version updated to disk_update_v2.0.0.")
    assert server.get("/model_info").json()["weight_version"] == "disk_update_v2.0.0"


def test_weights_checker_snapshot_compare_and_actions(server):
    """test_weight_checker_e2e.py test_a (snapshot then compare on unchanged weights: both 200 and success)
    and test_b (an unknown action: 400, "Unsupported" in the message)."""
    for action in ("snapshot", "compare"):
        response = server.post("/weights_checker", {"action": action})
        assert response.status_code == 200 and response.json()["success"] is True
    response = server.post("/weights_checker", {"action": "nonsense_action"})
    assert response.status_code == 400 and "Unsupported" in response.json()["message"]


def test_weights_checker_checksum(server):
    """test_weight_checker_e2e.py test_e_*: checksum answers a list of ranks, each with checksums (16 hex
    digits per tensor) and parallelism_info (tp/dp/pp rank and size, rank, size; in 0.5.23 a list, one
    entry per role, "target" first); two calls with no update agree; no non-persistent buffer is listed."""
    body = _checksums(server)
    assert body["success"] is True and isinstance(body["ranks"], list) and len(body["ranks"]) >= 1
    first = body["ranks"][0]
    infos = first["parallelism_info"]
    assert isinstance(infos, list) and infos[0]["role"] == "target"
    for key in ("tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank", "size"):
        assert key in infos[0]
    assert len(first["checksums"]) > 0
    for name, digest in first["checksums"].items():
        assert isinstance(digest, str) and len(digest) == 16
        int(digest, 16)
        assert not any(part in name for part in ("cos_sin_cache", "inv_freq", "freqs_cis"))
    assert _checksums(server)["ranks"] == body["ranks"]


def test_weights_checker_sees_an_update(server, tmp_path):
    """test_weight_checker_e2e.py test_e_checksum_changes_after_weight_update (through a disk update here):
    a tensor's hash changes when its values do."""
    server.needs_local("it writes a second model directory the server reads")
    origin = server.get("/model_info").json()["model_path"]
    before = _checksums(server)["ranks"][0]["checksums"]
    _update(server, str(write_checkpoint(tmp_path / "scaled", scale=0.5)))
    after = _checksums(server)["ranks"][0]["checksums"]
    name = next(n for n in before if "proj" in n)
    assert after[name] != before[name]
    _update(server, origin)
    assert _checksums(server)["ranks"][0]["checksums"] == before


def test_z_snapshot_reset_compare_detects_diff(server):
    """test_weight_checker_e2e.py test_z_snapshot_reset_compare_detects_diff (destructive, last): snapshot,
    reset_tensors, compare: 400, success false, "max_abs_err" in the message. Then the server reloads its
    model, as the next module's would not share it anyway."""
    assert server.post("/weights_checker", {"action": "snapshot"}).status_code == 200
    assert server.post("/weights_checker", {"action": "reset_tensors"}).status_code == 200
    response = server.post("/weights_checker", {"action": "compare"})
    assert response.status_code == 400 and response.json()["success"] is False
    assert "max_abs_err" in response.json()["message"]
    _update(server, server.get("/model_info").json()["model_path"])
