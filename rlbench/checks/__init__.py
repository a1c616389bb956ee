"""Checks over run directories: the verdicts of `rlbench check` and `rlbench golden update`.

compare.py           the first index where two id sequences part, with context
tito.py              token-in-token-out drift: id comparison, drift-mode classification, findings
tito_audit.py        check tito --audit: a chat template over generated conversation shapes
tito_shapes.py       the conversation shapes the audit plays
tito_reasoning.py    the audit's reasoning probe: the forms a template reads reasoning in, a turn as sampled
tito_run.py          check tito RUN: trained vs sampled ids, canonical ids, evidence, re-render
tito_jsonl.py        check tito JSONL: trajectories {messages, token_ids} against the template's re-render
tito_report.py       what check tito reports: each finding where it is, the counts each lens kept
tito_builders.py     the token-in-token-out builders check tito --audit plays
tito_miles.py        Miles' TITO library (miles-tito-tokenizers) as rlbench uses it
logprobs.py          check logprobs: train-inference log-prob mismatch statistics and gates
attribution.py       check logprobs --attribute: the mismatch split into a chain of links, token by token
attribution_run.py   the chain's states for an rlbench run: engine, trainer, weights by version
attribution_weights.py  the weights of each version (verified as read) and the model copies they load into
attribution_http.py  the engine's state asked of an SGLang server over its native API (--engine-url)
golden.py            golden files (rlbench's and Megatron-LM's): format and reading
golden_build.py      golden files written: golden update, golden/regenerate.py
golden_tolerance.py  tolerance families, their defaults, --tolerance overrides
golden_compare.py    check golden: tiers, refusals with the reason, per-metric comparison, report
golden_history.py    history files: the last N trusted runs, the band rule, golden update --tier history
golden_history_compare.py  check golden --tier history: each value against its band, report
plot.py              check golden --plot: each metric against its golden band (matplotlib)
engine_cert.py       check engine: an SGLang server's answers alone, batched, prefix-cached, held bit for bit
"""
