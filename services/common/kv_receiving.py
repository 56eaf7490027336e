"""KVReceiving: take a prompt's KV from the instance that holds it, into this engine's pool.

    handle (a prefill's for its decode, or a peer's from PinKV) ──▶ check_handle (verified)
      ▼
    engine request, kv_transfer_params=RemotePrefill(num_tokens=N):
      │ WAITING_FOR_REMOTE_KVS in the scheduler, which allocates its blocks in its own
      │ admission order (prefix-cache hits + fresh blocks, not cached yet)
      ▼
    KVFetcher.fetch (this loop, told the block ids by the connector): only the missing
      │ blocks; ReleaseKV to the holder as soon as the transfer ends, success or not
      ▼
    connector.recv_finished ──▶ Scheduler.update_from_kv_xfer_finished (engine op):
      │ num_computed_tokens = N, blocks cached, WAITING (then `RemotePrefill.after`)
      ▼
    scheduled like any request (continuous batch)

A prefill's handle that fails aborts the request (the gateway places it again). A peer's
(the peer tier: docs/kv-tiers.md) is optional: a peer that cannot pin, or fails mid-fetch,
costs a recompute here (`RemotePrefill.recompute_on_failure`), never the request. Both roles
receive: the decode a prefill's KV and a peer's, the prefill a peer's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.common.kv_fetcher import KVFetcher
from pdserve.services.common.kv_holding import KVHolding
from pdserve.services.common.lora import check_kv_adapter
from pdserve.services.common.lora_modules import adapter_to_proto
from pdserve.services.common.state_feed import TransferView
from pdserve.shared.kv_transfer.params import KVHandle, RemoteDecode, RemotePrefill
from pdserve.shared.request import Request

logger = logging.getLogger(__name__)


class PeerHint(NamedTuple):
    """A peer that holds the prompt's first `num_blocks` full blocks (the gateway's
    placement, from the prefix index)."""

    address: str
    num_blocks: int


@dataclass(slots=True)
class Receive:
    """One request's receive (the request and its blocks are the scheduler's)."""

    request: Request
    handle: KVHandle | None = None
    transfer: asyncio.Task | None = None
    """Receive of the handle's KV, cancelled by Abort."""
    released: bool = False
    """ReleaseKV for `handle` was sent (or is being sent): never send it twice."""


