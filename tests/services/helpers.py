"""Test helpers for the prefill / decode services: a Redis server, a two-instance cluster,
and a client doing the gateway's two-step flow (Prefill -> Generate)."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import time
from dataclasses import dataclass, field

import grpc

from pdserve.services.common.config import ServiceConfig
from pdserve.services.common.launch import build_runtime
from pdserve.services.common.prefix_index import PrefixIndex
from pdserve.services.common.server import ServiceRuntime
from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.engine_args import EngineArgs

RPC_TIMEOUT = 120.0
"""Deadline of every test call: generous, the machine is shared and slow at times."""
NOT_FINISHED = pb.FINISH_REASON_UNSPECIFIED


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway `redis-server` on a free port (no persistence); stop / start at will."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not come up")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None


def service_config(role: str, redis_url: str | None, **overrides) -> ServiceConfig:
    """Fast heartbeats and polls, so that index and metric checks settle quickly."""
    values = dict(role=role, host="127.0.0.1", port=0, metrics_port=0, redis_url=redis_url,
                  heartbeat_interval=0.2, registration_ttl=3.0, publish_interval=0.05,
                  redis_max_backoff=0.5, grace_period=2.0)
    values.update(overrides)
    return ServiceConfig(**values)  # type: ignore[arg-type]


def engine_args(model_path: str, **overrides) -> EngineArgs:
    return EngineArgs(model=model_path, **{"kv_cache_memory": "128MiB", **overrides})


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=[
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20)])


@dataclass
class Cluster:
    prefill: ServiceRuntime
    decode: ServiceRuntime
    index: PrefixIndex | None
    prefill_stub: engine_pb2_grpc.PrefillServiceStub = field(init=False)
    decode_stub: engine_pb2_grpc.DecodeServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self._channels = [channel(self.prefill.identity.address),
                          channel(self.decode.identity.address)]
        self.prefill_stub = engine_pb2_grpc.PrefillServiceStub(self._channels[0])
        self.decode_stub = engine_pb2_grpc.DecodeServiceStub(self._channels[1])

    @property
    def runtimes(self) -> list[ServiceRuntime]:
        return [self.prefill, self.decode]

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
        await asyncio.wait_for(asyncio.gather(self.prefill.stop(0.5), self.decode.stop(0.5)),
                               60)
        if self.index is not None:
            await self.index.close()


async def start_runtime(config: ServiceConfig, args: EngineArgs) -> ServiceRuntime:
    runtime = build_runtime(config, args)
    await runtime.start()
    return runtime


async def start_cluster(model_path: str, redis_url: str | None, **engine_overrides) -> Cluster:
    prefill = await start_runtime(service_config("prefill", redis_url),
                                  engine_args(model_path, **engine_overrides))
    decode = await start_runtime(service_config("decode", redis_url),
                                 engine_args(model_path, **engine_overrides))
    try:
        await asyncio.gather(prefill.wait_ready(300), decode.wait_ready(300))
    except BaseException:
        await asyncio.gather(prefill.stop(0), decode.stop(0))
        raise
    index = None
    if redis_url:
        index = PrefixIndex(redis_url, prefill.worker.model_name, ttl=3.0, max_backoff=0.5)
    return Cluster(prefill, decode, index)


def num_handle_blocks(handle: pb.KVTransferParams) -> int:
    """The blocks the prefill holds for a KV handle: ceil(num_tokens / block_size)."""
    return -(-handle.num_tokens // handle.block_size)


def greedy(max_tokens: int, **kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@dataclass
class SplitResult:
    token_ids: list[int]
    finish_reason: int
    prefill: pb.PrefillResponse
    chunks: list[pb.TokenChunk]


async def run_split(cluster: Cluster, request_id: str, prompt: list[int],
                    params: pb.SamplingParams, cache_salt: str = "") -> SplitResult:
    """The gateway's flow: Prefill, then (unless finished) Generate with the KV handle."""
    md = (("x-request-id", request_id),)
    resp = await cluster.prefill_stub.Prefill(
        pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                          sampling_params=params, cache_salt=cache_salt),
        timeout=RPC_TIMEOUT, metadata=md)
    tokens = [resp.first_token_id]
    if resp.finish_reason != NOT_FINISHED:
        return SplitResult(tokens, resp.finish_reason, resp, [])
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                           output_token_ids=[resp.first_token_id], sampling_params=params,
                           kv_transfer_params=resp.kv_transfer_params, cache_salt=cache_salt)
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT,
                                                            metadata=md)]
    for c in chunks:
        tokens.extend(c.token_ids)
    return SplitResult(tokens, chunks[-1].finish_reason, resp, chunks)


