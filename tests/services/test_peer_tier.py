"""The peer tier over real gRPC and real engines: a decode instance told that a peer holds
its prompt's prefix (DecodeRequest.peer_kv) pins it there (KVPeerService.PinKV), fetches it
and computes only the rest, with the tokens of a fresh compute; any instance holds KV for a
peer (PinKV on the prefill and on the decode); a peer that cannot pin, or dies mid-fetch,
costs a recompute, never the request, and leaks nothing (docs/kv-tiers.md)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.sampling_params import SamplingParams
from tests.services.decode.test_kv_fetch_failures import DyingPrefill
from tests.services.helpers import RPC_TIMEOUT, channel, free_port, greedy, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")
NUM_TOKENS = 12


def _prompt(seed: int, length: int = 150) -> list[int]:
    """A prompt no other test of the session's cluster uses (their blocks stay cached)."""
    rng = random.Random(f"peer-tier-{seed}")
    return [rng.randrange(100, 40000) for _ in range(length)]


def _reference(reference_llm, prompt: list[int]) -> list[int]:
    out = reference_llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))
    return list(out[0].outputs[0].token_ids)


async def _warm(cluster, prompt: list[int], request_id: str) -> None:
    """Compute `prompt` on the prefill instance and release it: its blocks stay cached."""
    await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=greedy(4)),
        timeout=RPC_TIMEOUT)
    await cluster.prefill_stub.ReleaseKV(pb.ReleaseKVRequest(request_id=request_id),
                                         timeout=RPC_TIMEOUT)


async def _generate(cluster, request_id: str, prompt: list[int], peer: pb.PeerKV
                    ) -> tuple[list[int], list[pb.TokenChunk]]:
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                           sampling_params=greedy(NUM_TOKENS), peer_kv=peer)
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=60)]
    return [t for c in chunks for t in c.token_ids], chunks


def _peer_value(cluster, name: str, **labels: str) -> float:
    return cluster.decode.worker.metrics.value(name, tier="peer", **labels)


async def _clean(cluster) -> None:
    states = await wait_leak_free(cluster)
    for s in states:
        assert (s.num_used_blocks, s.num_pinned_blocks, s.num_running, s.num_waiting) == \
            (0, 0, 0, 0), s
        assert s.invariants_ok, s.invariants_error


async def _decode_cached(cluster) -> set[bytes]:
    return await cluster.decode.worker.engine.call(
        lambda e: set(e.kv_cache_manager.block_pool.cached_block_hash_to_block))


async def test_a_prefix_fetched_from_a_peer_gives_the_tokens_of_a_fresh_compute(
        cluster, reference_llm):
    prompt = _prompt(11)
    want = _reference(reference_llm, prompt)
    await _warm(cluster, prompt, "peer-warm-1")
    before = _peer_value(cluster, "kv_tier_loads_total")
    served = cluster.prefill.worker.metrics.value("kv_tier_served_total", tier="peer")
    got, chunks = await _generate(cluster, "peer-1", prompt,
                                  pb.PeerKV(address=cluster.prefill.identity.address,
                                            num_blocks=9))
    assert got == want
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # 150 tokens: 9 full blocks, all pinned and fetched (with the 145th token's block).
    assert _peer_value(cluster, "kv_tier_loads_total") - before == 10
    assert cluster.prefill.worker.metrics.value("kv_tier_served_total", tier="peer") - \
        served == 9
    # The dashboard's tier rows (the state feed's TierViews) carry the peer tier.
    peer = {v.tier: v for v in cluster.decode.worker.metrics.kv_tier_views()}["peer"]
    assert peer.loads >= 10 and peer.hits == peer.loads and peer.queries >= peer.hits
    holder = {v.tier: v for v in cluster.prefill.worker.metrics.kv_tier_views()}["peer"]
    assert holder.stores >= 9
    await _clean(cluster)


