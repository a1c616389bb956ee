"""Plugins written to slime's contract (rlbench/core/slime_contract.py), for the tests: each the shape of a case
slime's own contract tests or examples name."""