async def get_states(cluster: Cluster) -> tuple[pb.EngineState, pb.EngineState]:
    req = pb.GetStateRequest(check_invariants=True)
    return (await cluster.prefill_stub.GetState(req, timeout=RPC_TIMEOUT),
            await cluster.decode_stub.GetState(req, timeout=RPC_TIMEOUT))


async def wait_leak_free(cluster: Cluster, timeout: float = 30.0, decode_only: bool = False):
    """Poll until neither pool (or only the decode's) has a block in use or pinned, nor a
    request queued; returns the last (prefill, decode) states."""
    deadline = time.monotonic() + timeout
    while True:
        states = await get_states(cluster)
        watched = states[1:] if decode_only else states
        if all(s.num_used_blocks == 0 and s.num_pinned_blocks == 0 and s.num_running == 0
               and s.num_waiting == 0 for s in watched) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.05)


async def cached_hashes(runtime: ServiceRuntime) -> set[bytes]:
    return await runtime.worker.engine.call(
        lambda e: set(e.kv_cache_manager.block_pool.cached_block_hash_to_block))


async def index_matches(cluster: Cluster, timeout: float = 20.0) -> bool:
    """Wait until Redis holds exactly the hashes each instance has cached."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = True
        for runtime in cluster.runtimes:
            await runtime.monitor.flush()
            held = await cluster.index.held_hashes(runtime.identity.instance_id)
            if held != await cached_hashes(runtime):
                ok = False
        if ok:
            return True
        await asyncio.sleep(0.1)
    return False


FILL_POOL_BLOCKS = 48
"""num_gpu_blocks_override of an engine `fill_disk_tier` drives (47 usable blocks)."""


async def disk_writes_flushed(runtime: ServiceRuntime, timeout: float = 30.0) -> None:
    """Wait until the disk tier's writer has written every evicted block queued so far."""
    deadline = time.monotonic() + timeout
    # NOTE: `_pending` is the writer's queue (shared/engine/kv_offload.py): empty, every
    # queued block's file is written.
    while await runtime.worker.engine.call(lambda e: bool(e.kv_offloader._pending)):
        if time.monotonic() > deadline:
            raise AssertionError("the disk tier's writes never finished")
        await asyncio.sleep(0.05)


async def fill_disk_tier(runtime: ServiceRuntime) -> pb.PrefillResponse:
    """On a prefill instance with a disk tier and a FILL_POOL_BLOCKS pool: three 20-block
    prompts (the first one's blocks are evicted to disk), then the first again (a disk
    load); returns that last Prefill's answer, every disk write finished."""
    rng = random.Random(30)
    prompts = [[rng.randrange(100, 40000) for _ in range(320)] for _ in range(3)]
    async with channel(runtime.identity.address) as ch:
        stub = engine_pb2_grpc.PrefillServiceStub(ch)

        async def prefill(request_id: str, prompt: list[int]) -> pb.PrefillResponse:
            return await stub.Prefill(pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling_params=greedy(1)),
                timeout=RPC_TIMEOUT)

        for i, prompt in enumerate(prompts):
            await prefill(f"fill-{i}", prompt)
        await disk_writes_flushed(runtime)
        again = await prefill("fill-again", prompts[0])
        await disk_writes_flushed(runtime)
    return again
