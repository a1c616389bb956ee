"""Conformance of the SGLang client with a server given by RLBENCH_SGLANG_URL (skipped without one)."""
