"""What `rlbench serve` loads and how it listens: a ServeConfig, the model and the batched engine,
the server's own state (model path, weight version, load format), and uvicorn on a socket bound first.

It binds 127.0.0.1 unless told otherwise. With `--api-key` (or RLBENCH_SERVE_API_KEY) every route but
/health*, /ready* and /metrics* asks for `Authorization: Bearer KEY`, as SGLang's server does (app.py);
bound beyond loopback without a key it refuses to start unless `--allow-unauthenticated`. Weight
updates read any directory the process can read, as SGLang's do, where only trusted callers reach the
server (loopback, or a key); `--weights-dir` narrows them, and is required beyond loopback without a key. Port 0
takes a free port; either way the
first line on standard output is `rlbench serve: listening on http://HOST:PORT ...`, printed once
the model is loaded and the socket is bound, so a launcher can read where it is. `serve_in_thread`
runs the same server on a thread of the calling process (tests, notebooks).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rlbench.config_sections import FIXTURES, setting
from rlbench.errors import BadInput
from rlbench.keys import SERVE_API_KEY_ENV
from rlbench.validate import check, number, text

LOOPBACK = ("127.0.0.1", "localhost", "::1")

# SGLang's --load-format names for the two ways rlbench starts a model (ModelConfig.init).
LOAD_FORMATS = {"auto": "checkpoint", "dummy": "random"}


@dataclass(frozen=True)
class ServeConfig:
    """SGLang's server argument names where SGLang has one (--model-path, --random-seed, ...)."""

    model_path: str = setting(
        str(FIXTURES / "models" / "tiny-qwen3-sft"),  # what `rlbench run` starts from by default
        "Model directory: config.json and its weights (model.safetensors, or the shards of "
        "model.safetensors.index.json).",
    )
    tokenizer_path: str = setting(str(FIXTURES / "tokenizers" / "qwen-tiny"), "Tokenizer directory.")
    load_format: Literal["auto", "dummy"] = setting(
        "auto",
        "SGLang's --load-format: auto loads the model directory's safetensors; dummy starts from seeded random "
        "weights (--random-seed), for a directory without weights.",
    )
    host: str = setting(
        "127.0.0.1",
        "Address to bind. Beyond loopback (0.0.0.0: every machine that can reach this one) it needs --api-key, "
        "or --allow-unauthenticated.",
    )
    port: int = setting(30000, "Port to bind; 0 takes a free one (the first line printed says which).")
    random_seed: int = setting(
        1234, "Seed of the initial weights with --load-format dummy (the run's --seed gives the same weights)."
    )
    dtype: Literal["float32", "bfloat16"] = setting("float32", "Parameter dtype.")
    device: str = setting("cpu", "cpu or cuda[:N].")
    threads: int = setting(1, "torch CPU threads (a request's bits depend on it: keep the run's).")
    decode: Literal["batched", "per-sample"] = setting(
        "batched", "The engine's decode path (rollout.decode): keep the run's to get its bits."
    )
    decode_batch_size: int = setting(
        64, "Rows of every batched decode forward (rollout.decode_batch_size): keep the run's."
    )
    batch_variant: bool = setting(
        False,
        "For testing tools like `rlbench check engine`: make the batched decode's log-probs depend on the batch's "
        "size, as a batch-variant GPU kernel does. Never for a run.",
    )
    batch_wait_ms: float = setting(
        2.0, "While requests keep arriving this close together, gather them into one engine batch."
    )
    weight_version: str = setting("default", "The weight version reported until the first update.")
    served_model_name: str | None = None
    context_length: int | None = setting(
        None,
        "SGLang's --context-length: prompt + new tokens per request (default: the model's max_position_embeddings, "
        "which it may not exceed).",
    )
    skip_tokenizer_init: bool = setting(
        False, "SGLang's --skip-tokenizer-init: no tokenizer; requests send input_ids, answers carry no text."
    )
    prefix_cache_mb: int = setting(
        1024,
        "Memory for the prompt prefills kept between requests (0: none kept): a prompt prefilled before is not "
        "computed again, bit for bit the same answer (docs/sglang-ray.md).",
    )
    incremental_streaming_output: bool = setting(
        False,
        "SGLang's --incremental-streaming-output (--stream-output before it): each stream chunk carries only what "
        "is new since the last (output ids, text, output log-probs); without it chunks are cumulative.",
    )
    max_request_bytes: int = setting(
        16 << 20,
        "Largest request body read (a larger one is answered 413 before it is read). SGLang sets none: this "
        "bounds what one client can make the server parse.",
    )
    api_key: str | None = setting(
        None,
        f"SGLang's --api-key: every request but /health*, /ready* and /metrics* must send 'Authorization: Bearer "
        f"KEY' (401 otherwise). Read from {SERVE_API_KEY_ENV} when set there; it is never printed or reported.",
    )
    allow_unauthenticated: bool = setting(
        False,
        "Serve beyond loopback without --api-key: anyone who reaches the port can generate, read the weights and "
        "load new ones.",
    )
    weights_dir: str | None = setting(
        None,
        "/update_weights_from_disk reads only below this directory (default: any directory this process can read, "
        "as SGLang's server; required with --host beyond loopback and no --api-key).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = setting(
        "warning", "uvicorn's log level."
    )

    def __post_init__(self) -> None:
        for key in ("model_path", "tokenizer_path", "host", "weight_version"):
            text(getattr(self, key), f"--{key.replace('_', '-')}")
        number(self.port, "--port", 0, 65535, integer=True)
        number(self.random_seed, "--random-seed", 0, 2**63 - 1, integer=True)
        check(self.dtype in ("float32", "bfloat16"), "--dtype", "float32 or bfloat16", self.dtype)
        check(self.load_format in LOAD_FORMATS, "--load-format", "auto or dummy", self.load_format)
        check(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None, "--device", "cpu, cuda or cuda:N", self.device)
        number(self.threads, "--threads", 1, 1024, integer=True)
        check(self.decode in ("batched", "per-sample"), "--decode", "batched or per-sample", self.decode)
        number(self.decode_batch_size, "--decode-batch-size", 1, 100_000, integer=True)
        number(self.batch_wait_ms, "--batch-wait-ms", 0, 10_000)
        check(isinstance(self.batch_variant, bool), "--batch-variant", "true or false", self.batch_variant)
        check(
            not self.batch_variant or self.decode == "batched",
            "--batch-variant",
            "the batched decode it plants into (--decode batched)",
            self.decode,
        )
        check(
            self.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
            "--log-level",
            "one of critical, error, warning, info, debug, trace",
            self.log_level,
        )
        if self.context_length is not None:
            number(self.context_length, "--context-length", 8, 1 << 24, integer=True)
        check(
            isinstance(self.skip_tokenizer_init, bool),
            "--skip-tokenizer-init",
            "true or false",
            self.skip_tokenizer_init,
        )
        number(self.prefix_cache_mb, "prefix_cache_mb", 0, 1 << 30, integer=True)
        check(
            isinstance(self.incremental_streaming_output, bool),
            "--incremental-streaming-output",
            "true or false",
            self.incremental_streaming_output,
        )
        number(self.max_request_bytes, "--max-request-bytes", 1024, 1 << 34, integer=True)
        if self.api_key is not None:
            if not isinstance(self.api_key, str) or not self.api_key.strip():  # the value is never echoed
                raise BadInput("expected a non-empty string", field="--api-key")
        check(
            isinstance(self.allow_unauthenticated, bool),
            "--allow-unauthenticated",
            "true or false",
            self.allow_unauthenticated,
        )
        if self.weights_dir is not None:
            text(self.weights_dir, "--weights-dir")
        if self.host not in LOOPBACK and self.api_key is None:
            if not self.allow_unauthenticated:
                raise BadInput(
                    f"refusing to serve on {self.host} without a key: give --api-key (or {SERVE_API_KEY_ENV}), "
                    f"bind 127.0.0.1, or pass --allow-unauthenticated",
                    field="--host",
                )
            if self.weights_dir is None:
                raise BadInput(
                    f"refusing to serve on {self.host} without a key and without --weights-dir: anyone "
                    f"who reaches the port could make it load any file it can read; give --weights-dir "
                    f"DIR (updates read only below it) or --api-key",
                    field="--weights-dir",
                )

    def __repr__(self) -> str:  # the key stays out of every repr, log and error
        shown = {k: v for k, v in asdict(self).items() if k != "api_key"}
        return f"ServeConfig({shown}, api_key={'set' if self.api_key else None})"

    def weights_root(self) -> Path | None:
        """The directory weight updates may read below, or None: any directory this process can read.

        SGLang's server loads whatever path /update_weights_from_disk names; rlbench serve does the same where
        only trusted callers reach it (bound to loopback, or every request carrying the api key), so a run's
        weights in its own temporary directory load as on a real fleet. --weights-dir narrows it always, and a
        server anyone can reach without a key reads no path outside it (it does not start without one)."""
        if self.weights_dir is not None:
            return Path(self.weights_dir).resolve()
        return None


