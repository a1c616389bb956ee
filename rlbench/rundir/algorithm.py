"""The run directory's schema and the checksum algorithm a run directory's tensor checksums use, by name, and why a
directory or recording
that names another (or none: an older rlbench's sha256) is refused. Apart from digest.py, which computes it,
so that readers of the logs alone (check golden, diff's first pass) name it without importing torch."""

from __future__ import annotations

# The run directory's schema: the manifest's, and each recording's header's and metadata's.
SCHEMA = "rlbench.run/1"

# Every tensor checksum of a run directory (checksums.jsonl, the recordings' headers, the manifest's initial
# weights) is of this algorithm; the manifest's "checksum" and each recording's header name it.
CHECKSUM = "wordsum/1"


def older_checksums(got: object) -> str:
    """Why a run directory or recording whose checksum algorithm is `got` (None: not named) cannot be read."""
    if got is None:
        return (
            f"written with sha256 checksums by an older rlbench; this rlbench checksums with {CHECKSUM} and "
            "cannot verify them: read it with the rlbench that wrote it, or run it again"
        )
    return f"checksums of algorithm {got!r}; this rlbench reads {CHECKSUM!r} only"
