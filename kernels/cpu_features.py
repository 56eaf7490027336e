"""What this CPU can run, read from /proc/cpuinfo (no torch import: the launcher plans memory
with it before any engine starts)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_avx512() -> bool:
    """AVX-512 Foundation: the fp32 panel kernels (`kernels.cpu_gemv`) run."""
    return "avx512f" in cpu_flags()


def has_bf16_instructions() -> bool:
    """This CPU computes bf16 products natively (AVX512-BF16; every AMX CPU has it too)."""
    return "avx512_bf16" in cpu_flags()


def resolve_cpu_dtype(dtype: str) -> str:
    """--dtype on the CPU, vLLM's aliases already resolved: "auto" is bfloat16 where the CPU
    has AVX512-BF16 (as vLLM's CPU backend picks it), else float32; others as given.

    Raises:
        ValueError: bfloat16 on a CPU without AVX512-BF16 (no fast path: refused).
    """
    if dtype == "auto":
        return "bfloat16" if has_bf16_instructions() else "float32"
    if dtype == "bfloat16" and not has_bf16_instructions():
        raise ValueError("--dtype bfloat16 on CPU needs AVX512-BF16 (or AMX), which this CPU "
                         "lacks: use --dtype float32")
    return dtype