class ServerState:
    """The loaded engine and what the server reports about itself; the weights change only on the
    engine's thread (worker.py), through `load_weights`."""

    def __init__(self, config: ServeConfig, engine=None, tokenizer=None):
        """`engine` (and its `tokenizer`): serve a run's own engine (slime plugins under `rlbench run`) instead
        of loading `config.model_path`; the run keeps its weights in step with its trainer."""
        from rlbench import __version__
        from rlbench.backends.hf_engine import HFEngine
        from rlbench.core.model import build_model, load_tokenizer
        from rlbench.core.seeding import configure_determinism
        from rlbench.core.vocab import model_vocab
        from rlbench.serve.weights import Checker
        from rlbench.serve.worker import EngineWorker

        self.config = config
        self.version = __version__
        if engine is None:
            self.determinism = configure_determinism(config.threads, config.device)
            self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_path)
            model = build_model(
                config.model_path,
                config.random_seed,
                config.dtype,
                config.device,
                init=LOAD_FORMATS[config.load_format],
            )
            engine = HFEngine(
                model,
                device=config.device,
                engine_id="serve",
                decode=config.decode,
                batch_size=config.decode_batch_size,
            )
            engine.batch_variant = config.batch_variant
            del model
        else:  # the run set up determinism and holds the tokenizer
            self.determinism, self.tokenizer = None, tokenizer
        self.engine = engine
        if config.prefix_cache_mb:
            from rlbench.backends.prompt_cache import PromptCache

            self.engine.prompt_cache = PromptCache(config.prefix_cache_mb << 20)
        self.vocab = model_vocab(config.model_path)  # core/vocab.py: the ids the engine samples and accepts
        positions = int(getattr(self.engine.model.config, "max_position_embeddings", None) or 1 << 30)
        if config.context_length is not None and config.context_length > positions:
            raise BadInput(
                f"expected at most the model's max_position_embeddings ({positions}), got {config.context_length}",
                field="--context-length",
            )
        self.context_len = config.context_length or positions
        self.eos = eos_ids(config.model_path, self.engine.model.config, self.tokenizer)
        self.model_path = config.model_path
        self.served_model_name = config.served_model_name or config.model_path
        self.load_format = config.load_format
        self.weight_version = config.weight_version
        self.port = config.port
        self.started = time.time()
        self.checker = Checker()
        self.worker = EngineWorker(self.engine, config.batch_wait_ms / 1000, config.decode_batch_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def load_weights(self, model_path: str, load_format: str) -> str:
        """Load the weights `model_path` names, whole (the engine's thread only); LoadFailed, and the
        served weights untouched, when any part of them cannot be read. Once read whole, they are copied into
        the served parameters in place by the engine's own weight update (its weights version kept), never
        swapped for a new model: the engine's captured CUDA graphs read the parameters by address, so a
        swapped-in model would leave them replaying the freed old weights (seen at the Qwen3-0.6B shape on a GPU:
        rollout log-probs 11 nats from the trainer's after the first update), and a run serving its own engine
        keeps it."""
        from rlbench.core.model import named_weights
        from rlbench.serve.weights import read_candidate

        candidate = read_candidate(
            self.engine.model, model_path, load_format, self.config.random_seed, self.config.weights_root()
        )
        self.engine.update_weights(named_weights(candidate), self.engine.weight_version)
        self.model_path = self.served_model_name = model_path
        self.load_format = load_format
        return "Succeeded to update model weights."

    def server_info(self) -> dict:
        """SGLang's /server_info: the server's arguments, flat, then the scheduler's figures and its version."""
        public = {k: v for k, v in asdict(self.config).items() if k != "api_key"}
        return {
            **public,
            "model_path": self.model_path,
            "port": self.port,
            "tp_size": 1,
            "dp_size": 1,
            "served_model_name": self.served_model_name,
            "load_format": self.load_format,
            "weight_version": self.weight_version,
            "context_length": self.context_len,
            "vocab_size": self.vocab,
            "determinism": self.determinism,
            "status": "ready",
            "max_total_num_tokens": self.context_len * self.config.decode_batch_size,
            "max_req_input_len": self.context_len - 6,
            "startup_time": self.started,
            "internal_states": [{"paused": self.worker.paused}],
            "version": self.version,
            "frontend": "rlbench serve",
            "server": "rlbench serve",
        }

    def model_info(self) -> dict:
        config = self.engine.model.config
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": None if self.tokenizer is None else self.config.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": self.load_format,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }


