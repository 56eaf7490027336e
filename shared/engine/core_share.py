"""CoreShare: the engines of one host give the host's cores to whichever of them has work.

A static split (prefill on core 0, decode on core 1) leaves a core idle whenever one side
has nothing to do, and letting both use every core oversubscribes them when both are
busy. Instead each engine process on a host publishes, in a small shared board, whether it
has work, and before every step sizes its thread pool to its share of the cores among the
engines busy right now:

    busy engines on a 2-core host     threads each
    prefill only                      prefill 2
    prefill + decode                  prefill 1, decode 1
    decode only                       decode 2

so the work there is gets all the cores and the host never runs more compute threads than
cores. (Adaptive thread counts in the spirit of the OS-level core sharing of Arachne,
Qin et al., OSDI 2018, and of SGLang/vLLM CPU backends binding one OpenMP pool per core set;
here the unit of reallocation is one engine step.)

The board is a file of `MAX_SLOTS` int64 slots (mmap, normally on /dev/shm). An engine
claims a free slot by taking a POSIX record lock on its 8 bytes (`fcntl.lockf`), held for
the life of the process, so a slot whose owner died is seen free (the kernel drops the
lock) and a crashed engine never holds cores hostage. Slot values:

    0          unused
    t > 0      busy: the engine had work at monotonic time t (ns)
    -t < 0     idle since monotonic time t (ns); counted busy for `linger_ns` more,
               so an engine idle for a moment between two batches keeps its share

CLOCK_MONOTONIC is one clock for every process of a Linux host. Engines on different hosts
never share a board (each host has its own /dev/shm), so nothing here assumes one machine.
Torch-free: the caller applies the thread count (`torch.set_num_threads`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

MAX_SLOTS = 64
_SLOT = struct.Struct("q")
DEFAULT_LINGER_S = 0.02


def default_board_path() -> str:
    """The host-wide board every `pdserve up` on this host uses: /dev/shm when present."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return str(Path(base) / "pdserve-core-share")


class CoreShare:
    """This engine's slot on its host's core board.

    Args:
        path: the board file (created if missing; every engine of the host names the same).
        num_cores: cores this engine may run on (its affinity); the share divides these.
        linger_s: seconds an engine that went idle still counts as busy.

    Raises:
        OSError: the board cannot be created or mapped.
        RuntimeError: all `MAX_SLOTS` slots are held by live engines.
    """

    def __init__(self, path: str, num_cores: int, linger_s: float = DEFAULT_LINGER_S) -> None:
        if num_cores < 1:
            raise ValueError(f"num_cores must be >= 1, got {num_cores}")
        self.path = path
        self.num_cores = num_cores
        self.linger_ns = int(linger_s * 1e9)
        size = MAX_SLOTS * _SLOT.size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
            self.slot = self._claim_slot()
        except BaseException:
            os.close(self._fd)
            raise
        self._write(self.slot, -1)  # idle since long ago
        self.threads = num_cores
        """The thread count the last `update` returned."""

    def update(self, busy: bool) -> int:
        """Publish whether this engine has work now; return its thread count for the step.

        An idle engine's count is the share it would get if it became busy now.
        """
        now = time.monotonic_ns()
        current = self._read(self.slot)
        if busy:
            self._write(self.slot, now)
        elif current > 0:
            self._write(self.slot, -now)
        busy_slots = [i for i in range(MAX_SLOTS)
                      if i == self.slot or self._is_busy(i, now)]
        n = len(busy_slots)
        share, extra = divmod(self.num_cores, n)
        rank = busy_slots.index(self.slot)
        self.threads = max(1, share + (1 if rank < extra else 0))
        return self.threads

    def busy_engines(self) -> int:
        """Engines on this board counted busy now, this one included if it is."""
        now = time.monotonic_ns()
        return sum(1 for i in range(MAX_SLOTS)
                   if (i == self.slot and self._read(i) > 0) or
                   (i != self.slot and self._is_busy(i, now)))

    def close(self) -> None:
        """Give the slot back (idempotent)."""
        if self._fd < 0:
            return
        self._write(self.slot, 0)
        self._map.close()
        os.close(self._fd)  # drops the record lock
        self._fd = -1

    # -- internals --------------------------------------------------------------------------

    def _claim_slot(self) -> int:
        for i in range(MAX_SLOTS):
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT.size,
                            i * _SLOT.size, os.SEEK_SET)
            except OSError:
                continue
            return i
        raise RuntimeError(f"core share board {self.path}: all {MAX_SLOTS} slots are taken")

    def _is_busy(self, i: int, now: int) -> bool:
        value = self._read(i)
        if value == 0:
            return False
        if value < 0 and now + value > self.linger_ns:
            return False
        # NOTE: a non-zero slot whose lock is free belongs to a dead engine: clear it.
        # (Record locks are per process, so this never probes our own slot.)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT.size, i * _SLOT.size,
                        os.SEEK_SET)
        except OSError:
            return True  # held: a live engine
        self._write(i, 0)
        fcntl.lockf(self._fd, fcntl.LOCK_UN, _SLOT.size, i * _SLOT.size, os.SEEK_SET)
        return False

    def _read(self, i: int) -> int:
        return _SLOT.unpack_from(self._map, i * _SLOT.size)[0]

    def _write(self, i: int, value: int) -> None:
        _SLOT.pack_into(self._map, i * _SLOT.size, value)
