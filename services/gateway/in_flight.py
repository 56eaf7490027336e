"""InFlight: the engine calls this gateway has in flight on each instance, counted once.

One count per instance address, shared by the two readers that need it (app.py builds one
and hands it to both): placement adds it to an instance's reported `num_running +
num_waiting` (requests placed meanwhile spread, before the instance reports them), and the
channel pool keeps an instance's channel open while its count is above zero
(`ChannelPool.forget`). Who counts what:

    Prefill / Pool / Generate call   its instance, while the call runs (ChannelPool)
    a decode placed, not started     the decode instance, from placement until its Generate
                                     call starts (prefill_decode.py): while the prompt is
                                     prefilled elsewhere
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class InFlight:
    """Calls in flight per instance address (host:port). Not thread-safe: one event loop."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def __getitem__(self, address: str) -> int:
        """Calls in flight on `address` (0 when none)."""
        return self._counts[address]

    def begin(self, address: str) -> None:
        self._counts[address] += 1

    def end(self, address: str) -> None:
        self._counts[address] -= 1
        if self._counts[address] <= 0:
            del self._counts[address]

    @contextmanager
    def hold(self, address: str) -> Iterator[None]:
        """Count one call on `address` for the `with` block."""
        self.begin(address)
        try:
            yield
        finally:
            self.end(address)
