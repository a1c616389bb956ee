"""What `rlbench serve` loads and how it listens: a ServeConfig, the model and the batched engine,
the server's own state (model path, weight version), and uvicorn on a socket bound first.

It binds 127.0.0.1 unless told otherwise (`--host 0.0.0.0` serves other machines: the API has no
authentication, like SGLang's own without --api-key). Port 0 takes a free port; either way the
first line on standard output is `rlbench serve: listening on http://HOST:PORT ...`, printed once
the model is loaded and the socket is bound, so a launcher can read where it is.
"""

from __future__ import annotations

import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from rlbench.config import FIXTURES
from rlbench.errors import BadInput

LISTENING = "rlbench serve: listening on "


@dataclass(frozen=True)
class ServeConfig:
    """SGLang's server argument names where SGLang has one (--model-path, --random-seed, ...)."""

    model_path: str = str(FIXTURES / "models" / "tiny-qwen3")
    tokenizer_path: str = str(FIXTURES / "tokenizers" / "qwen-tiny")
    host: str = "127.0.0.1"
    port: int = 30000
    random_seed: int = 1234  # the seed of the initial weights of a model directory without weights (core/model.py)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    decode: str = "batched"
    decode_batch_size: int = 64
    batch_wait_ms: float = 2.0
    weight_version: str = "default"
    served_model_name: str | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        from rlbench.config import _check, _number, _text

        for key in ("model_path", "tokenizer_path", "host", "weight_version"):
            _text(getattr(self, key), f"--{key.replace('_', '-')}")
        _number(self.port, "--port", 0, 65535, integer=True)
        _number(self.random_seed, "--random-seed", 0, 2**63 - 1, integer=True)
        _check(self.dtype in ("float32", "bfloat16"), "--dtype", "float32 or bfloat16", self.dtype)
        _check(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "--device", "cpu, cuda or cuda:N",
               self.device)
        _number(self.threads, "--threads", 1, 1024, integer=True)
        _check(self.decode in ("batched", "per-sample"), "--decode", "batched or per-sample", self.decode)
        _number(self.decode_batch_size, "--decode-batch-size", 1, 100_000, integer=True)
        _number(self.batch_wait_ms, "--batch-wait-ms", 0, 10_000)
        _check(self.log_level in ("critical", "error", "warning", "info", "debug", "trace"), "--log-level",
               "one of critical, error, warning, info, debug, trace", self.log_level)


class ServerState:
    """The loaded engine and what the server reports about itself; the weights change only on the
    engine's thread (worker.py), through `load_weights`."""

    def __init__(self, config: ServeConfig):
        from rlbench import __version__
        from rlbench.backends.hf_engine import HFEngine
        from rlbench.core.model import build_model, load_tokenizer
        from rlbench.core.seeding import configure_determinism
        from rlbench.serve.worker import EngineWorker

        self.config = config
        self.version = __version__
        self.determinism = configure_determinism(config.threads, config.device)
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        model = build_model(config.model_path, config.random_seed, config.dtype, config.device)
        self.engine = HFEngine(model, device=config.device, engine_id="serve", decode=config.decode,
                               batch_size=config.decode_batch_size)
        del model
        self.vocab = self.engine.vocab
        self.context_len = int(getattr(self.engine.model.config, "max_position_embeddings", None) or 1 << 30)
        self.model_path = config.model_path
        self.weight_version = config.weight_version
        self.worker = EngineWorker(self.engine, config.batch_wait_ms / 1000, config.decode_batch_size)

    def load_weights(self, model_path: str) -> str:
        """Load every *.safetensors file of a Hugging Face-format directory (the engine's thread only)."""
        from rlbench.core.model import load_named_, load_safetensors

        directory = Path(model_path)
        files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
        if not files:
            raise BadInput("no *.safetensors files (expected a Hugging Face-format model directory)", path=directory)
        weights = {}
        for file in files:
            weights.update(load_safetensors(file))
        load_named_(self.engine.model, weights, source=directory)
        self.model_path = str(directory)
        return f"loaded {len(weights)} tensors from {len(files)} file(s)"

    def server_info(self) -> dict:
        """SGLang's /server_info: the server's arguments, flat, and its version."""
        return {**asdict(self.config), "model_path": self.model_path, "tp_size": 1, "dp_size": 1,
                "weight_version": self.weight_version, "skip_tokenizer_init": False,
                "max_total_tokens": self.context_len * self.config.decode_batch_size, "vocab_size": self.vocab,
                "context_length": self.context_len, "determinism": self.determinism, "version": self.version,
                "server": "rlbench serve"}

    def model_info(self) -> dict:
        config = self.engine.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.config.tokenizer_path,
                "served_model_name": self.config.served_model_name or self.config.model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
                "load_format": "safetensors", "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts (port 0: a free one, read back)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BadInput(f"cannot bind {host}:{port} ({exc.strerror})", field="--port") from None
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: ServeConfig, announce) -> None:
    """Load, bind, announce the URL through `announce(url)`, and serve until stopped (SIGINT/SIGTERM)."""
    import uvicorn

    from rlbench.serve.app import build_app

    state = ServerState(config)
    sock = bind(config.host, config.port)
    announce(url_of(sock))
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=config.log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
