"""The server each conformance module talks to: `rlbench serve` on a thread of the test process, on
port 0, with the module's `SERVE` settings, loading a checkpoint written from the fixture model's seeded
weights (so that reloading the directory it was started from is a real disk load, as in SGLang's tests);
or the server at RLBENCH_SGLANG_URL, where a test that needs the local server (its files, its flags)
says why it skips."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

FIXTURE_MODEL = Path(__file__).resolve().parents[3] / "rlbench" / "fixtures" / "models" / "tiny-qwen3"
TIMEOUT = 60


@dataclass
class Server:
    url: str
    local: object | None  # rlbench.serve.server.ServingThread, None for an external server

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=TIMEOUT, **kwargs)

    def post(self, path: str, body=None, **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=TIMEOUT, **kwargs)

    def generate(self, body: dict) -> dict | list:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def needs_local(self, why: str) -> None:
        if self.local is None:
            pytest.skip(f"needs the local rlbench serve: {why}")


def write_checkpoint(directory: Path, seed: int = 1234, scale: float = 1.0) -> Path:
    """The fixture model's seeded weights (times `scale`) as a Hugging Face directory."""
    from safetensors.torch import save_file

    from rlbench.core.model import build_model, named_weights

    model = build_model(FIXTURE_MODEL, seed, init="random")
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: (v * scale).contiguous() for k, v in named_weights(model).items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copyfile(FIXTURE_MODEL / "config.json", directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> Server:
    url = os.environ.get("RLBENCH_SGLANG_URL")
    if url:
        yield Server(url.rstrip("/"), None)
        return
    from rlbench.serve.server import ServeConfig, serve_in_thread

    checkpoint = write_checkpoint(tmp_path_factory.mktemp("served") / "model")
    settings = {
        "model_path": str(checkpoint),
        "load_format": "auto",
        "port": 0,
        "decode_batch_size": 8,
        "batch_wait_ms": 1.0,
        "weights_dir": str(tmp_path_factory.getbasetemp()),  # the tests' checkpoints are written there
        **getattr(request.module, "SERVE", {}),
    }
    serving = serve_in_thread(ServeConfig(**settings))
    try:
        yield Server(serving.url, serving)
    finally:
        serving.close()
