"""Pause and resume: engine-side backpressure for clients that read slowly (Scheduler's).

A paused request keeps its blocks, tokens and num_computed_tokens but is never scheduled;
when blocks run short, the longest-paused holder is preempted first (`preempt_paused`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request, RequestStatus


class RequestPausing:
    """The pause half of `Scheduler` (its queues: requests, waiting, running, paused)."""

    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    paused: dict[str, Request]
    _paused_preempted_ids: list[str]
    num_preemptions: int

    def pause_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop scheduling the given unfinished requests; returns the ids newly paused.

        A paused request keeps its blocks, tokens and num_computed_tokens; it leaves the
        running list and the waiting queue, so it counts against neither max_num_seqs nor
        the waiting bound. Idempotent: unknown, finished or already paused ids are ignored.
        """
        paused = []
        for request_id in request_ids:
            # NOTE: a request waiting for remote KV is not there yet: ignored.
            if request_id in self.requests and request_id not in self.paused and \
                    self.requests[request_id].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.paused[request_id] = self.requests[request_id]
                paused.append(request_id)
        if paused:
            self.running = [r for r in self.running if r.request_id not in self.paused]
            self.waiting = deque(r for r in self.waiting if r.request_id not in self.paused)
        return paused

    def resume_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Schedule paused requests again; returns the ids resumed (others are ignored).

        One paused while running (or preempted while paused) goes to the front of the
        waiting queue and is admitted again, ahead of new requests, with the blocks it kept
        (or recomputed, if preempted); one paused before admission goes to the back.
        """
        resumed = []
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is None:
                continue
            resumed.append(request_id)
            if request.status == RequestStatus.WAITING:
                self.waiting.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                request.status = RequestStatus.WAITING  # holds its blocks: admitted at once
            self.waiting.appendleft(request)
        return resumed

    def preempt_paused(self) -> bool:
        """Free the blocks of the longest-paused request holding any (recompute on resume).
        Returns False when no paused request holds blocks. Its id is reported in the next
        `SchedulerOutput.preempted_request_ids`; it moves to the end of `paused` (so the
        holders stay in front: no rescan of a thousand freed ones per call)."""
        kv = self.kv_cache_manager
        request = next((r for r in self.paused.values() if kv.get_block_ids(r.request_id)), None)
        if request is None:
            return False
        kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._paused_preempted_ids.append(request.request_id)
        self.paused[request.request_id] = self.paused.pop(request.request_id)
        return True