def eos_ids(model_path: str, config, tokenizer) -> tuple[int, ...]:
    """The ids that end a request unless it sets ignore_eos: the model config's eos_token_id, its
    generation_config.json's, and the tokenizer's (SGLang's hf_eos_token_id and tokenizer.eos_token_id)."""
    found: list = [getattr(config, "eos_token_id", None)]
    try:
        generation = json.loads((Path(model_path) / "generation_config.json").read_text())
        found.append(generation.get("eos_token_id") if isinstance(generation, dict) else None)
    except (OSError, ValueError):
        pass
    if tokenizer is not None:
        found.append(tokenizer.eos_token_id)
    ids = set()
    for value in found:
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, int) and not isinstance(one, bool) and one >= 0:
                ids.add(one)
    return tuple(sorted(ids))


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


def _server(state: ServerState, config: ServeConfig):
    import uvicorn

    from rlbench.serve.app import build_app

    return uvicorn.Server(
        uvicorn.Config(build_app(state), log_level=config.log_level, access_log=False, timeout_graceful_shutdown=5)
    )


def serve(config: ServeConfig, announce) -> None:
    """Load, bind, announce the URL through `announce(url)`, and serve until stopped (SIGINT/SIGTERM)."""
    state = ServerState(config)
    sock = bind(config.host, config.port)
    state.port = sock.getsockname()[1]
    announce(url_of(sock))
    server = _server(state, config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class ServingThread:
    """`rlbench serve` on a thread of this process: `url`, `state`, and `close()`."""

    def __init__(self, config: ServeConfig, engine=None, tokenizer=None):
        self.state = ServerState(config, engine, tokenizer)
        self.sock = bind(config.host, config.port)
        self.state.port = self.sock.getsockname()[1]
        self.url = url_of(self.sock)
        self.server = _server(self.state, config)  # off the main thread, uvicorn leaves signals alone
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="rlbench-serve"
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def serve_in_thread(config: ServeConfig, engine=None, tokenizer=None) -> ServingThread:
    return ServingThread(config, engine, tokenizer)
