"""A FetchKV that fails because of the prefill side (nothing listens at its address, or it goes
away mid-transfer) makes the decode's Generate answer ABORTED naming the prefill and the
original status, never UNAVAILABLE: the gateway takes UNAVAILABLE from Generate for the DECODE
instance's failure, ABORTED for a failed transfer (docs/services-contracts.md). The decode
frees the request's blocks and caches nothing half-written."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.services.helpers import (
    RPC_TIMEOUT,
    free_port,
    greedy,
    num_handle_blocks,
    wait_leak_free,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")
Code = grpc.StatusCode


class DyingPrefill(engine_pb2_grpc.PrefillServiceServicer):
    """Streams the first well-formed chunk of one block, then hangs until its server stops."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.first_chunk_sent = asyncio.Event()

    async def FetchKV(self, request, context):
        layout = self.layout
        shape = [layout.num_layers, 2, 1, layout.block_size, layout.num_kv_heads,
                 layout.head_dim]
        size = layout.itemsize
        for dim in shape:
            size *= dim
        yield pb.KVChunk(request_id=request.request_id, block_indices=request.block_indices[:1],
                         dtype=layout.dtype, shape=shape, data=bytes(size))
        self.first_chunk_sent.set()
        await asyncio.Event().wait()  # cancelled by server.stop()


async def _prefilled(cluster, request_id: str, seed: int) -> tuple[list[int], pb.PrefillResponse]:
    """A real Prefill on the cluster's prefill (6 full blocks pinned there)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(100)]
    resp = await cluster.prefill_stub.Prefill(
        pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                          sampling_params=greedy(8)), timeout=RPC_TIMEOUT)
    return prompt, resp


async def _generate_status(cluster, request_id: str, prompt: list[int],
                           resp: pb.PrefillResponse, address: str) -> tuple[Code, str]:
    handle = pb.KVTransferParams()
    handle.CopyFrom(resp.kv_transfer_params)
    handle.prefill_address = address
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                           output_token_ids=[resp.first_token_id], sampling_params=greedy(8),
                           kv_transfer_params=handle)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT):
            pass
    return info.value.code(), info.value.details()


async def _assert_decode_clean(cluster, prefill_resp: pb.PrefillResponse) -> None:
    _, state = await wait_leak_free(cluster, decode_only=True)
    assert (state.num_used_blocks, state.num_running, state.num_waiting) == (0, 0, 0), state
    assert state.invariants_ok, state.invariants_error
    cached = await cluster.decode.worker.engine.call(
        lambda e: set(e.kv_cache_manager.block_pool.cached_block_hash_to_block))
    assert not set(prefill_resp.kv_transfer_params.block_hashes) & cached


async def _release(cluster, request_id: str) -> None:
    """The decode's ReleaseKV went to the wrong address: unpin on the real prefill."""
    released = await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id=request_id),
                                                    timeout=RPC_TIMEOUT)
    assert released.released


async def test_fetch_from_an_address_where_nothing_listens_is_aborted(cluster):
    rid = "fetch-nobody"
    prompt, resp = await _prefilled(cluster, rid, 1)
    assert num_handle_blocks(resp.kv_transfer_params) >= 6
    address = f"127.0.0.1:{free_port()}"
    code, details = await _generate_status(cluster, rid, prompt, resp, address)
    assert code == Code.ABORTED, (code, details)
    assert address in details and "UNAVAILABLE" in details, details
    await _assert_decode_clean(cluster, resp)
    await _release(cluster, rid)


async def test_prefill_stopping_mid_transfer_is_aborted(cluster):
    rid = "fetch-dying"
    prompt, resp = await _prefilled(cluster, rid, 2)
    servicer = DyingPrefill(cluster.decode.worker.layout)
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    engine_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        generate = asyncio.ensure_future(_generate_status(cluster, rid, prompt, resp, address))
        await asyncio.wait_for(servicer.first_chunk_sent.wait(), 60)
        await asyncio.wait_for(server.stop(0), 30)  # the prefill goes away mid-stream
        code, details = await asyncio.wait_for(generate, 60)
    finally:
        await asyncio.wait_for(server.stop(0), 30)
    assert code == Code.ABORTED, (code, details)
    assert address in details, details
    assert any(name in details for name in ("UNAVAILABLE", "CANCELLED", "INTERNAL")), details
    await _assert_decode_clean(cluster, resp)
    await _release(cluster, rid)


class Forwarder:
    """A TCP port that forwards to `target` while open; nothing listens while closed."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.pipes: set[asyncio.Task] = set()

    async def open(self) -> None:
        async def pipe(reader, writer) -> None:
            try:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
            for task in (pipe(reader, up_writer), pipe(up_reader, writer)):
                self.pipes.add(asyncio.ensure_future(task))

        self.server = await asyncio.start_server(handle, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in self.pipes:
                task.cancel()
            await asyncio.gather(*self.pipes, return_exceptions=True)
            await self.server.wait_closed()


async def test_a_prefill_reachable_again_is_fetched_from_at_once(cluster):
    """A failed connect leaves the decode's channel in reconnect backoff; a fetch right after
    the prefill is reachable again waits for the channel instead of failing (the first
    requests of a host back from a network cut used to fail over)."""
    forwarder = Forwarder(cluster.prefill.identity.address)
    address = f"127.0.0.1:{forwarder.port}"
    try:
        rid = "fetch-down"
        prompt, resp = await _prefilled(cluster, rid, 3)
        code, details = await _generate_status(cluster, rid, prompt, resp, address)
        assert code == Code.ABORTED and "UNAVAILABLE" in details, (code, details)
        await _release(cluster, rid)
        await forwarder.open()
        rid = "fetch-back"
        prompt, resp = await _prefilled(cluster, rid, 4)
        handle = pb.KVTransferParams()
        handle.CopyFrom(resp.kv_transfer_params)
        handle.prefill_address = address
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                               output_token_ids=[resp.first_token_id],
                               sampling_params=greedy(8), kv_transfer_params=handle)
        chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
        assert sum(len(c.token_ids) for c in chunks) == 7  # max_tokens 8, one from the prefill
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        await forwarder.close()
    _, state = await wait_leak_free(cluster, decode_only=True)
    assert (state.num_used_blocks, state.num_running, state.num_waiting) == (0, 0, 0), state
    assert state.invariants_ok, state.invariants_error