class KVReceiving(KVHolding):
    """An engine worker that receives KV from other instances (and holds KV for them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fetcher = KVFetcher(self.engine_core.model_runner.kv_caches, self.config,
                                 self.metrics, self.engine.tracer)
        self._blocks_in_flight: dict[bytes, asyncio.Future] = {}
        """block_hash -> done when the transfer that fetches that block here has committed
        (or failed): a request with the same prefix waits for it and reuses the blocks."""

    def check_handle(self, request: Request, handle: KVHandle) -> None:
        """Does `handle` describe this request's prompt, in a layout we can take? ValueError
        naming the field if not; ServiceError(FAILED_PRECONDITION) for KV computed under
        another weight quantization (never mixed: other weights give other KV)."""
        if (handle.quantization or "none") != self.quantization:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"kv_transfer_params.quantization: the prefill instance runs "
                               f"quantization {handle.quantization or 'none'!r}, this decode "
                               f"instance runs {self.quantization!r}; KV computed by other "
                               "weights cannot be used (run prefill and decode with the same "
                               "--quantization)")
        check_kv_adapter(handle.lora_name, handle.lora_int_id, request.lora_request)
        if handle.layout != self.layout:
            raise ValueError(f"kv_transfer_params: KV layout {tuple(handle.layout)} does not "
                             f"match this instance's {tuple(self.layout)}")
        if handle.model != self.model_name:
            raise ValueError(f"kv_transfer_params.model is {handle.model!r}, this instance "
                             f"serves {self.model_name!r}")
        if not handle.prefill_address:
            raise ValueError("kv_transfer_params.prefill_address is empty")
        num_tokens, bs = handle.num_tokens, self.block_size
        if not 0 < num_tokens < request.num_tokens:
            raise ValueError(f"kv_transfer_params.num_tokens={num_tokens} must be in "
                             f"[1, {request.num_tokens - 1}]")
        if len(handle.block_hashes) != num_tokens // bs:
            raise ValueError(f"kv_transfer_params.block_hashes has {len(handle.block_hashes)} "
                             f"hashes, {num_tokens} tokens fill {num_tokens // bs} blocks")
        # NOTE: longrope: the prefill instance computed a prompt longer than the original
        # length with the long factors (shared/engine/longrope.py), and hashed it so.
        original = self.engine_core.scheduler.longrope_original
        if original is not None and num_tokens > original and not request.rope_long:
            request.set_rope_long()
        # NOTE: the request hashed its blocks when it was made (once: docs/lifecycle.md).
        expected = request.block_hashes[:num_tokens // bs]
        if list(handle.block_hashes) != expected:
            i = next((i for i, (a, b) in enumerate(zip(handle.block_hashes, expected)) if a != b),
                     min(len(handle.block_hashes), len(expected)))
            raise ValueError(f"kv_transfer_params.block_hashes: block {i} does not match the "
                             "prompt (another prompt, model or cache_salt)")

    async def start_receive(self, stream: Receive, handle: KVHandle,
                            after: RemoteDecode | None = None) -> asyncio.Task:
        """Wait out transfers of the same prefix, claim its blocks, and start the receive
        task (it waits for the scheduler to allocate the request's blocks); call before the
        request is added to the engine. `after`: the request's kv_transfer_params once its
        KV is in place (a prefill's RemoteDecode: held for its decode when it finishes)."""
        request = stream.request
        await self._wait_for_shared_blocks(handle)
        # NOTE: claimed with no await since the wait above, so two requests on one prefix
        # can never both find it unclaimed (some claimed blocks may turn out to be cached
        # here already; a request waiting on them then just waits for our commit).
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        mine = [h for h in handle.block_hashes if h not in self._blocks_in_flight]
        for block_hash in mine:
            self._blocks_in_flight[block_hash] = done
        allocated = loop.create_future()
        self.kv_connector.expect_recv(
            request.request_id,
            lambda ids, hit: loop.call_soon_threadsafe(_set_result, allocated, (ids, hit)))
        request.kv_transfer_params = RemotePrefill(handle.num_tokens,
                                                   recompute_on_failure=handle.peer, after=after)
        transfer = loop.create_task(self._receive(stream, handle, allocated))

        def on_done(task: asyncio.Task) -> None:
            for block_hash in mine:
                if self._blocks_in_flight.get(block_hash) is done:
                    del self._blocks_in_flight[block_hash]
            done.set_result(None)
            failed = task.cancelled() or task.exception() is not None
            if failed and not (handle.peer and not task.cancelled()):
                self.engine.request_abort([request.request_id])  # its ABORT ends the stream
            # NOTE: a peer's failed fetch is recomputed here (the scheduler's
            # recompute_on_failure): not the request's failure.

        transfer.add_done_callback(on_done)
        return transfer

    async def _receive(self, stream: Receive, handle: KVHandle,
                       allocated: asyncio.Future) -> None:
        """Fetch the missing blocks into those the scheduler allocated, tell the connector,
        and wait for the scheduler to take the KV in."""
        request_id = stream.request.request_id
        ok = False
        try:
            block_ids, num_hit_tokens = await allocated
            first_missing = num_hit_tokens // self.block_size
            # NOTE: blocks before a sliding window are the null block here: not fetched.
            missing = [i for i in range(first_missing, handle.num_blocks) if block_ids[i]]
            try:
                if missing:
                    await self.fetcher.fetch(request_id, handle.prefill_address, missing,
                                             [block_ids[i] for i in missing], handle.peer)
                ok = True
            except ServiceError as e:
                if not handle.peer:
                    raise
                logger.warning("[%s] fetch from peer %s failed (%s): computing the prompt "
                               "here", request_id, handle.prefill_address, e)
                self.metrics.tier_metrics().peer_fetched(len(missing), 0, "fetch")
            else:
                if handle.peer:
                    self.metrics.tier_metrics().peer_fetched(len(missing), len(missing))
            finally:
                # Our blocks hold the KV now (or the transfer failed): the prefill's pin has
                # served its purpose, whatever the decode does next.
                self.release_handle(stream)
        finally:
            self.kv_connector.recv_finished(request_id, ok)
            taken = self.engine.submit(lambda e: e.scheduler.update_from_kv_xfer_finished())
        await taken
        logger.debug("[%s] KV in place: %d blocks reused, %d fetched from %s", request_id,
                     first_missing, len(missing), handle.prefill_address)

    async def _wait_for_shared_blocks(self, handle: KVHandle) -> None:
        """Wait until no transfer in flight here is fetching a prefix block of `handle`.

        Requests sharing a prefix arrive together (a burst on one system prompt): without
        this, each would fetch the whole shared prefix, since fetched blocks join the prefix
        cache only when their transfer commits. Waiting lets the first transfer commit and
        the others hit its blocks. Bounded by the fetch timeout of the transfer waited for;
        if that transfer fails, this one fetches the blocks itself.
        """
        while True:
            pending = {self._blocks_in_flight[h] for h in handle.block_hashes
                       if h in self._blocks_in_flight}
            if not pending:
                return
            await asyncio.wait(pending)

    def release_handle(self, stream: Receive) -> None:
        """ReleaseKV for the stream's handle, as a tracked background task (`close` awaits
        or cancels it); once per stream, later calls and streams without a handle are
        no-ops."""
        if stream.handle is None or stream.released:
            return
        stream.released = True
        self.spawn(self.fetcher.release(stream.request.request_id, stream.handle.prefill_address,
                                        stream.handle.peer))

    async def pin_peer(self, request: Request, peer: PeerHint) -> KVHandle | None:
        """PinKV at `peer` for the prompt's first k full blocks (k: the hint's, leaving at
        least two prompt tokens to compute here), checked as a prefill's handle; None
        (the prompt is computed here) when the peer cannot, logged and counted."""
        bs = self.block_size
        k = min(peer.num_blocks, (request.num_prompt_tokens - 2) // bs)
        if k <= 0 or peer.address == self.identity.address:
            return None
        lora = request.lora_request
        try:
            handle = await self.fetcher.pin(
                request.request_id, peer.address, request.prompt_token_ids[:k * bs + 1],
                request.cache_salt, None if lora is None else adapter_to_proto(lora))
        except ServiceError as e:
            logger.warning("[%s] %s: computing the prompt here", request.request_id, e)
            self.metrics.tier_metrics().peer_fetched(k, 0, "pin")
            return None
        try:
            self.check_handle(request, handle)
        except (ValueError, ServiceError) as e:
            logger.warning("[%s] peer %s pinned KV this instance cannot take (%s): computing "
                           "the prompt here", request.request_id, peer.address, e)
            self.metrics.tier_metrics().peer_fetched(k, 0, "pin")
            self.spawn(self.fetcher.release(request.request_id, peer.address, True))
            return None
        return handle

    async def _receive_peer(self, request: Request, peer: PeerHint) -> Receive | None:
        """Pin the prefix `peer` holds and start its receive into `request`'s blocks (the
        request's kv_transfer_params, RemoteDecode or None, apply once it is in place);
        None when the peer cannot pin (the prompt is computed here)."""
        handle = await self.pin_peer(request, peer)
        if handle is None:
            return None
        receive = Receive(request, handle)
        after = request.kv_transfer_params
        assert after is None or isinstance(after, RemoteDecode)
        receive.transfer = await self.start_receive(receive, handle, after)
        return receive

    async def _end_receive(self, receive: Receive) -> None:
        if receive.transfer is not None and not receive.transfer.done():
            receive.transfer.cancel()
            await asyncio.gather(receive.transfer, return_exceptions=True)
        self.release_handle(receive)

    def transfers(self) -> list[TransferView]:
        now = time.monotonic()
        return super().transfers() + [
            TransferView(rid, "receive", address, num_blocks, now - start)
            for rid, (address, num_blocks, start) in self.fetcher.in_flight.items()]

    async def close(self) -> None:
        await super().close()
        await self.fetcher.close()


def _set_result(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)