async def test_the_decode_holds_kv_for_a_peer_as_the_prefill_does(cluster):
    """PinKV on the decode instance (a unified engine is a peer too) hands out the same KV
    as the prefill instance's for the same prefix."""
    prompt = _prompt(12, 70)  # 4 full blocks
    tokens = prompt[:4 * 16 + 1]
    await cluster.decode_stub.Generate(pb.DecodeRequest(
        request_id="peer-warm-2", prompt_token_ids=prompt, sampling_params=greedy(2)),
        timeout=60).read()
    blocks = {}
    for name, runtime in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        async with channel(runtime.identity.address) as ch:
            stub = engine_pb2_grpc.KVPeerServiceStub(ch)
            resp = await stub.PinKV(pb.PinKVRequest(request_id=f"pin-{name}",
                                                    prompt_token_ids=tokens),
                                    timeout=RPC_TIMEOUT)
            params = resp.kv_transfer_params
            assert (params.num_tokens, len(params.block_hashes)) == (65, 4)
            assert params.prefill_address == runtime.identity.address
            chunks = [c async for c in stub.FetchKV(pb.FetchKVRequest(
                request_id=f"pin-{name}", block_indices=[0, 1, 2, 3]), timeout=RPC_TIMEOUT)]
            released = await stub.ReleaseKV(pb.ReleaseKVRequest(request_id=f"pin-{name}"),
                                            timeout=RPC_TIMEOUT)
            assert released.released
            blocks[name] = (list(params.block_hashes), b"".join(c.data for c in chunks))
    assert blocks["prefill"][0] == blocks["decode"][0]
    import numpy as np

    a, b = (np.frombuffer(blocks[n][1], np.float32) for n in ("prefill", "decode"))
    assert a.shape == b.shape and a.size > 0
    assert np.allclose(a, b, rtol=1e-4, atol=1e-4), float(np.abs(a - b).max())
    await _clean(cluster)


async def test_a_peer_where_nothing_listens_costs_a_recompute(cluster, reference_llm):
    prompt = _prompt(13)
    want = _reference(reference_llm, prompt)
    failures = _peer_value(cluster, "kv_tier_failures_total", op="pin")
    got, _ = await _generate(cluster, "peer-nobody", prompt,
                             pb.PeerKV(address=f"127.0.0.1:{free_port()}", num_blocks=9))
    assert got == want
    assert _peer_value(cluster, "kv_tier_failures_total", op="pin") - failures == 1
    await _clean(cluster)


class DyingPeer(DyingPrefill, engine_pb2_grpc.KVPeerServiceServicer):
    """Pins with a real handle (the prefill's, for this prompt), streams one chunk of
    FetchKV, then hangs until its server stops."""

    def __init__(self, layout, params: pb.KVTransferParams) -> None:
        super().__init__(layout)
        self.params = params
        self.released = asyncio.Event()

    async def PinKV(self, request, context):
        return pb.PinKVResponse(kv_transfer_params=self.params)

    async def ReleaseKV(self, request, context):
        self.released.set()
        return pb.ReleaseKVResponse(released=True)


async def test_a_peer_that_dies_mid_fetch_costs_a_recompute(cluster, reference_llm):
    prompt = _prompt(14)
    want = _reference(reference_llm, prompt)
    async with channel(cluster.prefill.identity.address) as ch:  # a real handle's fields
        stub = engine_pb2_grpc.KVPeerServiceStub(ch)
        pinned = await stub.PinKV(pb.PinKVRequest(request_id="peer-dying-src",
                                                  prompt_token_ids=prompt[:9 * 16 + 1]),
                                  timeout=RPC_TIMEOUT)
        await stub.ReleaseKV(pb.ReleaseKVRequest(request_id="peer-dying-src"),
                             timeout=RPC_TIMEOUT)
    servicer = DyingPeer(cluster.decode.worker.layout, pinned.kv_transfer_params)
    server = grpc.aio.server()
    engine_pb2_grpc.add_KVPeerServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    servicer.params.prefill_address = address
    await server.start()
    failures = _peer_value(cluster, "kv_tier_failures_total", op="fetch")
    try:
        generate = asyncio.ensure_future(_generate(
            cluster, "peer-dying", prompt, pb.PeerKV(address=address, num_blocks=9)))
        await asyncio.wait_for(servicer.first_chunk_sent.wait(), 60)
        await asyncio.wait_for(server.stop(0), 30)  # the peer goes away mid-stream
        got, chunks = await asyncio.wait_for(generate, 60)
    finally:
        await asyncio.wait_for(server.stop(0), 30)
    assert got == want
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert _peer_value(cluster, "kv_tier_failures_total", op="fetch") - failures == 1
    # The half-written block was never cached: the prompt's blocks now are the recompute's.
    await _clean(cluster)


