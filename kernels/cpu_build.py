"""Builds the C files of `kernels/csrc/` at first use (the system C compiler + OpenMP).

Shared by `cpu_native.py` (paged attention), `cpu_fused.py` (norms, RoPE, SiLU-and-mul),
`cpu_gemv.py`, `cpu_int8.py` and `cpu_int8_vnni.py` (linear layers; these three through
`load_library`).

NOTE: a flag set is (compile flags, link flags); never link with -ffast-math: gcc then adds
crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
process when the library is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

FlagSet = tuple[tuple[str, ...], tuple[str, ...]]

_DIGEST_CHARS = 16
"""Hex characters of a cached library's sha256 in its name."""


def find_compiler() -> str | None:
    """`$CC`, else the first of cc, gcc, clang on PATH; None when there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def kernel_cache_dir() -> Path:
    """Where built libraries are kept: $PDSERVE_KERNEL_CACHE_DIR or ~/.cache/pdserve/kernels
    (one host's: the key names the CPU, see `build_key`)."""
    root = os.environ.get("PDSERVE_KERNEL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdserve", "kernels")
    return Path(root)


def _cpu_identity() -> str:
    """The CPU's model and feature flags (-march=native builds for exactly these)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(wanted)))


@functools.cache
def _compiler_identity(compiler: str) -> str:
    path = shutil.which(compiler) or compiler
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 check=False, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{path}\n{version}"


def build_key(compiler: str, source: Path, defines: Sequence[str],
              flag_sets: Sequence[FlagSet]) -> str:
    """sha256 over everything a build depends on: the source, the defines, the flag sets,
    the compiler (path and --version) and the CPU (`-march=native`)."""
    digest = hashlib.sha256()
    for part in (source.read_bytes(), repr(tuple(defines)).encode(),
                 repr(tuple(flag_sets)).encode(), _compiler_identity(compiler).encode(),
                 _cpu_identity().encode(), platform.machine().encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:32]


def build_library(compiler: str, source: Path, defines: Sequence[str],
                  flag_sets: Sequence[FlagSet], build_dir: Path) -> Path | None:
    """The library of `source` built with the first flag set that works: from the kernel
    cache (`kernel_cache_dir()`, keyed by `build_key`) when a process on this host built it
    before, else compiled into `build_dir/<stem>.so` and copied into the cache.

    Every engine process compiled its kernels at start-up (0.7 s of SmolLM2's 2.3 s engine
    start on the 2-core machine); the cache makes that once per host and build. A cached
    file is named `<stem>-<key>-<sha256 of its bytes>.so` and loaded only when its bytes
    still hash to its name: a truncated or corrupted file (mapping one can kill the process
    with SIGBUS) is never loaded, but skipped (removed when it can be) and rebuilt. A cache
    that cannot be read or written only costs the compile (logged at debug level).

    Returns the library's path, or None when every flag set fails (each failure is logged at
    debug level).
    """
    try:
        key = build_key(compiler, source, defines, flag_sets)
        cache, prefix = kernel_cache_dir(), f"{source.stem}-{key}-"
        cached = _cached_library(cache, prefix)
    except OSError as e:
        logger.debug("kernel cache unavailable: %s", e)
        cache = None
    else:
        if cached is not None:
            return cached
    library = _compile(compiler, source, defines, flag_sets, build_dir)
    if library is not None and cache is not None:
        _store(library, cache, prefix)
    return library


def _cached_library(cache: Path, prefix: str) -> Path | None:
    """The first `<prefix><digest>.so` in `cache` whose bytes hash to its digest."""
    if not cache.is_dir():
        return None
    for candidate in sorted(cache.glob(f"{prefix}*.so")):
        digest = candidate.name[len(prefix):-len(".so")]
        try:
            if hashlib.sha256(candidate.read_bytes()).hexdigest()[:len(digest)] == digest \
                    and len(digest) == _DIGEST_CHARS:
                return candidate
        except OSError:
            continue
        logger.warning("cached kernel %s does not match its digest; rebuilding", candidate)
        try:
            candidate.unlink()
        except OSError:
            pass  # a read-only cache: skipped at every start until it is cleaned
    return None


def _store(library: Path, cache: Path, prefix: str) -> None:
    """Copy `library` into the cache under its digest: written to a temporary name, synced,
    then renamed (atomic); nothing is left behind when that fails."""
    data = library.read_bytes()
    target = cache / f"{prefix}{hashlib.sha256(data).hexdigest()[:_DIGEST_CHARS]}.so"
    partial = cache / f"{target.name}.{os.getpid()}.partial"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except OSError as e:
        logger.debug("could not write the kernel cache %s: %s", target, e)
        try:
            partial.unlink()
        except OSError:
            pass


def _compile(compiler: str, source: Path, defines: Sequence[str],
             flag_sets: Sequence[FlagSet], build_dir: Path) -> Path | None:
    library, obj = build_dir / f"{source.stem}.so", build_dir / f"{source.stem}.o"
    for compile_flags, link_flags in flag_sets:
        result = None
        for command in (
                [compiler, "-c", "-fPIC", *defines, *compile_flags, str(source), "-o", str(obj)],
                [compiler, "-shared", str(obj), "-o", str(library), *link_flags]):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                break
        if result is not None and result.returncode == 0:
            return library
        logger.debug("compile failed (%s): %s", " ".join(compile_flags),
                     result.stderr[-2000:] if result else "")
    return None


def load_library(source: Path, defines: Sequence[str],
                 flag_sets: Sequence[FlagSet]) -> ctypes.CDLL | None:
    """Compile `source` (`build_library`, in a temporary directory) and load it.

    Returns the loaded library (the caller binds its functions), or None without a compiler
    or when no flag set compiles (logged at info level: callers fall back to torch).
    """
    compiler = find_compiler()
    if compiler is None:
        logger.info("no C compiler found; %s is not built", source.name)
        return None
    with tempfile.TemporaryDirectory(prefix="pdserve-kernels-") as build_dir:
        library = build_library(compiler, source, defines, flag_sets, Path(build_dir))
        if library is None:
            logger.info("could not compile %s", source)
            return None
        return ctypes.CDLL(str(library))  # dlopen maps the file: the directory may go
