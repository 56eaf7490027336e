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
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

FlagSet = tuple[tuple[str, ...], tuple[str, ...]]


def find_compiler() -> str | None:
    """`$CC`, else the first of cc, gcc, clang on PATH; None when there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build_library(compiler: str, source: Path, defines: Sequence[str],
                  flag_sets: Sequence[FlagSet], build_dir: Path) -> Path | None:
    """Compile `source` into `build_dir/<stem>.so` with the first flag set that works.

    Returns the library's path, or None when every flag set fails (each failure is logged at
    debug level).
    """
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
