"""The kernel cache (`kernels/cpu_build.py`): a library is compiled once per host and build
(source, defines, flags, compiler, CPU), then loaded from the cache by every later process;
a cached file that does not load is rebuilt; a cache that cannot be written only costs the
compile."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from pdserve.kernels import cpu_build

SOURCE = """
int answer(void) { return ANSWER; }
"""
FLAGS = ((("-O2",), ()),)


@pytest.fixture
def compiler():
    found = cpu_build.find_compiler()
    if found is None:
        pytest.skip("no C compiler")
    return found


@pytest.fixture
def compiles(monkeypatch) -> list[list[str]]:
    """Every compiler command run (the `-c` step of each build)."""
    seen: list[list[str]] = []
    real = subprocess.run

    def counting(command, *args, **kwargs):
        if "-c" in command:
            seen.append(list(command))
        return real(command, *args, **kwargs)

    monkeypatch.setattr(cpu_build.subprocess, "run", counting)
    return seen


def _build(compiler, source, defines, build_dir):
    build_dir.mkdir()  # a build directory exists (the callers' temporary ones)
    return cpu_build.build_library(compiler, source, defines, FLAGS, build_dir)


def _built_once(tmp_path, monkeypatch, compiler, define):
    """A cache under tmp_path holding the one library `define` builds: (source, its file)."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    _build(compiler, source, [define], tmp_path / "b1")
    (cached,) = (tmp_path / "cache").glob("answer-*.so")
    return source, cached


def _answer(library) -> int:
    return ctypes.CDLL(str(library)).answer()


def test_a_build_is_compiled_once_then_loaded_from_the_cache(tmp_path, monkeypatch, compiler,
                                                             compiles):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    first = _build(compiler, source, ["-DANSWER=41"], tmp_path / "b1")
    assert first == tmp_path / "b1" / "answer.so" and _answer(first) == 41
    assert len(compiles) == 1
    cached = _build(compiler, source, ["-DANSWER=41"], tmp_path / "b2")
    assert cached.parent == tmp_path / "cache" and _answer(cached) == 41
    assert len(compiles) == 1  # not compiled again
    # another define, another source text: each its own build
    other = _build(compiler, source, ["-DANSWER=42"], tmp_path / "b3")
    assert _answer(other) == 42 and len(compiles) == 2
    source.write_text(SOURCE.replace("ANSWER", "ANSWER + 1"))
    changed = _build(compiler, source, ["-DANSWER=42"], tmp_path / "b4")
    assert _answer(changed) == 43 and len(compiles) == 3
    assert len(list((tmp_path / "cache").glob("answer-*.so"))) == 3
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_cached_file_that_does_not_load_is_rebuilt(tmp_path, monkeypatch, compiler,
                                                     compiles):
    source, cached = _built_once(tmp_path, monkeypatch, compiler, "-DANSWER=7")
    cached.write_bytes(b"not an ELF file")
    library = _build(compiler, source, ["-DANSWER=7"], tmp_path / "b2")
    assert _answer(library) == 7 and len(compiles) == 2
    assert _answer(cached) == 7  # the cache holds the rebuilt library again


def test_a_truncated_library_is_never_loaded(tmp_path, monkeypatch, compiler, compiles):
    """A cut ELF file can pass dlopen's first checks and kill the process with SIGBUS when
    mapped: its bytes no longer hash to its name, so it is skipped and rebuilt."""
    source, cached = _built_once(tmp_path, monkeypatch, compiler, "-DANSWER=8")
    cached.write_bytes(cached.read_bytes()[:len(cached.read_bytes()) // 2])
    loaded = []
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **k: loaded.append(str(path))
                        or real_cdll(path, *a, **k))
    library = _build(compiler, source, ["-DANSWER=8"], tmp_path / "b2")
    assert str(cached) not in loaded  # the cache never dlopens a file it has not verified
    assert _answer(library) == 8 and len(compiles) == 2


def test_a_bad_file_that_cannot_be_removed_is_skipped(tmp_path, monkeypatch, compiler,
                                                      compiles):
    source, cached = _built_once(tmp_path, monkeypatch, compiler, "-DANSWER=9")
    cached.write_bytes(b"junk")

    real_unlink = Path.unlink

    def refuse(path):
        raise PermissionError(1, "Operation not permitted", str(path))

    def unlink(self, *args, **kwargs):  # the bad file cannot go (an immutable cache)
        return refuse(self) if self == cached else real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(cpu_build.Path, "unlink", unlink)
    monkeypatch.setattr(cpu_build.os, "replace", lambda src, dst: refuse(dst))
    for n in (2, 3):  # every start compiles, none fails
        library = _build(compiler, source, ["-DANSWER=9"], tmp_path / f"b{n}")
        assert _answer(library) == 9 and len(compiles) == n
    monkeypatch.undo()
    assert cached.read_bytes() == b"junk"
    assert not list((tmp_path / "cache").glob("*.partial"))  # the failed writes cleaned up


def test_an_unwritable_cache_only_costs_the_compile(tmp_path, monkeypatch, compiler, compiles):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE_DIR", str(blocker / "cache"))
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    for n in (1, 2):
        library = _build(compiler, source, ["-DANSWER=5"], tmp_path / f"b{n}")
        assert _answer(library) == 5 and len(compiles) == n


def test_the_key_names_the_compiler_and_the_cpu(tmp_path, monkeypatch, compiler):
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    key = cpu_build.build_key(compiler, source, ["-DANSWER=1"], FLAGS)
    assert key == cpu_build.build_key(compiler, source, ["-DANSWER=1"], FLAGS)
    monkeypatch.setattr(cpu_build, "_cpu_identity", lambda: "model name: another CPU")
    assert cpu_build.build_key(compiler, source, ["-DANSWER=1"], FLAGS) != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu_build, "_compiler_identity", lambda c: "/usr/bin/cc\nother 1.0")
    assert cpu_build.build_key(compiler, source, ["-DANSWER=1"], FLAGS) != key