async def test_a_prefill_fetches_a_prefix_the_decode_holds(cluster, reference_llm):
    """The prefill instance is told the decode holds the prompt's prefix: it fetches it
    from there, computes the rest and hands the whole prompt's KV to the decode."""
    prompt = _prompt(15)
    want = _reference(reference_llm, prompt)
    await cluster.decode_stub.Generate(pb.DecodeRequest(  # the decode computes and caches it
        request_id="peer-warm-3", prompt_token_ids=prompt, sampling_params=greedy(2)),
        timeout=60).read()
    metrics = cluster.prefill.worker.metrics
    before = metrics.value("kv_tier_loads_total", tier="peer")
    resp = await cluster.prefill_stub.Prefill(pb.PrefillRequest(
        request_id="peer-prefill", prompt_token_ids=prompt, sampling_params=greedy(NUM_TOKENS),
        peer_kv=pb.PeerKV(address=cluster.decode.identity.address, num_blocks=9)),
        timeout=60)
    assert metrics.value("kv_tier_loads_total", tier="peer") - before == 10
    req = pb.DecodeRequest(request_id="peer-prefill", prompt_token_ids=prompt,
                           output_token_ids=[resp.first_token_id],
                           sampling_params=greedy(NUM_TOKENS),
                           kv_transfer_params=resp.kv_transfer_params)
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=60)]
    assert [resp.first_token_id] + [t for c in chunks for t in c.token_ids] == want
    await _clean(cluster)


async def test_the_parity_prompts_with_a_peers_prefix_equal_the_engine(
        cluster, reference_llm, parity_prompt_ids):
    """The parity suite's prompts, each with its prefix fetched from the prefill instance
    (under a cache_salt of their own, so that the decode holds none of their blocks)."""
    from tests.conftest import NUM_PARITY_TOKENS

    outs = reference_llm.generate([{"prompt_token_ids": ids} for ids in parity_prompt_ids],
                                  SamplingParams(temperature=0.0, max_tokens=NUM_PARITY_TOKENS))
    before = _peer_value(cluster, "kv_tier_loads_total")
    expected_loads = 0
    for i, prompt in enumerate(parity_prompt_ids):
        salt = "peer-parity"
        await cluster.prefill_stub.Prefill(pb.PrefillRequest(
            request_id=f"peer-parity-warm-{i}", prompt_token_ids=prompt, cache_salt=salt,
            sampling_params=greedy(2)), timeout=RPC_TIMEOUT)
        await cluster.prefill_stub.ReleaseKV(
            pb.ReleaseKVRequest(request_id=f"peer-parity-warm-{i}"), timeout=RPC_TIMEOUT)
        num_blocks = (len(prompt) - 2) // 16
        assert num_blocks >= 2
        req = pb.DecodeRequest(request_id=f"peer-parity-{i}", prompt_token_ids=prompt,
                               cache_salt=salt, sampling_params=greedy(NUM_PARITY_TOKENS),
                               peer_kv=pb.PeerKV(address=cluster.prefill.identity.address,
                                                 num_blocks=num_blocks))
        chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=60)]
        got = [t for c in chunks for t in c.token_ids]
        assert got == list(outs[i].outputs[0].token_ids), i
        # The first prompt's blocks; later ones share the chat template's first blocks.
        if i == 0:
            expected_loads = num_blocks + 1
    assert _peer_value(cluster, "kv_tier_loads_total") - before >= expected_loads
    await _clean(cluster)
