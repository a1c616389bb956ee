"""Where a run's pieces run: in-process by default; `ray.py` for `--placement ray` (imported only then)."""
