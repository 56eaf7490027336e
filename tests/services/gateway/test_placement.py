"""Placer: longest cached prefix first, then load; conditional disaggregation; fallbacks."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.gateway.placement import Placement, Placer
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens

BLOCK = 16


@dataclass
class Info:
    instance_id: str
    role: str
    address: str
    num_running: int = 0
    num_waiting: int = 0


class FakeRegistry:
    def __init__(self, instances, held=None, fail=False):
        self.instances = instances
        self.held = held or {}  # instance_id -> set of block hashes
        self.fail = fail
        self.lookups = []

    async def live_instances(self, role=None):
        if self.fail:
            raise ConnectionError("redis down")
        return [i for i in self.instances if role is None or i.role == role]

    async def longest_prefix(self, block_hashes):
        if self.fail:
            raise ConnectionError("redis down")
        self.lookups.append(list(block_hashes))
        out = {}
        for iid, held in self.held.items():
            n = 0
            while n < len(block_hashes) and block_hashes[n] in held:
                n += 1
            if n:
                out[iid] = n
        return out


def _hashes(ids, salt=None):
    return hash_request_tokens(ids, BLOCK, block_extra_keys("m", salt))


PROMPT = list(range(100, 164))  # 4 full blocks
INSTANCES = [Info("p0", "prefill", "p0:1"), Info("p1", "prefill", "p1:1"),
             Info("d0", "decode", "d0:1"), Info("d1", "decode", "d1:1")]


async def test_static_lists_least_in_flight():
    placer = Placer(["p0:1", "p1:1"], ["d0:1", "d1:1"])
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p0:1", "d0:1")
    placer.in_flight.begin("p0:1")
    placer.in_flight.begin("d0:1")
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p1:1", "d1:1")
    placer.in_flight.end("p0:1")
    placer.in_flight.end("d0:1")
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p0:1", "d0:1")


async def test_longest_cached_prefix_wins_over_load():
    h = _hashes(PROMPT)
    registry = FakeRegistry(
        [Info("p0", "prefill", "p0:1", num_running=0), Info("p1", "prefill", "p1:1", 9),
         Info("d0", "decode", "d0:1", 0), Info("d1", "decode", "d1:1", 9)],
        held={"p1": set(h[:3]), "p0": {h[0]}, "d1": set(h[:2])})
    placer = Placer(registry=registry)
    got = await placer.place(PROMPT, model_name="m", block_size=BLOCK)
    assert got == Placement("p1:1", "d1:1")
    assert registry.lookups == [h]


async def test_ties_broken_by_load():
    registry = FakeRegistry([Info("p0", "prefill", "p0:1", 3, 1), Info("p1", "prefill", "p1:1", 1),
                             Info("d0", "decode", "d0:1", 0, 2), Info("d1", "decode", "d1:1", 1)])
    got = await Placer(registry=registry).place(PROMPT, model_name="m", block_size=BLOCK)
    assert got == Placement("p1:1", "d1:1")


async def test_cache_salt_changes_the_lookup():
    registry = FakeRegistry(INSTANCES, held={"p1": set(_hashes(PROMPT))})
    placer = Placer(registry=registry)
    assert (await placer.place(PROMPT, model_name="m", block_size=BLOCK)).prefill_address == "p1:1"
    salted = await placer.place(PROMPT, model_name="m", block_size=BLOCK, cache_salt="t1")
    assert salted.prefill_address == "p0:1"


async def test_short_uncached_part_goes_straight_to_decode():
    h = _hashes(PROMPT)
    registry = FakeRegistry(INSTANCES, held={"d0": set(h)})
    placer = Placer(registry=registry, local_prefill_threshold=32)
    # 64 tokens, 64 cached on d0: uncached 0 < 32 -> local prefill on d0.
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement(None, "d0:1")
    # A fresh prompt of 64 uncached tokens is disaggregated.
    other = list(range(500, 564))
    assert (await placer.place(other, model_name="m", block_size=BLOCK)).prefill_address
    # Short prompts without any cache, too.
    assert (await placer.place([1, 2, 3], model_name="m", block_size=BLOCK)).prefill_address is None


async def test_full_prefill_queue_sends_the_prompt_to_its_decode_instance():
    placer = Placer(["p0:1", "p1:1"], ["d0:1"], max_prefill_queue_size=2)
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p0:1", "d0:1")
    for _ in range(2):
        placer.in_flight.begin("p0:1")
    # p0 has 2 in flight: p1 (least loaded) still has room
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p1:1", "d0:1")
    placer.in_flight.begin("p1:1")
    placer.in_flight.begin("p1:1")
    # every prefill queue is full: the decode instance prefills, and it is counted
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement(None, "d0:1")
    assert placer.num_local_by_load == 1
    placer.in_flight.end("p1:1")
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("p1:1", "d0:1")
    # 0: no bound
    unbounded = Placer(["p0:1"], ["d0:1"])
    for _ in range(50):
        unbounded.in_flight.begin("p0:1")
    assert (await unbounded.place(PROMPT, model_name="m", block_size=BLOCK)).prefill_address


async def test_registry_down_falls_back_to_static_lists():
    placer = Placer(["sp:1"], ["sd:1"], registry=FakeRegistry(INSTANCES, fail=True))
    assert await placer.place(PROMPT, model_name="m", block_size=BLOCK) == Placement("sp:1", "sd:1")
    assert await placer.addresses("decode") == ["sd:1"]


async def test_no_decode_instance_means_no_placement_and_no_prefill_means_local():
    assert await Placer(["p:1"], []).place(PROMPT, model_name="m", block_size=BLOCK) is None
    assert await Placer([], ["d:1"]).place(PROMPT, model_name="m", block_size=BLOCK) == \
        Placement(None, "d:1")
