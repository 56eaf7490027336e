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
    out, start = [], 0
    for i in range(num_replicas):
        n = share + (1 if i < extra else 0)
        out.append(cores[start:start + n])
        start += n
    return out


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
