"""Portable CPU numerics: what decides a CPU run's bits, pinned so x86-64 CPUs of both vendors agree.

Measured with bench/cpu_numerics.py (per-operation digests and whole runs, on an AMD EPYC with AVX2
and an Intel Xeon with AVX-512; torch 2.13 and 2.11 agreed with each other on every digest):

- MKL picks its GEMM and vector-math (VML) kernels by CPU. On Intel it takes the AVX-512 kernels,
  on AMD a generic path, and the sums come out in another order. `MKL_CBWR=COMPATIBLE` puts both
  vendors on the same code path. The AVX2 branch does not: MKL ignores it on AMD.
- ATen's own kernels (reductions, softmax, attention, the small GEMMs it computes itself) are built
  once per instruction set and dispatched by CPU. `ATEN_CPU_CAPABILITY=avx2` fixes the vector width,
  and with it the summation order, on every CPU that has AVX2.
- One operation still differed under both settings: MKL's VML `sqrt` is not correctly rounded on
  AMD, so `torch.sqrt` on CPU float tensors parts the vendors. The torch trainer's AdamW is therefore
  the fused kernel, whose sqrt is the vector instruction (exact on every CPU). New code on this path
  must not call `torch.sqrt` on CPU tensors.

Both variables are read once, when torch initialises, so `pin()` runs when rlbench is imported,
before rlbench imports torch; it never overrides what the user set. With
`RLBENCH_CPU_NUMERICS=native` nothing is pinned (the CPU's fastest paths, bits per machine).
`identity()` reports what is in effect, read back from torch and MKL rather than from the
environment, so a run whose torch was imported before rlbench pinned anything says so in its manifest.
"""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache

PORTABLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
MODE_VARIABLE = "RLBENCH_CPU_NUMERICS"
# MKL's constants (mkl_service.h): the branch mkl_cbwr_get(MKL_CBWR_BRANCH) returns.
_CBWR_BRANCH = 1
_CBWR_NAMES = {
    0: "OFF",
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}


def mode() -> str:
    """'portable' (the default) or 'native'."""
    value = os.environ.get(MODE_VARIABLE, "portable").strip().lower()
    return "native" if value == "native" else "portable"


def pin() -> None:
    """Set the portable settings in the environment, unless the user chose otherwise or torch is
    already loaded (then `identity()` records what is in effect instead)."""
    if mode() != "portable" or "torch" in sys.modules:
        return
    for key, value in PORTABLE.items():
        os.environ.setdefault(key, value)


def _mkl_branch() -> str | None:
    """The MKL conditional-numerical-reproducibility branch in effect, read from MKL itself."""
    import ctypes

    import torch

    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        getter = ctypes.CDLL(library).mkl_serv_cbwr_get
    except (OSError, AttributeError):  # not MKL (another BLAS), or not Linux
        return None
    getter.restype, getter.argtypes = ctypes.c_int, [ctypes.c_int]
    code = getter(_CBWR_BRANCH)
    return _CBWR_NAMES.get(code, str(code))


def _blas() -> str | None:
    import torch

    for line in torch.__config__.show().splitlines():
        line = line.strip(" -")
        if "Math Kernel Library" in line:  # "Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build ..."
            version = line.split("Version", 1)[-1].split("-")[0].strip()
            return f"MKL {version}"
        if line.startswith("BLAS_INFO") or "OpenBLAS" in line:
            return line
    return None


@lru_cache(maxsize=1)
def cpu() -> dict:
    """The CPU: vendor, model and x86-64 ISA level (v2/v3/v4), from /proc/cpuinfo where there is one."""
    info = {"machine": platform.machine(), "vendor": None, "model": None, "isa": None}
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    info["vendor"], info["model"] = fields.get("vendor_id"), fields.get("model name")
    if flags:
        v2 = {"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16"} <= flags
        v3 = v2 and {"avx", "avx2", "bmi1", "bmi2", "fma", "f16c", "movbe"} <= flags
        v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags
        info["isa"] = "x86-64-v4" if v4 else "x86-64-v3" if v3 else "x86-64-v2" if v2 else "x86-64"
    return info


def identity() -> dict:
    """What decides a CPU run's bits, as in effect in this process (torch is imported). `mode` is
    'portable' only when the portable settings are in effect; 'native' when asked for; else 'custom'
    (the user set other values, or torch was initialised before rlbench could pin them)."""
    import torch

    found = {"aten_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": _mkl_branch()}
    portable = found["aten_capability"] == PORTABLE["ATEN_CPU_CAPABILITY"].upper() and found["mkl_cbwr"] in (
        PORTABLE["MKL_CBWR"],
        None,
    )
    kind = "portable" if portable else ("native" if mode() == "native" else "custom")
    return {"mode": kind, **found, "blas": _blas(), "cpu": cpu()}


def platform_class(numerics: dict | None, device: str) -> dict:
    """The part of `identity()` that must agree for two CPU runs to be expected to agree bit for bit.
    Portable mode leaves the CPU out (shown to agree across vendors and ISA levels); native mode
    keeps the vendor and the ISA level, since the fastest paths differ by both."""
    if not device.startswith("cpu") or not numerics:
        return {}
    out = {k: numerics.get(k) for k in ("mode", "aten_capability", "mkl_cbwr", "blas")}
    if numerics.get("mode") != "portable":
        out.update({k: (numerics.get("cpu") or {}).get(k) for k in ("vendor", "isa")})
    return out
