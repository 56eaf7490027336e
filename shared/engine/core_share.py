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
cores. (Adaptive thread counts in the spirit of the OS-level core allocation of Arachne,
Qin et al., OSDI 2018; here the unit of reallocation is one engine step.)

Shortest prefill first, across the host. An engine also publishes the prompt tokens left of
its next prefill (its `urgency`). An engine that could yield (it has no decodes running, so
pausing it stalls no stream: in practice a prefill instance) waits, with 0 threads, while
another busy engine has a strictly shorter prefill to do. An engine with streams running
never waits: when the engine that yields to it is still in its step, it takes its share
beside it for that step (see `update`). No engine waits without bound either: EngineCore
publishes urgency 0 (overdue) once it has waited `max_yield_s`. On one host under a burst, the
decode instance's short local prefills then run on every core before the prefill
instance's long prompts, as one shortest-job-first queue would order them; the scheduler's
aging bound (`max_wait_s`) still applies, since an overdue prompt publishes urgency 0.

Prefill before decode, with a bounded stall (opt-in: `max_decode_stall_s` > 0). An
engine with only decodes to run (urgency NO_PREFILL) may yield too: it then waits while
any busy engine has a prefill, until its streams have waited `max_decode_stall_s`
(EngineCore); then it publishes urgency 0, the prefill engine waits at its next step
boundary and the decode engine takes one step on every core. (vLLM's unified
chunked-prefill step does the same in effect: prompts get all the token budget beyond one
token per decode.) Split 1:1 instead (the default), a burst's long prompts run at half
speed; on mixed64 the bound of 0.5 s cut TTFT p90 to 0.84x but cost 8% of the
throughput, 23% of TPOT p50 and 3x ITL p99, so it is off unless asked for.

The board is a file of `MAX_SLOTS` slots of two int64 (mmap, normally on /dev/shm). An
engine claims a free slot by taking a POSIX record lock on its 16 bytes (`fcntl.lockf`),
held for the life of the process, so a slot whose owner died is seen free (the kernel drops
the lock) and a crashed engine never holds cores hostage. A slot's mark:

    0          unused
    t > 0      busy: the engine had work at monotonic time t (ns); a mark older than
               `STALE_S` (a stopped process) no longer counts
    -t < 0     idle since monotonic time t (ns); counted busy for `linger_ns` more,
               so an engine idle for a moment between two batches keeps its share

and its urgency: prompt tokens left of its next prefill, NO_PREFILL when it has none, with
bit 62 set when the engine may yield (see above).

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
_SLOT = struct.Struct("qq")
DEFAULT_LINGER_S = 0.02
STALE_S = 30.0
NO_PREFILL = (1 << 40)
"""Urgency of an engine with no prefill to do."""
_CAN_YIELD = 1 << 62
_PARKED = 1 << 61
"""Set while the engine waits with 0 threads (it runs no step now)."""
_FLAGS = _CAN_YIELD | _PARKED


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
        self._write(self.slot, -1, NO_PREFILL)  # idle since long ago
        self.threads = num_cores
        """The thread count the last `update` returned."""

    def update(self, busy: bool, urgency: int = NO_PREFILL, can_yield: bool = False) -> int:
        """Publish whether this engine has work now; return its thread count for the step.

        Args:
            busy: the engine has work to step.
            urgency: prompt tokens left of its next prefill (0: overdue); NO_PREFILL: none.
            can_yield: this engine may wait for a shorter prefill elsewhere (no decodes
                running, or only decodes within their stall bound: module docstring).

        Returns:
            Threads for this step; 0 means: wait and ask again, because another engine has
            a shorter prefill (only when busy and can_yield), or because an engine that
            will yield to this one is still in its step (its cores are not free yet). An
            idle engine gets the share it would have if busy.
        """
        now = time.monotonic_ns()
        mark, previous = self._read(self.slot)
        if busy:
            mark = now
        elif mark > 0:
            mark = -now
        word = urgency | (_CAN_YIELD if can_yield else 0)
        # NOTE: a parked engine stays marked parked until it decides to run, so that no
        # other engine mistakes it for one still in its step.
        self._write(self.slot, mark, word | (previous & _PARKED if busy else 0))
        others = [(i, u) for i in range(MAX_SLOTS) if i != self.slot
                  for u in (self._busy_urgency(i, now),) if u is not None]
        if busy and can_yield:
            shortest = min((u & ~_FLAGS for _, u in others), default=NO_PREFILL)
            if shortest < urgency:
                return self._park(mark, word)
        # Engines that would yield to a shorter prefill hold no share either, once parked;
        # until then they are still in a step, and taking their cores would oversubscribe.
        competing = []
        for i, u in others:
            if not self._yields(u, others, i, urgency, busy):
                competing.append(i)
            elif busy and not u & _PARKED:
                if can_yield:
                    return self._park(mark, word)
                # NOTE: this engine has streams running: it never waits for another engine's
                # step to end (a long prefill chunk: seconds), it takes the share that is
                # free now, and the whole of the cores from its next step on.
                competing.append(i)
        self._write(self.slot, mark, word)
        busy_slots = sorted(competing + [self.slot])
        share, extra = divmod(self.num_cores, len(busy_slots))
        rank = busy_slots.index(self.slot)
        self.threads = max(1, share + (1 if rank < extra else 0))
        return self.threads

    def _park(self, mark: int, word: int) -> int:
        self._write(self.slot, mark, word | _PARKED)
        self.threads = 0
        return 0

    @staticmethod
    def _yields(u: int, others: list[tuple[int, int]], slot: int, my_urgency: int,
                my_busy: bool) -> bool:
        """Whether the engine in `slot` (urgency word `u`) waits for a shorter prefill."""
        if not u & _CAN_YIELD:
            return False
        own = u & ~_FLAGS
        shortest = min((v & ~_FLAGS for i, v in others if i != slot), default=NO_PREFILL)
        if my_busy:
            shortest = min(shortest, my_urgency)
        return shortest < own

    def busy_engines(self) -> int:
        """Engines on this board counted busy now, this one included if it is."""
        now = time.monotonic_ns()
        return sum(1 for i in range(MAX_SLOTS)
                   if (i == self.slot and self._read(i)[0] > 0) or
                   (i != self.slot and self._busy_urgency(i, now) is not None))

    def close(self) -> None:
        """Give the slot back (idempotent)."""
        if self._fd < 0:
            return
        self._write(self.slot, 0, NO_PREFILL)
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

    def _busy_urgency(self, i: int, now: int) -> int | None:
        """Slot i's urgency word if its engine counts as busy now, else None."""
        mark, urgency = self._read(i)
        if mark == 0:
            return None
        if mark < 0 and now + mark > self.linger_ns:
            return None
        if mark > 0 and now - mark > STALE_S * 1e9:
            return None
        # NOTE: a non-zero slot whose lock is free belongs to a dead engine: clear it.
        # (Record locks are per process, so this never probes our own slot.)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT.size, i * _SLOT.size,
                        os.SEEK_SET)
        except OSError:
            return urgency  # held: a live engine
        self._write(i, 0, NO_PREFILL)
        fcntl.lockf(self._fd, fcntl.LOCK_UN, _SLOT.size, i * _SLOT.size, os.SEEK_SET)
        return None

    def _read(self, i: int) -> tuple[int, int]:
        return _SLOT.unpack_from(self._map, i * _SLOT.size)

    def _write(self, i: int, mark: int, urgency: int) -> None:
        _SLOT.pack_into(self._map, i * _SLOT.size, mark, urgency)
