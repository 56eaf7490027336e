"""Discovery through the registry alone: the gateway places on instances that register while
it serves, stops placing on those whose registration expired, keeps its last view while
Redis is down, and forgets (closes the channel of) an instance gone for FORGET_AFTER_S once
no call runs on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from pdserve.services.gateway import health as health_module
from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.health import HealthTracker, InstanceStatus
from pdserve.services.gateway.placement import Placer
from pdserve.services.proto import engine_pb2, engine_pb2_grpc


@dataclass
class Info:
    instance_id: str
    role: str
    address: str
    num_running: int = 0
    num_waiting: int = 0


class MutableRegistry:
    """Instances come and go; `is_up` False makes it answer nothing (as PrefixIndex does)."""

    def __init__(self, *instances: Info) -> None:
        self.instances = list(instances)
        self.is_up = True

    async def live_instances(self, role=None):
        if not self.is_up:
            return []
        return [i for i in self.instances if role is None or i.role == role]

    async def longest_prefix(self, block_hashes):
        return {}


async def _decode(placer: Placer) -> str:
    placement = await placer.place(list(range(40)), model_name="m", block_size=16)
    assert placement is not None
    return placement.decode_address


async def test_instances_that_join_are_placed_on_and_expired_ones_are_not():
    registry = MutableRegistry(Info("p0", "prefill", "p0:1"),
                               Info("d0", "decode", "d0:1", num_running=3))
    placer = Placer(registry=registry)
    assert await _decode(placer) == "d0:1"
    registry.instances.append(Info("d1", "decode", "d1:1"))  # joins, idle
    assert await _decode(placer) == "d1:1"
    registry.instances = [i for i in registry.instances if i.instance_id != "d1"]  # expires
    assert {await _decode(placer) for _ in range(5)} == {"d0:1"}
    assert await placer.addresses("decode") == ["d0:1"]


async def test_a_short_shared_prefix_does_not_outweigh_load(monkeypatch):
    """Every chat prompt starts with the template's system prompt: the decode that cached
    those blocks first must not get all traffic (a joined decode would never get any)."""
    from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens

    class Held(MutableRegistry):
        held: dict[str, int]

        async def longest_prefix(self, block_hashes):
            return {iid: min(n, len(block_hashes)) for iid, n in self.held.items()}

    registry = Held(Info("d0", "decode", "d0:1", num_running=2), Info("d1", "decode", "d1:1"))
    registry.held = {"d0": 2}
    placer = Placer(registry=registry)
    prompt = list(range(160))  # 10 blocks, 2 of them cached on d0: 20 % < 50 %
    assert len(hash_request_tokens(prompt, 16, block_extra_keys("m", None))) == 10
    got = await placer.place(prompt, model_name="m", block_size=16)
    assert got is not None and got.decode_address == "d1:1"
    registry.held = {"d0": 5}  # half the prompt: affinity wins over load again
    got = await placer.place(prompt, model_name="m", block_size=16)
    assert got is not None and got.decode_address == "d0:1"


async def test_the_last_view_stays_while_the_registry_is_down():
    registry = MutableRegistry(Info("d0", "decode", "d0:1"))
    placer = Placer(registry=registry)
    assert await _decode(placer) == "d0:1"
    registry.is_up = False
    assert await _decode(placer) == "d0:1"
    registry.is_up = True
    registry.instances = []
    assert await placer.place([1, 2, 3], model_name="m", block_size=16) is None


class FakeBackend:
    def __init__(self) -> None:
        self.busy: set[str] = set()
        self.forgotten: list[str] = []

    async def health_status(self, address, timeout=None):
        return 1  # SERVING

    def forget(self, address: str) -> bool:
        if address in self.busy:
            return False
        self.forgotten.append(address)
        return True


async def test_tracker_forgets_departed_instances_once_idle(monkeypatch):
    monkeypatch.setattr(health_module, "FORGET_AFTER_S", 0.2)
    listed = ["a:1", "b:1", "c:1"]
    backend = FakeBackend()

    async def instances():
        return list(listed)

    tracker = HealthTracker(backend, instances, interval=0.02)  # type: ignore[arg-type]
    tracker.ensure_started()
    try:
        for _ in range(100):
            if all(tracker.status(a) is InstanceStatus.SERVING for a in listed):
                break
            await asyncio.sleep(0.02)
        backend.busy.add("c:1")  # a stream still runs on c
        listed[:] = ["a:1"]
        await asyncio.sleep(0.4)
        assert backend.forgotten == ["b:1"]
        assert "b:1" not in tracker._status and tracker.status("c:1") is InstanceStatus.SERVING
        backend.busy.clear()
        await asyncio.sleep(0.1)
        assert backend.forgotten == ["b:1", "c:1"]
        assert set(tracker._status) == {"a:1"}
    finally:
        await tracker.close()


class HeldDecode(engine_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        await self.release.wait()
        yield engine_pb2.TokenChunk(token_ids=[7], finish_reason=engine_pb2.FINISH_REASON_STOP)


async def test_backend_closes_a_forgotten_channel_only_when_no_call_runs():
    server = grpc.aio.server()
    servicer = HeldDecode()
    engine_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    backend = ChannelPool(request_timeout=30, rpc_timeout=5)
    try:
        call = backend.generate(address, engine_pb2.DecodeRequest(request_id="r"), "r")
        await asyncio.sleep(0.2)
        assert backend.forget(address) is False and address in backend._channels
        servicer.release.set()
        chunks = [c async for c in call]
        assert [c.token_ids[0] for c in chunks] == [7]
        await asyncio.sleep(0.05)  # the done callback runs on the loop
        assert backend.forget(address) is True and address not in backend._channels
    finally:
        await backend.close()
        await server.stop(None)


async def test_a_failed_prefill_call_counts_as_finished():
    backend = ChannelPool(request_timeout=2, rpc_timeout=1)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await backend.prefill("127.0.0.1:1", engine_pb2.PrefillRequest(request_id="x"), "x")
        assert backend.forget("127.0.0.1:1") is True
    finally:
        await backend.close()
