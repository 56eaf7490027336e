"""Split the machine's cores between the prefill and the decode replicas.

Binding each engine process to its own cores (affinity + a torch thread pool of that size)
keeps prefill's large matmuls and decode's batch steps from fighting over every core:

    2 cores, 1 prefill + 1 decode:   prefill-0 -> (0,)      decode-0 -> (1,)
    8 cores, 1 + 1:                  prefill-0 -> (0..3)    decode-0 -> (4..7)
    8 cores, 2 + 1:                  prefill-0 -> (0..2)  prefill-1 -> (3, 4)  decode-0 -> (5..7)
    2 cores, 2 + 2:                  prefill-0, prefill-1 -> (0,)   decode-0, decode-1 -> (1,)
    1 core:                          everyone -> (0,)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

Cores = tuple[int, ...]


class CoreSplit(NamedTuple):
    prefill: list[Cores]
    """One core set per prefill replica."""
    decode: list[Cores]
    """One core set per decode replica."""


def available_cores() -> Cores:
    """The cores this process may run on (its affinity), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def distribute(cores: Sequence[int], num_replicas: int) -> list[Cores]:
    """Contiguous disjoint slices when there are enough cores (the first ones get the
    remainder); otherwise one core each, round-robin, so replicas share cores evenly."""
    cores = tuple(cores)
    if not cores:
        return [() for _ in range(num_replicas)]
    if len(cores) < num_replicas:
        return [(cores[i % len(cores)],) for i in range(num_replicas)]
    share, extra = divmod(len(cores), num_replicas)
    starts = [i * share + min(i, extra) for i in range(num_replicas + 1)]
    return [cores[a:b] for a, b in zip(starts, starts[1:])]


def split_cores(cores: Sequence[int], num_prefill: int, num_decode: int,
                prefill_cores: Sequence[int] | None = None,
                decode_cores: Sequence[int] | None = None) -> CoreSplit:
    """Per-replica core sets.

    Without overrides, prefill gets a share of `cores` proportional to its replica count
    (rounded, at least one core each side when there are two or more) and decode the rest.
    An override fixes that role's cores; the other role then gets the cores left over (all
    of `cores` if none are).
    """
    cores = tuple(cores)
    if prefill_cores is None and decode_cores is None:
        if len(cores) < 2:
            prefill_cores = decode_cores = cores
        else:
            n = round(len(cores) * num_prefill / (num_prefill + num_decode))
            n = min(max(n, 1), len(cores) - 1)
            prefill_cores, decode_cores = cores[:n], cores[n:]
    elif prefill_cores is None:
        assert decode_cores is not None
        prefill_cores = tuple(c for c in cores if c not in decode_cores) or cores
    elif decode_cores is None:
        decode_cores = tuple(c for c in cores if c not in prefill_cores) or cores
    return CoreSplit(distribute(prefill_cores, num_prefill),
                     distribute(decode_cores, num_decode))


def format_cores(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (the --cpu-cores syntax)."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class PinnedEngine(NamedTuple):
    pid: int
    role: str
    cores: Cores


def _engine_role(args: list[str]) -> str | None:
    """"prefill" / "decode" when `args` (a command line) runs a pdserve engine, else None."""
    for i, arg in enumerate(args[:-1]):
        if arg == "serve" and args[i + 1] in ("prefill", "decode"):
            return args[i + 1]
        if arg == "-m" and args[i + 1] in ("pdserve.services.prefill", "pdserve.services.decode"):
            return args[i + 1].rsplit(".", 1)[1]
    return None


def pinned_engines(exclude: Sequence[int] = ()) -> list[PinnedEngine]:
    """The pdserve engine processes on this machine bound to only some of its cores
    (affinity narrower than every online core), but for the pids in `exclude`.

    An engine that may run on every core (the core share's default) pins nothing: engines
    of two `pdserve up` on one host then divide the cores through the host's core board.
    Linux only (reads /proc); elsewhere: [].
    """
    machine = set(range(os.cpu_count() or 1))
    return [e for e in engine_processes(exclude) if set(e.cores) < machine]


def engine_processes(exclude: Sequence[int] = ()) -> list[PinnedEngine]:
    """Every pdserve engine process on this machine (but `exclude`) with its affinity."""
    proc = "/proc"
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir(proc):
        return []
    out = []
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            role = _engine_role(args)
            if role is None:
                continue
            cores = set(os.sched_getaffinity(int(name)))
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue
        if cores:
            out.append(PinnedEngine(int(name), role, tuple(sorted(cores))))
    return out


def avoid_pinned(wanted: Sequence[int], others: Sequence[PinnedEngine]
                 ) -> tuple[Cores, str | None]:
    """(the cores of `wanted` no other engine is pinned to, a one-line reason when that is
    not all of them, or None)."""
    taken = {c for e in others for c in e.cores}
    free = tuple(c for c in wanted if c not in taken)
    if len(free) == len(tuple(wanted)):
        return free, None
    who = ", ".join(f"pid {e.pid} ({e.role}, cores {format_cores(e.cores)})"
                    for e in others if taken & set(e.cores))
    return free, f"cores {format_cores(sorted(taken & set(wanted)))} are pinned by another " \
                 f"pdserve's engines: {who}"
