"""PausedRequests: the scheduler's paused requests (engine-side backpressure for clients
that read slowly).

    RUNNING ───pause──▶ PAUSED ──resume──▶ WAITING, front of the queue (admitted at once
    WAITING ───pause──▶ PAUSED ──resume──▶ WAITING, back           with the blocks it kept)
    PREEMPTED ─pause──▶ PAUSED ──resume──▶ PREEMPTED, front
                          │
                          └─ blocks run short: the longest-paused holder is preempted
                             (`preempt_holder`): PAUSED still, resumes PREEMPTED

A paused request keeps its blocks, tokens and num_computed_tokens but is never scheduled;
it is in neither the running list nor the waiting queue (the Scheduler's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request, RequestStatus


class PausedRequests:
    """The PAUSED requests in pause order, each with the status it resumes with."""

    def __init__(self) -> None:
        self._resume_status: dict[str, tuple[Request, RequestStatus]] = {}
        self.preempted_ids: list[str] = []
        """Paused requests preempted since the last `SchedulerOutput` (reported in its
        `preempted_request_ids`; the Scheduler takes them)."""

    def __len__(self) -> int:
        return len(self._resume_status)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._resume_status

    def __iter__(self) -> Iterator[Request]:
        return (request for request, _ in self._resume_status.values())

    def pause(self, requests: Iterable[Request]) -> list[str]:
        """Make the given unfinished requests PAUSED; returns the ids newly paused.

        A paused request keeps its blocks, tokens and num_computed_tokens; the caller takes
        it out of the running list and the waiting queue, so it counts against neither
        max_num_seqs nor the waiting bound. Idempotent: already paused requests, and those
        waiting for remote KV (not there yet), are ignored.
        """
        paused = []
        for request in requests:
            if request.status not in (RequestStatus.PAUSED, RequestStatus.WAITING_FOR_REMOTE_KVS):
                self._resume_status[request.request_id] = (request, request.status)
                request.status = RequestStatus.PAUSED
                paused.append(request.request_id)
        return paused

    def resume(self, request_ids: Iterable[str], waiting: deque[Request]) -> list[str]:
        """Put the given paused requests back into the scheduler's `waiting` queue; returns
        the ids resumed (others are ignored).

        One paused while running (or preempted while paused) goes to the front and is
        admitted again, ahead of new requests, with the blocks it kept (or recomputed, if
        preempted); one paused before admission goes to the back.
        """
        resumed = []
        for request_id in request_ids:
            request, status = self._resume_status.pop(request_id, (None, None))
            if request is None:
                continue
            resumed.append(request_id)
            if status == RequestStatus.WAITING:
                request.status = status
                waiting.append(request)
                continue
            # Paused while running, it holds its blocks: admitted at once.
            request.status = RequestStatus.PREEMPTED if status == RequestStatus.PREEMPTED \
                else RequestStatus.WAITING
            waiting.appendleft(request)
        return resumed

    def discard(self, request_id: str) -> None:
        """Forget a paused request that finished or was aborted (no-op when not paused)."""
        self._resume_status.pop(request_id, None)

    def preempt_holder(self, kv: KVCacheManager) -> Request | None:
        """The longest-paused request holding blocks, now to resume as PREEMPTED (the caller
        frees its KV); None when no paused request holds blocks. It moves to the end of the
        pause order (so the holders stay in front: no rescan of a thousand freed ones per
        call) and its id to `preempted_ids`."""
        request = next((r for r in self if kv.get_block_ids(r.request_id)), None)
        if request is not None:
            del self._resume_status[request.request_id]
            self._resume_status[request.request_id] = (request, RequestStatus.PREEMPTED)
            self.preempted_ids.append(request.request_id)
        return request
