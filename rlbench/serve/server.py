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
from typing import Literal

from rlbench.config import FIXTURES, setting
from rlbench.errors import BadInput
from rlbench.validate import check, number, text

# SGLang's --load-format names for the two ways rlbench starts a model (ModelConfig.init).
LOAD_FORMATS = {"auto": "checkpoint", "dummy": "random"}


@dataclass(frozen=True)
class ServeConfig:
    """SGLang's server argument names where SGLang has one (--model-path, --random-seed, ...)."""

    model_path: str = setting(str(FIXTURES / "models" / "tiny-qwen3"),
        "Model directory: config.json and its weights (model.safetensors, or the shards of "
        "model.safetensors.index.json).")
    tokenizer_path: str = setting(str(FIXTURES / "tokenizers" / "qwen-tiny"), "Tokenizer directory.")
    load_format: Literal["auto", "dummy"] = setting("dummy",
        "SGLang's --load-format: auto loads the model directory's safetensors; dummy starts from seeded random "
        "weights (--random-seed), for a directory without weights.")
    host: str = setting("127.0.0.1",
        "Address to bind. The API has no authentication: 0.0.0.0 serves every machine that can reach this one.")
    port: int = setting(30000, "Port to bind; 0 takes a free one (the first line printed says which).")
    random_seed: int = setting(1234,
        "Seed of the initial weights with --load-format dummy (the run's --seed gives the same weights).")
    dtype: Literal["float32", "bfloat16"] = setting("float32", "Parameter dtype.")
    device: str = setting("cpu", "cpu or cuda[:N].")
    threads: int = setting(1, "torch CPU threads (a request's bits depend on it: keep the run's).")
    decode: Literal["batched", "per-sample"] = setting("batched",
        "The engine's decode path (rollout.decode): keep the run's to get its bits.")
    decode_batch_size: int = setting(64,
        "Rows of every batched decode forward (rollout.decode_batch_size): keep the run's.")
    batch_wait_ms: float = setting(2.0,
        "While requests keep arriving this close together, gather them into one engine batch.")
    weight_version: str = setting("default", "The weight version reported until the first update.")
    served_model_name: str | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = setting("warning",
        "uvicorn's log level.")

    def __post_init__(self) -> None:
        for key in ("model_path", "tokenizer_path", "host", "weight_version"):
            text(getattr(self, key), f"--{key.replace('_', '-')}")
        number(self.port, "--port", 0, 65535, integer=True)
        number(self.random_seed, "--random-seed", 0, 2**63 - 1, integer=True)
        check(self.dtype in ("float32", "bfloat16"), "--dtype", "float32 or bfloat16", self.dtype)
        check(self.load_format in LOAD_FORMATS, "--load-format", "auto or dummy", self.load_format)
        check(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "--device", "cpu, cuda or cuda:N",
               self.device)
        number(self.threads, "--threads", 1, 1024, integer=True)
        check(self.decode in ("batched", "per-sample"), "--decode", "batched or per-sample", self.decode)
        number(self.decode_batch_size, "--decode-batch-size", 1, 100_000, integer=True)
        number(self.batch_wait_ms, "--batch-wait-ms", 0, 10_000)
        check(self.log_level in ("critical", "error", "warning", "info", "debug", "trace"), "--log-level",
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
        model = build_model(config.model_path, config.random_seed, config.dtype, config.device,
                            init=LOAD_FORMATS[config.load_format])
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
