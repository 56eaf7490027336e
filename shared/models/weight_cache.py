"""Weights held once per host: the packed tensors written once to a file and mapped read-only
by every engine, so the page cache holds one copy whatever the number of prefill and decode
engines on the host (issue 38).

    tensors, mapping = load_or_build(key, build)   # build() -> {name: tensor}, called once

The first engine to need a key builds the tensors (reads the checkpoint, packs), writes them
to `<dir>/<key>.bin` (each tensor 64-byte aligned) and then `<key>.json` (names, dtypes,
shapes, offsets, the file's size), each to a temporary name, fsynced, then renamed: a reader
that sees the manifest sees a whole file. An exclusive `flock` on `<key>.lock` makes engines
that start together build once: the others wait, then map what the first wrote. A restart
maps in milliseconds instead of packing in seconds. A file whose size does not match its
manifest (a full disk, a copy cut short) is rebuilt.

The key (`cache_key`) covers what the tensors depend on: the model directory's real path,
config.json's bytes, each checkpoint file's name, size, mtime and safetensors header, the
dtype, the quantization and the layout's version; a changed checkpoint gets a new file.
Old files are not removed (`rm -r` the directory to reclaim them).

The directory: PDSERVE_WEIGHT_CACHE_DIR, else `$XDG_CACHE_HOME/pdserve/weights` or
`~/.cache/pdserve/weights`; PDSERVE_WEIGHT_CACHE=0 turns the cache off (each engine packs
its own private copy, as before). Engines on other hosts have their own file: nothing here
assumes a shared filesystem, and a shared one works too (flock on NFSv4 / local disks).

Source: the same idea as llama.cpp's mmap'd GGUF weights and vLLM's (Run:ai / tensorizer)
model streamers' read-only mappings, applied to the packed layout the kernels read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of each tensor in the file (a cache line; AVX-512 loads)."""
# NOTE: numpy and torch are imported where they are used: the launcher reads `cache_dir`
# for its memory plan without loading torch (start-up time).


def cache_dir() -> Path | None:
    """The host's weight cache directory; None when PDSERVE_WEIGHT_CACHE=0."""
    if os.environ.get("PDSERVE_WEIGHT_CACHE", "1") == "0":
        return None
    explicit = os.environ.get("PDSERVE_WEIGHT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "weights"


def cache_key(model_path: str | Path, files: list[Path], **variant: object) -> str:
    """A hex sha256 over the checkpoint's identity (see the module's docstring) and
    `variant` (dtype, quantization, layout version ...). Raises OSError for a missing file."""
    model_path = Path(model_path)
    digest = hashlib.sha256()
    digest.update(json.dumps(variant, sort_keys=True, default=str).encode())
    digest.update(str(model_path.resolve()).encode())
    digest.update((model_path / "config.json").read_bytes())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(size, 64 * 2**20)))
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class Mapping:
    """A read-only mapping of one cache file: [start, end) host addresses."""

    path: Path
    start: int
    end: int

    def holds(self, tensor: torch.Tensor) -> bool:
        """`tensor`'s storage lies in this mapping."""
        return self.start <= tensor.data_ptr() < self.end

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def load_or_build(key: str, build: Callable[[], dict[str, torch.Tensor]],
                  directory: Path | None = None
                  ) -> tuple[dict[str, torch.Tensor], Mapping]:
    """The tensors under `key`, mapped read-only from the host's cache file; `build()` makes
    them (contiguous CPU tensors) when no valid file exists, once across the processes of a
    host. The tensors must not be written (the pages are read-only: a write faults).

    Raises:
        OSError: the directory cannot be created or written (a full disk, no permission):
            the caller may fall back to private tensors.
    """
    directory = directory or cache_dir()
    if directory is None:
        raise OSError("the weight cache is off (PDSERVE_WEIGHT_CACHE=0)")
    directory.mkdir(parents=True, exist_ok=True)
    mapped = _map(directory, key)
    if mapped is not None:
        return mapped
    with open(directory / f"{key}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            mapped = _map(directory, key)  # another engine built it while this one waited
            if mapped is not None:
                return mapped
            for stale in directory.glob(f"{key}.*.tmp"):  # a builder killed mid-write
                stale.unlink(missing_ok=True)
            tensors = build()
            _write(directory, key, tensors)
            del tensors
            mapped = _map(directory, key)
            if mapped is None:
                raise OSError(f"weight cache file {directory / key}.bin did not read back")
            logger.info("weight cache: wrote %s (%.1f MiB)", mapped[1].path,
                        mapped[1].nbytes / 2**20)
            return mapped
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(directory: Path, key: str, tensors: dict[str, torch.Tensor]) -> None:
    import torch

    manifest: dict[str, list] = {}
    data_path, tmp = directory / f"{key}.bin", directory / f"{key}.bin.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            offset = 0
            for name, tensor in tensors.items():
                tensor = tensor.detach().contiguous()
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                nbytes = tensor.numel() * tensor.element_size()
                manifest[name] = [offset, str(tensor.dtype).removeprefix("torch."),
                                  list(tensor.shape)]
                if nbytes:
                    f.write(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
                offset += nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data_path)
        meta = directory / f"{key}.json.{os.getpid()}.tmp"
        with open(meta, "w") as f:
            json.dump({"size": offset, "tensors": manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta, directory / f"{key}.json")
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _map(directory: Path, key: str) -> tuple[dict[str, torch.Tensor], Mapping] | None:
    """The tensors of a valid file under `key`, or None: missing, or not valid (its size is
    not its manifest's, a manifest that does not parse): then both files are removed, to be
    rebuilt."""
    import numpy as np
    import torch

    data_path, meta_path = directory / f"{key}.bin", directory / f"{key}.json"
    if not meta_path.exists():
        return None
    try:
        manifest = json.loads(meta_path.read_text())
        size = data_path.stat().st_size
        if size != manifest["size"] or size == 0:
            raise ValueError(f"{size} bytes, the manifest says {manifest['size']}")
        buffer = np.memmap(data_path, dtype=np.uint8, mode="r")
        with warnings.catch_warnings():
            # NOTE: torch warns that the array is not writable; nothing writes weights, and a
            # write would fault rather than reach the file (the pages are mapped read-only).
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(buffer)
        tensors = {}
        for name, (offset, dtype_name, shape) in manifest["tensors"].items():
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: no dtype {dtype_name!r}")
            nbytes = math.prod(shape) * dtype.itemsize
            if offset % ALIGN or offset + nbytes > size:
                raise ValueError(f"{name}: bytes {offset}..{offset + nbytes} out of the file")
            tensors[name] = raw[offset:offset + nbytes].view(dtype).view(shape)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        logger.warning("weight cache: %s is not valid (%s): rebuilding", data_path, e)
        for path in (meta_path, data_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return None
    start = raw.data_ptr()
    return tensors, Mapping(data_path, start, start + size)
