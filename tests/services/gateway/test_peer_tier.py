"""The peer tier's placement: a hint to fetch a prefix from the instance that holds it, when
fetching beats computing (services/gateway/peer_tier.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.gateway.peer_tier import Holder, PeerFetchCost, PeerKV, choose_peer
from pdserve.services.gateway.placement import Placement, Placer
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from tests.services.gateway import test_placement as placement_tests
from tests.services.gateway.test_placement import FakeRegistry

BLOCK = 16
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2-135M's block in fp32 (737,280 bytes)


@dataclass
class Info(placement_tests.Info):
    """An instance that advertises its block's bytes (the peer tier asks only those)."""

    kv_block_bytes: int = BLOCK_BYTES


def test_the_cost_weighs_bytes_against_prefill_tokens():
    cost = PeerFetchCost(bandwidth=1e9, prefill_rate=2000.0, overhead_s=0.02)
    # 8 blocks: 5.9 MB = 5.9 ms + 20 ms to fetch, 128 tokens = 64 ms to compute.
    assert cost.worth_fetching(8, BLOCK_BYTES, BLOCK)
    # 1 block: 20.7 ms to fetch, 8 ms to compute.
    assert not cost.worth_fetching(1, BLOCK_BYTES, BLOCK)
    # A slow link: 8 blocks take 590 ms at 10 MB/s.
    assert not PeerFetchCost(bandwidth=1e7).worth_fetching(8, BLOCK_BYTES, BLOCK)
    # A fast prefill (a GPU's 50k tokens/s): computing 128 tokens takes 2.6 ms.
    assert not PeerFetchCost(prefill_rate=50_000).worth_fetching(8, BLOCK_BYTES, BLOCK)
    assert not PeerFetchCost(prefill_rate=0).worth_fetching(100, BLOCK_BYTES, BLOCK)
    assert not cost.worth_fetching(0, BLOCK_BYTES, BLOCK)
    assert not cost.worth_fetching(8, 0, BLOCK)


def test_choose_peer_takes_the_holder_of_the_most_blocks_but_never_itself():
    cost = PeerFetchCost()
    holders = [Holder("a:1", 10, BLOCK_BYTES), Holder("b:1", 20, BLOCK_BYTES),
               Holder("c:1", 30, 0)]  # c predates the peer tier: never asked
    assert choose_peer(holders, "x:1", 0, BLOCK, cost) == PeerKV("b:1", 20)
    assert choose_peer(holders, "b:1", 0, BLOCK, cost) == PeerKV("a:1", 10)
    # The computing instance already holds 19 of b's 20: one block is not worth a fetch.
    assert choose_peer(holders, "x:1", 19, BLOCK, cost) is None
    assert choose_peer([], "x:1", 0, BLOCK, cost) is None


PROMPT = list(range(1000, 1000 + 20 * BLOCK + 5))  # 20 full blocks and 5 tokens


def _hashes(ids):
    return hash_request_tokens(ids, BLOCK, block_extra_keys("m", None))


async def test_a_busy_holder_below_the_cache_threshold_is_fetched_from():
    """d0 holds 8 of the 20 blocks (under MIN_CACHED_FRACTION, so load decides) and is
    busy: the request goes to d1, told to fetch the 8 blocks from d0."""
    h = _hashes(PROMPT)
    registry = FakeRegistry([Info("d0", "decode", "d0:1", num_running=5),
                             Info("d1", "decode", "d1:1")], held={"d0": set(h[:8])})
    placer = Placer(registry=registry)
    got = await placer.place(PROMPT, model_name="m", block_size=BLOCK)
    assert got == Placement(None, "d1:1", PeerKV("d0:1", 8))
    assert placer.num_peer_hints == 1


async def test_the_hint_goes_to_the_instance_computing_the_prompt():
    """With a prefill instance the prefill computes: the decode holding the prefix is its
    peer. An avoided (failed) holder is never named; the tier off names none."""
    h = _hashes(PROMPT)
    instances = [Info("p0", "prefill", "p0:1"), Info("d0", "decode", "d0:1", num_running=5),
                 Info("d1", "decode", "d1:1")]
    registry = FakeRegistry(instances, held={"d0": set(h[:8])})
    placer = Placer(registry=registry)
    got = await placer.place(PROMPT, model_name="m", block_size=BLOCK)
    assert got == Placement("p0:1", "d1:1", PeerKV("d0:1", 8))
    got = await placer.place(PROMPT, model_name="m", block_size=BLOCK, avoid={"d0:1"})
    assert got == Placement("p0:1", "d1:1")
    off = Placer(registry=registry, peer_cost=PeerFetchCost(prefill_rate=0))
    assert await off.place(PROMPT, model_name="m", block_size=BLOCK) == \
        Placement("p0:1", "d1:1")


async def test_no_hint_when_the_computing_instance_holds_the_prefix():
    h = _hashes(PROMPT)
    registry = FakeRegistry([Info("d0", "decode", "d0:1"), Info("d1", "decode", "d1:1")],
                            held={"d0": set(h[:20]), "d1": set(h[:3])})
    placer = Placer(registry=registry)
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == \
        Placement(None, "d0:1")
