"""diff's advice where two runs of different parallel layouts part by a gap rounding can make (issue 24): rerun
both in float64."""

from __future__ import annotations

from rlbench.rundir.directory import CHECKSUM_KEYS

# Rounding reaches these stages when only the reduction order differs (the engine's log-probs through the
# weights the trainer synced); tokens, rewards and advantages part only by a discrete change.
ROUNDED_STAGES = tuple(
    key for key in CHECKSUM_KEYS if key not in ("data", "rollout_tokens", "rewards", "advantages", "engine_weights")
)
# TP/DP reduction-order noise, TP=2 against TP=1. float32: 2.4e-6 relative in a minibatch loss at step 1 of the
# default run, 2.5e-6 by step 9, and more as runs train apart; the q/k-norm all-reduce bug parts them by 3.0e-6 (a
# small config, docs/benchmarks.md) to 2.0e-4 (the default run). bf16: 1.2e-2 (Qwen3-1.7B shape) and 1.4e-2 (4B)
# in step 0's old log-probs on four GPUs. Up to the coarser dtype's gap, a difference between layouts can be either.
NOISE_GAP = {"float32": 1e-3, "bfloat16": 5e-2}


def layout_advice(manifest_a: dict, manifest_b: dict, first) -> str | None:
    """Advice where two runs of different parallel layouts (tp, dp) part by a gap float32 or bf16 rounding can
    make: rerun both in float64, where that noise is ~1e-16 and a bug stays. None otherwise: no difference, the
    same layout (or one the manifests do not say), both runs float64, a discrete stage, a gap larger than the
    coarser dtype's noise, or a gap that is not known (a checksum alone)."""
    if first is None or first.stage not in ROUNDED_STAGES or first.max_rel is None:
        return None
    configs = [m.get("config") if isinstance(m.get("config"), dict) else {} for m in (manifest_a, manifest_b)]
    layouts = [(c.get("tp"), c.get("dp")) for c in configs]
    dtypes = [c["model"].get("dtype") if isinstance(c.get("model"), dict) else None for c in configs]
    if None in layouts[0] + layouts[1] or layouts[0] == layouts[1] or None in dtypes or dtypes == ["float64"] * 2:
        return None
    coarse = "bfloat16" if "bfloat16" in dtypes else "float32"
    if first.max_rel > NOISE_GAP[coarse]:
        return None
    shown = "; ".join(f"{side}: tp {tp}, dp {dp}, {dtype}" for side, (tp, dp), dtype in zip("AB", layouts, dtypes))
    return (
        f"the runs differ in parallel layout ({shown}) and part by {first.max_rel:.2g} relative, a gap {coarse} "
        "rounding can make: TP/DP reduction order alone moves float32 values by ~1e-6 relative at the first "
        "update (bf16's by ~1e-2 at real sizes), and more as the runs train apart, while a real bug such as an "
        'unreduced q/k-norm gradient parts them by as little as 3e-6. To tell which, rerun both with dtype = "float64" '
        "in the [model] table of --config (the CPU and the embedded engine only), where that noise is ~1e-16 and a "
        "bug stays as large, and compare them with --rtol 1e-12"
    )
