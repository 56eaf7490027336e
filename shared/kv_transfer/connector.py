"""KVConnector: when the scheduler may free or compute with a transfer's blocks (vLLM v1's shape).

The scheduler owns every block. A prefill request marked for a remote decode
(`request.kv_transfer_params = RemoteDecode()`, shared/kv_transfer/params.py) that ends
FINISHED_LENGTH_CAPPED (its one engine token) is not freed when it finishes:
`request_finished()` answers "delay", and its blocks stay the scheduler's until the transfer
is done.

    finished (engine thread) ─▶ request_finished: True ─▶ held for the decode
    FetchKV (service loop)   ─▶ start_send ... end_send          (blocks read, never freed
                                                                   under a reader)
    ReleaseKV / Abort / TTL  ─▶ close (service loop)
    schedule() or an op      ─▶ get_finished(): closed and no reader ─▶ scheduler frees

Decode side: a request with `kv_transfer_params=RemotePrefill(num_tokens=N)` waits in the
scheduler as WAITING_FOR_REMOTE_KVS; the scheduler allocates its blocks in its admission
order and calls `update_state_after_alloc` (the service's `expect_recv` callback learns the
block ids and starts the fetch); `recv_finished` (service loop) then `get_finished` (engine
thread) tell the scheduler the KV is in place.

Threads: `request_finished`, `update_state_after_alloc` and `get_finished` run on the engine
thread (the scheduler's); the rest on the service's event loop. One lock guards the table;
no call blocks. After a `close` or the last `end_send` leaves a transfer done, the service
queues an engine op that calls `Scheduler.update_from_kv_xfer_finished` (an idle engine does
not step): `sending()` stops listing a done transfer at once, so an op queued after sees its
blocks freed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.shared.kv_transfer.params import RemoteDecode
from pdserve.shared.request import Request, RequestStatus

__all__ = ["KVConnector", "Sending"]


@dataclass(slots=True)
class Sending:
    """A finished request whose blocks are held for a KV transfer (prefill)."""

    request: Request
    block_ids: list[int]
    finished_at: float
    """Monotonic time the request finished (its TTL counts from here)."""
    num_fetches: int = 0
    """FetchKV streams reading the blocks now."""
    closed: bool = False
    """Released, aborted or expired: freed once no FetchKV reads it."""
    fetch_started: float = 0.0
    """Monotonic start of the latest FetchKV stream."""


class KVConnector:
    """Both sides of KV transfers: which finished requests keep their blocks (prefill),
    which waiting requests' blocks a receive is writing (decode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending: dict[str, Sending] = {}
        self._on_alloc: dict[str, Callable[[list[int], int], None]] = {}
        self._recving: set[str] = set()
        self._recv_done: dict[str, bool] = {}

    # -- engine thread ----------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """delay_free_blocks for a request that just finished: the connector now holds its
        `block_ids` (a copy) for a send.

        Delays when the request asked for a remote decode (`RemoteDecode`) and ended on its
        length cap (the engine's max_tokens=1: the client's request goes on elsewhere). A
        stop, an abort or a request without blocks: no delay.
        """
        if not isinstance(request.kv_transfer_params, RemoteDecode) or not block_ids \
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False
        with self._lock:
            self._sending[request.request_id] = Sending(request, list(block_ids),
                                                        time.monotonic())
        return True

    def get_finished(self) -> tuple[set[str], dict[str, bool]]:
        """(finished_sending, finished_recving), forgotten here: held requests whose send is
        done (closed, no reader: their blocks are the caller's to free now), and requests
        whose receive ended (`recv_finished`: nothing writes their blocks any more), each
        with whether their KV is in place."""
        with self._lock:
            done = {rid for rid, s in self._sending.items() if s.closed and not s.num_fetches}
            for request_id in done:
                del self._sending[request_id]
            recving, self._recv_done = self._recv_done, {}
        return done, recving

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_hit_tokens: int) -> None:
        """A WAITING_FOR_REMOTE_KVS request got its blocks (`num_hit_tokens` of them cached
        here already): the callback of `expect_recv` is told and its receive starts. With no
        callback (the receive was given up before: its request is being aborted) nothing
        will write them."""
        with self._lock:
            on_alloc = self._on_alloc.pop(request.request_id, None)
            if on_alloc is not None:
                self._recving.add(request.request_id)
        if on_alloc is not None:
            on_alloc(list(block_ids), num_hit_tokens)

    def is_recving(self, request_id: str) -> bool:
        """Its blocks may be written by a receive now (never free them then)."""
        with self._lock:
            return request_id in self._recving

    # -- service loop -----------------------------------------------------------------------

    def start_send(self, request_id: str) -> list[int] | None:
        """A FetchKV begins: the held blocks (None if not held or closed). Pair with
        `end_send`."""
        with self._lock:
            s = self._sending.get(request_id)
            if s is None or s.closed:
                return None
            s.num_fetches += 1
            s.fetch_started = time.monotonic()
            return s.block_ids

    def end_send(self, request_id: str) -> bool:
        """A FetchKV ended (its last read done). True when that leaves the transfer done."""
        with self._lock:
            s = self._sending[request_id]
            s.num_fetches -= 1
            return s.closed and not s.num_fetches

    def is_open(self, request_id: str) -> bool:
        """Held and not closed (a FetchKV may start)."""
        with self._lock:
            s = self._sending.get(request_id)
            return s is not None and not s.closed

    def is_held(self, request_id: str) -> bool:
        """Held, closed or not (its blocks are not freed yet)."""
        with self._lock:
            return request_id in self._sending

    def close(self, request_id: str) -> tuple[bool, bool]:
        """Release (ReleaseKV, Abort): (whether it was open, whether the transfer is done
        now, i.e. no FetchKV reads it)."""
        with self._lock:
            s = self._sending.get(request_id)
            if s is None or s.closed:
                return False, False
            s.closed = True
            return True, not s.num_fetches

    def expect_recv(self, request_id: str,
                    on_alloc: Callable[[list[int], int], None]) -> None:
        """Call `on_alloc(block_ids, num_hit_tokens)` (on the engine thread) once the
        scheduler allocates the request's blocks. Pair with `recv_finished`."""
        with self._lock:
            self._on_alloc[request_id] = on_alloc

    def recv_finished(self, request_id: str, ok: bool) -> None:
        """The receive ended (`ok`: the KV is in place) or was given up; nothing writes the
        blocks any more. The scheduler learns it at its next `get_finished`."""
        with self._lock:
            self._on_alloc.pop(request_id, None)
            if request_id in self._recving:
                self._recving.discard(request_id)
                self._recv_done[request_id] = ok

    def expired(self, ttl: float) -> list[str]:
        """Open ids unread for `ttl` seconds since they finished (the reaper closes them)."""
        deadline = time.monotonic() - ttl
        with self._lock:
            return [rid for rid, s in self._sending.items()
                    if not s.closed and not s.num_fetches and s.finished_at <= deadline]

    def sending(self) -> list[Sending]:
        """Copies of the held requests whose blocks an engine op queued now would still see
        held (a done transfer's free is already queued: not listed)."""
        with self._lock:
            return [replace(s) for s in self._sending.values()
                    if not (s.closed and not s.num_fetches)]
