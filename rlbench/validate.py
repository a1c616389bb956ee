"""Validation of settings, shared by every config (the run's, `rlbench serve`'s): a value that fails
raises `BadInput` naming its key, what was expected and what came. The lowest layer after errors.py:
it imports nothing else of rlbench."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlparse

from rlbench.errors import BadInput


def check(ok: bool, key: str, expected: str, got: Any) -> None:
    """`ok`, or BadInput: "KEY: expected EXPECTED, got GOT"."""
    if not ok:
        raise BadInput(f"expected {expected}, got {got!r}", field=key)


def number(value: Any, key: str, low: float, high: float, *, integer: bool = False, open_low: bool = False) -> None:
    """A finite number (an integer where `integer`) in [low, high] ((low, high] with `open_low`): every
    number a run is configured with is held to a sane range before anything runs on it."""
    kind = int if integer else (int, float)
    ok = (
        isinstance(value, kind)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if open_low else value >= low)
        and value <= high
    )
    what = "an integer" if integer else "a finite number"
    check(ok, key, f"{what} in {'(' if open_low else '['}{_bound(low)}, {_bound(high)}]", value)


def _bound(x: float) -> str:
    return "2**63 - 1" if x == 2**63 - 1 else f"{x:,}" if float(x).is_integer() else f"{x:g}"


def text(value: Any, key: str, optional: bool = False) -> None:
    """A string without NUL (or None where `optional`)."""
    check(
        (isinstance(value, str) and "\x00" not in value) or (optional and value is None),
        key,
        "a string (without NUL)",
        value,
    )


def normalize_url(addr: str, field: str = "rollout.external_engine_addrs") -> str:
    """`host:port` or `http://host:port` as a base URL (slime's normalize_external_engine_addr)."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/")
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None:
        raise BadInput(f"expected host:port or http://host:port (IPv6 in brackets), got {addr!r}", field=field)
    return url


def check_async(rollout) -> None:
    """The async rollout settings (core/pipeline.py), together."""
    mode, bound, interval = rollout.async_mode, rollout.max_staleness, rollout.update_weights_interval
    check(mode in ("off", "one-step", "fully"), "rollout.async_mode", "off, one-step or fully", mode)
    number(interval, "rollout.update_weights_interval", 1, 1_000_000, integer=True)
    check(
        mode != "off" or interval == 1,
        "rollout.update_weights_interval",
        "1 without --async (slime's train.py syncs every rollout; the interval is train_async.py's)",
        interval,
    )
    if mode == "fully":
        check(bound is not None, "rollout.max_staleness", "a bound for --async fully (slime's has none)", bound)
        number(bound, "rollout.max_staleness", 0, 1_000_000, integer=True)
        check(
            bound >= interval - 1,
            "rollout.max_staleness",
            f"at least update_weights_interval - 1 = {interval - 1} (the engine lags that far between syncs)",
            bound,
        )
    else:
        check(
            bound is None, "rollout.max_staleness", "unset unless --async fully (one-step lags by the interval)", bound
        )


def check_weight_sync(rollout) -> None:
    """slime's delta weight sync settings (core/weight_delta.py): with SGLang servers only."""
    mode = rollout.update_weight_mode
    check(mode in ("full", "delta"), "rollout.update_weight_mode", "full or delta", mode)
    check(
        mode == "full" or rollout.backend == "sglang",
        "rollout.update_weight_mode",
        "full with the embedded engine (delta sync is to SGLang servers over disk: --rollout sglang)",
        mode,
    )
    check(
        rollout.update_weight_delta_encoding in ("xor", "overwrite"),
        "rollout.update_weight_delta_encoding",
        "xor or overwrite",
        rollout.update_weight_delta_encoding,
    )
    check(
        rollout.update_weight_delta_checksum in ("xxh3-128", "blake3", "adler32"),
        "rollout.update_weight_delta_checksum",
        "xxh3-128, blake3 or adler32",
        rollout.update_weight_delta_checksum,
    )
    text(rollout.local_checkpoint_dir, "rollout.local_checkpoint_dir", optional=True)


def check_memory(config) -> None:
    """The memory-saving settings (slime's and Megatron's): recompute, optimizer offload, rollout offload."""
    for name in ("train.recompute", "train.optimizer_cpu_offload", "rollout.offload"):
        section, _, field = name.partition(".")
        value = getattr(getattr(config, section), field)
        check(isinstance(value, bool), name, "true or false", value)
    check(
        not config.train.optimizer_cpu_offload or config.train.backend == "torch",
        "train.optimizer_cpu_offload",
        "false with train.backend megatron (megatron-core's HybridDeviceOptimizer is not wired in)",
        True,
    )
    rollout = config.rollout
    check(
        not rollout.offload or rollout.backend == "hf",
        "rollout.offload",
        "false with rollout.backend sglang (the servers' memory is theirs to manage)",
        True,
    )
    check(
        not rollout.offload or rollout.async_mode == "off",
        "rollout.offload",
        "false with async rollouts (the engine generates while the trainer trains)",
        True,
    )
