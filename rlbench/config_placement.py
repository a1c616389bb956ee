"""The run config's placement section: where the loop's parts run (in this process, or as Ray actors of a
local or named Ray instance), and how a Ray address is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rlbench.config_sections import setting
from rlbench.errors import BadInput
from rlbench.validate import check, number, text

RAY_TIMEOUT = 60.0  # seconds: a Ray cluster that is up accepts a connection in a few


@dataclass(frozen=True)
class PlacementConfig:
    """Where the pieces run. `local`: the trainer and the embedded engine in this process (the
    servers rlbench starts as processes of this machine). `ray`: the trainer and the rollout engines
    as Ray actors in one placement group, slime's shape (rlbench/placement/ray.py)."""

    backend: Literal["local", "ray"] = setting(
        "local",
        "local: this process (and the processes it starts). ray: the trainer and the rollout engines as Ray actors in"
        " one placement group (pip install '.[ray]').",
    )
    ray_address: str | None = setting(
        None,
        "ray: an existing Ray cluster (auto, HOST:6379 or ray://HOST:10001); none: rlbench starts a local Ray "
        "instance, on 127.0.0.1.",
    )
    ray_timeout: float = setting(
        RAY_TIMEOUT,
        "ray: seconds the cluster at --ray-address has to accept the connection; after them the run stops (exit 2).",
    )
    num_cpus: int | None = None  # the Ray instance rlbench starts: its logical CPUs (default: the machine's)

    def __post_init__(self) -> None:
        check(self.backend in ("local", "ray"), "placement.backend", "local or ray", self.backend)
        text(self.ray_address, "placement.ray_address", optional=True)
        if self.ray_address is not None:
            ray_address_parts(self.ray_address)
        number(self.ray_timeout, "placement.ray_timeout", 0, 86_400, open_low=True)
        if self.num_cpus is not None:
            number(self.num_cpus, "placement.num_cpus", 1, 100_000, integer=True)
        check(
            self.backend == "ray" or (self.ray_address is None and self.num_cpus is None),
            "placement.ray_address",
            "unset unless placement.backend is ray (--placement ray)",
            self.ray_address or self.num_cpus,
        )
        check(
            self.backend == "ray" or self.ray_timeout == RAY_TIMEOUT,
            "placement.ray_timeout",
            "the default unless placement.backend is ray (--placement ray)",
            self.ray_timeout,
        )


def ray_address_parts(address: str) -> tuple[str, str | None, int | None]:
    """A Ray cluster address as (scheme, host, port): `auto` (Ray finds the cluster of this machine),
    `HOST:PORT` (its GCS) or `ray://HOST:PORT` (Ray's client server); BadInput for anything else, naming
    what is wrong, before anything tries to connect."""
    key = "placement.ray_address"
    if address == "auto":
        return "auto", None, None
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    expected = "auto, HOST:PORT (the cluster's GCS, e.g. 10.0.0.2:6379) or ray://HOST:PORT (Ray's client)"
    if scheme not in ("", "ray"):
        hint = " (an http address is the dashboard's; the cluster's is HOST:6379)" if scheme.startswith("http") else ""
        raise BadInput(f"expected {expected}, got the scheme {scheme!r}{hint}", field=key)
    host, _, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    name = host[1:-1] if bracketed else host
    if not name or not re.fullmatch(r"[0-9a-fA-F:.]+" if bracketed else r"[A-Za-z0-9_.-]+", name):
        raise BadInput(f"expected {expected}, got {address!r} (no host name or IP address before :PORT)", field=key)
    if not (port.isdigit() and 1 <= int(port) <= 65_535):
        raise BadInput(f"expected {expected} with a port in 1..65535, got {address!r}", field=key)
    return scheme or "gcs", name, int(port)
