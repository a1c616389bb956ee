"""`rlbench serve`: the embedded engine behind SGLang's native HTTP API (rlbench/serve/)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

from rlbench.cli.app import Debug, app, stdout
from rlbench.cli.options import config_option, overrides
from rlbench.backends.sglang.wire import LISTENING
from rlbench.keys import SERVE_API_KEY_ENV
from rlbench.serve.server import LOOPBACK, ServeConfig

_DEFAULT = ServeConfig()


def _choices(name: str, values) -> type[Enum]:
    return Enum(name, {value: value for value in values}, type=str)


LoadFormat = _choices("LoadFormat", ("auto", "dummy"))
DType = _choices("DType", ("float32", "bfloat16"))
Decode = _choices("Decode", ("batched", "per-sample"))
LogLevel = _choices("LogLevel", ("critical", "error", "warning", "info", "debug", "trace"))


def _option(path: str, *names: str, **kwargs):
    return config_option(path, *names, root=ServeConfig, **kwargs)


@app.command()
def serve(
    model_path: Annotated[
        Optional[Path], _option("model_path", default_text="the fixture policy `rlbench run` starts from")
    ] = None,
    load_format: Annotated[Optional[LoadFormat], _option("load_format")] = None,
    tokenizer_path: Annotated[Optional[Path], _option("tokenizer_path", default_text="the fixture tokenizer")] = None,
    host: Annotated[Optional[str], _option("host")] = None,
    port: Annotated[Optional[int], _option("port", min=0, max=65535)] = None,
    random_seed: Annotated[Optional[int], _option("random_seed", min=0)] = None,
    dtype: Annotated[Optional[DType], _option("dtype")] = None,
    device: Annotated[Optional[str], _option("device")] = None,
    threads: Annotated[Optional[int], _option("threads", min=1)] = None,
    decode: Annotated[Optional[Decode], _option("decode")] = None,
    decode_batch_size: Annotated[Optional[int], _option("decode_batch_size", min=1)] = None,
    batch_wait_ms: Annotated[Optional[float], _option("batch_wait_ms", min=0)] = None,
    batch_variant: Annotated[bool, _option("batch_variant", "--batch-variant", flag_value=True)] = False,
    weight_version: Annotated[Optional[str], _option("weight_version")] = None,
    log_level: Annotated[Optional[LogLevel], _option("log_level")] = None,
    context_length: Annotated[Optional[int], _option("context_length", min=8)] = None,
    skip_tokenizer_init: Annotated[
        bool, _option("skip_tokenizer_init", "--skip-tokenizer-init", flag_value=True)
    ] = False,
    incremental_streaming_output: Annotated[
        bool, _option("incremental_streaming_output", "--incremental-streaming-output", flag_value=True)
    ] = False,
    stream_output: Annotated[
        bool, _option("incremental_streaming_output", "--stream-output", flag_value=True, hidden=True)
    ] = False,  # SGLang's earlier name, kept out of --help
    max_request_bytes: Annotated[Optional[int], _option("max_request_bytes", min=1024)] = None,
    api_key: Annotated[
        Optional[str], _option("api_key", "--api-key", envvar=SERVE_API_KEY_ENV, show_envvar=True, default_text="none")
    ] = None,
    allow_unauthenticated: Annotated[
        bool, _option("allow_unauthenticated", "--allow-unauthenticated", flag_value=True)
    ] = False,
    weights_dir: Annotated[
        Optional[Path], _option("weights_dir", default_text="any readable path (loopback or keyed)")
    ] = None,
    debug: Debug = False,
) -> None:
    """Serve the embedded engine behind SGLang's native HTTP API: /generate (batches, n, streaming), /health, \
/health_generate, /server_info, /model_info, /abort_request, /pause_generation, /continue_generation, \
/update_weights_from_disk, /update_weight_version, /flush_cache, /weights_checker, /get_weights_by_name, /v1/loads.

    sglang-router and `rlbench run --rollout sglang` talk to it as to an SGLang server. Concurrent requests are \
decoded together by the batched, batch-invariant engine: a request's tokens and log-probs depend on the request alone. \
What it cannot do is refused with SGLang's error answer (docs/sglang-ray.md). Binds 127.0.0.1 unless --host says \
otherwise; beyond loopback it needs --api-key (or --allow-unauthenticated). Stop it with Ctrl-C.
    """
    from rlbench.extras import SERVE_EXTRA, SERVE_MODULES, require
    from rlbench.serve.server import serve as run_server

    require(SERVE_MODULES, SERVE_EXTRA, "rlbench serve")  # before the model loads or anything listens
    given = overrides(serve, {name: value for name, value in locals().items() if name != "debug"})
    config = ServeConfig(**given)
    host = config.host

    def announce(url: str) -> None:
        scope = "this machine only" if host in LOOPBACK else "every address of this machine"
        scope += "; requests need the api key" if config.api_key else "; no api key"
        stdout.print(
            f"{LISTENING}{url} (bound to {host}: {scope}; SGLang's native API; Ctrl-C stops)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        stdout.file.flush()

    run_server(config, announce)
