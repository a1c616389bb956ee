"""Checks over run directories: the verdicts of `rlbench check` and `rlbench golden update`.

    compare.py           the first index where two id sequences part, with context
    tito.py              token-in-token-out drift: id comparison, drift-mode classification, findings
    tito_audit.py        check tito --audit: a chat template over generated conversation shapes
    tito_run.py          check tito RUN|JSONL: trained vs sampled ids, canonical ids, evidence, re-render
    logprobs.py          check logprobs: train-inference log-prob mismatch statistics and gates
    golden.py            golden files (rlbench's and Megatron-LM's): format, reading, golden update
    golden_tolerance.py  tolerance families, their defaults, --tolerance overrides
    golden_compare.py    check golden: tiers, refusals with the reason, per-metric comparison, report
    plot.py              check golden --plot: each metric against its golden band (matplotlib)
"""
