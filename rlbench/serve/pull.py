"""slime's /pull_weights (the endpoint its SGLang patch adds: docker/patch/latest/sglang-pull_weights.patch at
THUDM/slime 624b824a): bring a host-local checkpoint to a published weight version (rlbench/core/weight_pull.py
`pull`: the newest full version at or below it, then each delta on its declared base, every tensor verified before
the checkpoint's files are replaced), then the caller reloads it through /update_weights_from_disk as SGLang's does.

Body {local_checkpoint_dir, source_dir, target_version} (PullWeightsReqInput); answer {success, message}, 400 when
it failed (SGLang's patch: the traceback; here the one line naming the version and tensor), and then the local
checkpoint is as it was. Both paths must lie below the directory the server reads weights from where it has one
(`--weights-dir`), as for /update_weights_from_disk, and so must every file and version read or written there, links
followed (rlbench/core/confine.py); the local checkpoint may not lie in a published version. Version 0 is the
server's own model (`--model-path`). Pulls are serialised on the server's engine thread (the host's other servers
wait on the checkpoint's lock file), so a request arriving while one runs applies after it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from rlbench.errors import BadInput
from rlbench.serve.bodies import body_fields, json_response, outside_root

FIELDS = {"local_checkpoint_dir": str, "source_dir": str, "target_version": int}


async def handle(state, read_body, request: Request) -> Response:
    from rlbench.core.weight_delta import DeltaRefused
    from rlbench.core.weight_pull import pull

    body = body_fields(await read_body(request, state.config.max_request_bytes, required=True), FIELDS, tuple(FIELDS))
    if body["target_version"] < 0:
        return _answer(False, f"target_version {body['target_version']}: expected a version >= 0")
    for key in ("local_checkpoint_dir", "source_dir"):
        outside = outside_root(body[key], state.config.weights_root())
        if outside:
            return _answer(False, outside)
    try:
        await state.worker.call(
            pull,
            body["local_checkpoint_dir"],
            state.model_path,
            body["source_dir"],
            body["target_version"],
            state.config.weights_root(),
        )
    except (DeltaRefused, BadInput, OSError, ValueError, KeyError) as exc:
        return _answer(False, f"pull_weights to version {body['target_version']} refused: {exc}")
    return _answer(True, "Success.")


def _answer(success: bool, message: str) -> Response:
    return json_response({"success": success, "message": message}, status_code=200 if success else 400)
