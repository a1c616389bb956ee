"""`rlbench serve`: the embedded engine behind SGLang's native HTTP API (rlbench/serve/)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlbench.cli import Debug, app, stdout
from rlbench.serve.server import LISTENING, ServeConfig

_DEFAULT = ServeConfig()


class Decode(str, Enum):
    batched = "batched"
    per_sample = "per-sample"


@app.command()
def serve(
    model_path: Annotated[Optional[Path], typer.Option(help="Model directory: config.json and, optionally, model.safetensors (else seeded weights, --random-seed). \\[default: the fixture model]")] = None,
    tokenizer_path: Annotated[Optional[Path], typer.Option(help="Tokenizer directory. \\[default: the fixture tokenizer]")] = None,
    host: Annotated[str, typer.Option(help="Address to bind. The API has no authentication: 0.0.0.0 serves every machine that can reach this one.")] = _DEFAULT.host,
    port: Annotated[int, typer.Option(help="Port to bind; 0 takes a free one (the first line printed says which).", min=0, max=65535)] = _DEFAULT.port,
    random_seed: Annotated[int, typer.Option(help="Seed of the initial weights when the model directory has none (the run's --seed gives the same weights).", min=0)] = _DEFAULT.random_seed,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = _DEFAULT.dtype,
    device: Annotated[str, typer.Option(help="cpu or cuda[:N].")] = _DEFAULT.device,
    threads: Annotated[int, typer.Option(help="torch CPU threads (a request's bits depend on it: keep the run's).", min=1)] = _DEFAULT.threads,
    decode: Annotated[Decode, typer.Option(help="The engine's decode path (rollout.decode): keep the run's to get its bits.")] = Decode(_DEFAULT.decode),
    decode_batch_size: Annotated[int, typer.Option(help="Rows of every batched decode forward (rollout.decode_batch_size): keep the run's.", min=1)] = _DEFAULT.decode_batch_size,
    batch_wait_ms: Annotated[float, typer.Option(help="While requests keep arriving this close together, gather them into one engine batch.", min=0)] = _DEFAULT.batch_wait_ms,
    weight_version: Annotated[str, typer.Option(help="The weight version reported until the first update.")] = _DEFAULT.weight_version,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = _DEFAULT.log_level,
    debug: Debug = False,
) -> None:
    """Serve the embedded engine behind SGLang's native HTTP API: /generate, /health, /health_generate, /server_info, /model_info, /update_weights_from_disk, /flush_cache, /weights_checker, /get_weights_by_name.

    sglang-router and `rlbench run --rollout sglang` talk to it as to an SGLang server. Concurrent requests are decoded together by the batched, batch-invariant engine: a request's tokens and log-probs depend on the request alone. Binds 127.0.0.1 unless --host says otherwise. Stop it with Ctrl-C.
    """
    from rlbench.serve.server import serve as run_server

    config = ServeConfig(model_path=str(model_path or _DEFAULT.model_path),
                         tokenizer_path=str(tokenizer_path or _DEFAULT.tokenizer_path), host=host, port=port,
                         random_seed=random_seed, dtype=dtype, device=device, threads=threads, decode=decode.value,
                         decode_batch_size=decode_batch_size, batch_wait_ms=batch_wait_ms,
                         weight_version=weight_version, log_level=log_level)

    def announce(url: str) -> None:
        scope = "this machine only" if host in ("127.0.0.1", "localhost", "::1") else "every address of this machine"
        stdout.print(f"{LISTENING}{url} (bound to {host}: {scope}; SGLang's native API; Ctrl-C stops)",
                     markup=False, highlight=False, soft_wrap=True)
        stdout.file.flush()

    run_server(config, announce)
