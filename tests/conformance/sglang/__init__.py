"""Assertions ported from SGLang's own tests about its native HTTP API (each test names its source and
version), run against `rlbench serve` (started in-process, one per module) or any SGLang server:

    RLBENCH_SGLANG_URL=http://HOST:PORT pytest tests/conformance/sglang

What `rlbench serve` cannot do is listed in docs/sglang-ray.md (the section "What rlbench serve
refuses"); those requests get SGLang's error answers, which test_errors.py holds to SGLang's shapes.
"""
