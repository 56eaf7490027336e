"""kernels/cpu_features.py: the CPU's flags and the CPU --dtype resolution."""

from __future__ import annotations

import builtins

import pytest

from pdserve.kernels import cpu_features


@pytest.fixture
def flags(monkeypatch):
    """Replace the CPU's flags with a chosen set (cpu_flags is cached per process)."""
    def use(*names: str) -> None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(names))
    return use


def test_flags_are_read_from_proc_cpuinfo():
    flags = cpu_features.cpu_flags()
    with open("/proc/cpuinfo") as f:
        line = next(x for x in f if x.startswith("flags"))
    assert flags == frozenset(line.split(":", 1)[1].split())
    assert cpu_features.has_avx512() == ("avx512f" in flags)
    assert cpu_features.has_bf16_instructions() == ("avx512_bf16" in flags)


def test_unreadable_cpuinfo_means_no_flags(monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    cpu_features.cpu_flags.cache_clear()
    monkeypatch.setattr(builtins, "open", refuse)
    try:
        assert cpu_features.cpu_flags() == frozenset()
        assert not cpu_features.has_avx512() and not cpu_features.has_bf16_instructions()
        assert cpu_features.resolve_cpu_dtype("auto") == "float32"
    finally:
        monkeypatch.undo()
        cpu_features.cpu_flags.cache_clear()


def test_auto_is_bf16_only_with_avx512_bf16(flags):
    flags("avx512f", "avx512_bf16")
    assert cpu_features.resolve_cpu_dtype("auto") == "bfloat16"
    assert cpu_features.resolve_cpu_dtype("bfloat16") == "bfloat16"
    assert cpu_features.resolve_cpu_dtype("float32") == "float32"
    flags("avx512f", "avx2")
    assert cpu_features.resolve_cpu_dtype("auto") == "float32"
    assert cpu_features.resolve_cpu_dtype("float16") == "float16"  # not this function's call


def test_bf16_without_the_instructions_is_refused_in_one_line(flags):
    flags("avx2", "fma")
    with pytest.raises(ValueError) as e:
        cpu_features.resolve_cpu_dtype("bfloat16")
    assert "\n" not in str(e.value)
    assert "AVX512-BF16" in str(e.value) and "--dtype float32" in str(e.value)
