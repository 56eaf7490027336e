"""KVTransferTracker: the scheduler's blocks of requests whose KV crosses instances.

    prefill: a finished request the connector delays ──▶ finished_sending ──▶ freed when
             the connector reports its send done
    decode:  WAITING_FOR_REMOTE_KVS ──allocate (admission order)──▶ waiting_for_remote_kvs
             ──receive done──▶ num_computed_tokens set, blocks cached ──▶ WAITING (scheduled
             like any request); aborted while its blocks are written ──▶ aborted_recving,
             freed when the receive ends; a failed receive leaves it for the service to
             abort, unless the KV came from a peer (`recompute_on_failure`): blocks freed,
             WAITING to compute its prompt here
    tiers:   a waiting request whose prefix goes on past the pool's hits on disk ──start_load
             ──▶ loading (blocks allocated, not cached) ──load done──▶ the loaded blocks
             cached; all loaded: num_computed_tokens set, WAITING with its blocks; fewer
             (a block missing or bad on disk): blocks freed, WAITING to recompute the rest

The blocks are the scheduler's in every state (docs/lifecycle.md): the Scheduler owns this
tracker; the connector (shared/kv_transfer/connector.py) only says when a transfer ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pdserve.shared.engine.scheduler_output import RequestView
from pdserve.shared.kv_cache.block_pool import KVCacheBlock
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.kv_transfer.params import HeldBlocks, RemotePrefill
from pdserve.shared.request import Request, RequestStatus

if TYPE_CHECKING:  # torch: the scheduler stays importable without it
    from pdserve.shared.engine.kv_offload import KVOffloader


class KVTransferTracker:
    """The requests whose blocks a KV transfer holds, and the moves in and out of them.

    Args:
        kv_cache_manager: the scheduler's block bookkeeping.
        kv_connector: says which finished requests' blocks wait for a send, and when
            transfers end; None: no transfers (every method is then a no-op or False).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, kv_connector: KVConnector | None,
                 offloader: KVOffloader | None = None):
        self.kv_cache_manager = kv_cache_manager
        self.kv_connector = kv_connector
        self.offloader = offloader
        """The disk tier's loads (shared/engine/kv_offload.py); None: no disk tier."""
        self.loading: dict[str, tuple[Request, int, int]] = {}
        """request_id -> (request, pool-hit blocks, blocks being loaded from disk)."""
        self.aborted_loading: set[str] = set()
        """Requests aborted while a load writes their blocks (freed once it ends)."""
        self._looked_up: set[str] = set()
        """Unfinished requests whose tier lookup is counted (`OffloadStats.count_lookup`)."""
        self.finished_sending: dict[str, Request] = {}
        """Finished requests whose blocks the connector holds for a send, by id."""
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        """WAITING_FOR_REMOTE_KVS requests holding their blocks while a receive fills them."""
        self.aborted_recving: dict[str, Request] = {}
        """Requests aborted while a receive was writing their blocks (freed once it ends)."""
        self.remote_kv_watermark = max(1, kv_cache_manager.block_pool.num_gpu_blocks // 100)
        """Blocks a receive leaves free while requests run (room for their next tokens)."""

    @property
    def num_receiving(self) -> int:
        """WAITING_FOR_REMOTE_KVS requests holding blocks a receive fills (not stepped)."""
        return len(self.waiting_for_remote_kvs)

    def allocate(self, request: Request, requests_running: bool,
                 preempt_paused: Callable[[], bool]) -> bool:
        """Hold blocks for the first `RemotePrefill.num_tokens` tokens of a
        WAITING_FOR_REMOTE_KVS request: prefix-cache hits first, fresh blocks (cached once
        received) after. False when the pool cannot hold them now (with the watermark to
        spare while `requests_running`), even after `preempt_paused()` freed what it could."""
        kv = self.kv_cache_manager
        params = request.kv_transfer_params
        assert isinstance(params, RemotePrefill) and self.kv_connector is not None
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        num_computed = max(params.num_tokens, num_hit_tokens)
        # NOTE: with a window on every layer only the window's blocks are allocated (and
        # fetched): those before it lead the request's list as the null block.
        num_window_start = kv.num_blocks_before_window(num_computed)
        if num_window_start > len(hits):
            hits, num_hit_tokens = [], 0
        else:
            num_window_start = 0
        num_new_blocks = -(-num_computed // kv.block_size) - len(hits) - num_window_start
        spare = self.remote_kv_watermark if requests_running else 0
        while kv.num_free_blocks - num_new_blocks - sum(1 for b in hits if b.ref_cnt == 0) \
                < spare:
            if not preempt_paused():
                return False
        if num_window_start:
            kv.skip_blocks_before_window(request, num_computed)
        if kv.allocate_slots(request, num_computed - num_hit_tokens, hits, num_hit_tokens,
                             delay_cache_blocks=True) is None:
            kv.free(request)
            return False
        params.num_computed_tokens = num_computed
        request.num_external_computed_tokens = num_computed - num_hit_tokens
        self.waiting_for_remote_kvs[request.request_id] = request
        self.kv_connector.update_state_after_alloc(
            request, kv.get_block_ids(request.request_id), num_hit_tokens)
        return True

    def start_load(self, request: Request, hits: list[KVCacheBlock]) -> bool:
        """Admit a waiting request whose prefix goes on on disk past the pool's `hits`:
        allocate blocks for the hits and the disk blocks (cached once loaded) and start the
        load. False (nothing changed) without a disk tier or a disk hit, or when the pool
        lacks the blocks now; the caller then computes the prompt as usual."""
        off, kv = self.offloader, self.kv_cache_manager
        if off is None:
            return False
        num_hits = len(hits)
        max_blocks = min((request.num_tokens - 1) // kv.block_size, len(request.block_hashes))
        num_load = off.store.count_prefix(request.block_hashes, num_hits, max_blocks)
        if request.request_id not in self._looked_up:  # once per request, not per try
            self._looked_up.add(request.request_id)
            off.stats.count_lookup(max_blocks, num_hits, num_load)
        if num_load == 0 or kv.allocate_slots(request, num_load * kv.block_size, hits,
                                              num_hits * kv.block_size,
                                              delay_cache_blocks=True) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = (request, num_hits, num_load)
        off.load(request.request_id, request.block_hashes[num_hits:num_hits + num_load],
                 kv.get_block_ids(request.request_id)[num_hits:num_hits + num_load])
        return True

    def _take_loaded(self) -> list[Request]:
        """Apply the loads the offloader reports ended (see the module's drawing)."""
        assert self.offloader is not None
        kv, ready = self.kv_cache_manager, []
        for request_id, num_loaded in self.offloader.take_finished().items():
            request, num_hits, num_load = self.loading.pop(request_id)
            if request_id in self.aborted_loading:
                self.aborted_loading.discard(request_id)
                kv.free(request)
                continue
            request.num_computed_tokens = (num_hits + num_loaded) * kv.block_size
            kv.cache_blocks(request, request.num_computed_tokens)
            if num_loaded < num_load:  # recompute the rest, from the pool's hits again
                kv.free(request)
                request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready

    def free_finished(self, request: Request) -> None:
        """Free a finished request's blocks, unless a transfer still needs them: the
        connector delays a prefill's (its params are then `HeldBlocks`), a receive still
        writing an aborted request's holds them until it ends."""
        kv = self.kv_cache_manager
        request_id = request.request_id
        self._looked_up.discard(request_id)
        if request_id in self.loading:
            self.aborted_loading.add(request_id)
            return
        if self.waiting_for_remote_kvs.pop(request_id, None) is not None and \
                self.kv_connector is not None and self.kv_connector.is_recving(request_id):
            self.aborted_recving[request_id] = request
            return
        if self.kv_connector is not None and \
                self.kv_connector.request_finished(request, kv.get_block_ids(request_id)):
            request.kv_transfer_params = HeldBlocks(
                request.block_hashes[:request.num_prompt_tokens // kv.block_size])
            self.finished_sending[request_id] = request
        else:
            kv.free(request)
            request.kv_transfer_params = None

    def take_finished(self) -> list[Request]:
        """Apply the transfers the connector reports ended: free sent (or aborted, received)
        requests' blocks. Returns the received requests, now WAITING: their KV is in place,
        their tokens computed and full blocks cached (the caller queues them)."""
        ready = self._take_loaded() if self.loading else []
        if self.kv_connector is None or not (self.finished_sending or
                                             self.waiting_for_remote_kvs or self.aborted_recving):
            return ready
        kv = self.kv_cache_manager
        sent, received = self.kv_connector.get_finished()
        for request_id in sent:
            kv.free(self.finished_sending.pop(request_id))
        for request_id, ok in received.items():
            if (request := self.aborted_recving.pop(request_id, None)) is not None:
                kv.free(request)
                continue
            request = self.waiting_for_remote_kvs.get(request_id)
            params = None if request is None else request.kv_transfer_params
            if not isinstance(params, RemotePrefill) or not (ok or params.recompute_on_failure):
                continue  # a failed receive: the service aborts the request
            del self.waiting_for_remote_kvs[request_id]
            assert request is not None
            if not ok:  # a peer's KV that did not arrive: compute the prompt here
                kv.free(request)
                request.num_computed_tokens = 0
                request.num_external_computed_tokens = 0
                request.kv_transfer_params = params.after
                request.status = RequestStatus.WAITING
                ready.append(request)
            else:
                if params.after is not None:
                    request.kv_transfer_params = params.after
                num_computed = params.num_computed_tokens
                request.num_computed_tokens = num_computed
                # NOTE: blocks out of a sliding window hold what the sender's freed blocks
                # held: freed here before caching, never cached.
                kv.remove_skipped_blocks(request, num_computed)
                kv.cache_blocks(request, num_computed)
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready

    def views(self) -> Iterator[RequestView]:
        """Views of the requests whose blocks a transfer holds: sends, then receives."""
        kv = self.kv_cache_manager
        yield from (RequestView.of(r, kv, "send") for r in self.finished_sending.values())
        for held in (self.waiting_for_remote_kvs, self.aborted_recving):
            yield from (RequestView.of(r, kv, "receive") for r in held.values())
        yield from (RequestView.of(r, kv, "load") for r, _, _ in self.loading.values())
