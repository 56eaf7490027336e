"""Builds the C files of `kernels/csrc/` at first use (the system C compiler + OpenMP).

Shared by `cpu_native.py` (paged attention) and `cpu_fused.py` (norms, RoPE, SiLU-and-mul).

NOTE: a flag set is (compile flags, link flags); never link with -ffast-math: gcc then adds
crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole
process when the library is loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
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
