"""ChannelPool: the gateway's channels to prefill and decode instances, one per address.

Each channel (services/common/auth.py `internal_channel`: created lazily, on the running
loop) carries the prefill, decode and health stubs; every call has a deadline and the
`x-request-id` + token metadata. Every channel pings its instance (HTTP/2 keepalive,
shared/config.py GRPC_KEEPALIVE_S), so the calls to a frozen or partitioned instance fail with
UNAVAILABLE within seconds (and fail over) instead of hanging until `request_timeout`. The
channel of an instance that left the registry is closed by `forget` once no Prefill or
Generate call runs on it.

Each running Generate call is indexed by its HTTP request's engine prefix, which the caller
hands in with the call (nothing is parsed back out of engine request ids), so `set_paused`
can reach every decode instance serving one stream (engine-side backpressure,
backpressure.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.common.auth import call_metadata, internal_channel
from pdserve.services.gateway.control_calls import ControlCallStats
from pdserve.services.gateway.in_flight import InFlight
from pdserve.services.proto import engine_pb2, engine_pb2_grpc
from pdserve.shared import config as shared_config

logger = logging.getLogger(__name__)


class _Channel(NamedTuple):
    channel: grpc.aio.Channel
    prefill: engine_pb2_grpc.PrefillServiceStub
    decode: engine_pb2_grpc.DecodeServiceStub
    health: health_pb2_grpc.HealthStub


class ChannelPool:
    """Calls to prefill (Prefill, Abort, GetState) and decode (Generate, SetPaused, Abort,
    GetState) instances by address. Fire-and-forget calls (Abort) are tracked so `close()`
    can let them finish."""

    def __init__(self, request_timeout: float = 600.0, rpc_timeout: float = 5.0,
                 internal_token: str | None = None, keepalive_s: float | None = None,
                 in_flight: InFlight | None = None) -> None:
        self.request_timeout = request_timeout
        self.rpc_timeout = rpc_timeout
        self.keepalive_s = shared_config.GRPC_KEEPALIVE_S if keepalive_s is None else keepalive_s
        """Seconds between keepalive pings on every channel (default GRPC_KEEPALIVE_S)."""
        self._metadata = functools.partial(call_metadata, internal_token)
        """(request_id=None) -> the metadata of one call."""
        self._channels: dict[str, _Channel] = {}
        self._background: set[asyncio.Task] = set()
        self.in_flight = InFlight() if in_flight is None else in_flight
        """Calls in flight per address, the one count placement reads too (Prefill, Pool and
        Generate calls; services/gateway/in_flight.py). A channel stays open while its address
        has any."""
        self.control_calls = ControlCallStats()
        """Abort / SetPaused outcomes and latencies (a Prometheus collector)."""
        self._decode_calls: dict[str, dict[str, str]] = {}
        """engine prefix -> {engine request id: decode address} of the Generate calls
        running now."""

    def _get(self, address: str) -> _Channel:
        ch = self._channels.get(address)
        if ch is None:
            channel = internal_channel(address, keepalive_s=self.keepalive_s)
            ch = self._channels[address] = _Channel(
                channel, engine_pb2_grpc.PrefillServiceStub(channel),
                engine_pb2_grpc.DecodeServiceStub(channel), health_pb2_grpc.HealthStub(channel))
        return ch

    def _stub(self, address: str, role: str):
        return self._get(address).prefill if role == "prefill" else self._get(address).decode

    async def prefill(self, address: str, request: engine_pb2.PrefillRequest,
                      request_id: str) -> engine_pb2.PrefillResponse:
        with self.in_flight.hold(address):
            return await self._get(address).prefill.Prefill(
                request, timeout=self.request_timeout, metadata=self._metadata(request_id))

    async def pool(self, address: str, request: engine_pb2.PoolRequest,
                   request_id: str) -> engine_pb2.PoolResponse:
        """A pooling model's request (prefill only) on a prefill instance."""
        with self.in_flight.hold(address):
            return await self._get(address).prefill.Pool(
                request, timeout=self.request_timeout, metadata=self._metadata(request_id))

    def generate(self, address: str, request: engine_pb2.DecodeRequest, request_id: str,
                 engine_prefix: str | None = None) -> grpc.aio.UnaryStreamCall:
        """The decode stream; iterate it, `cancel()` it to stop. `engine_prefix`: the HTTP
        request's engine prefix, under which `set_paused` finds the call (None: the engine
        request id itself). Counted in `in_flight` until the call is done."""
        call = self._get(address).decode.Generate(
            request, timeout=self.request_timeout, metadata=self._metadata(request_id))
        self.in_flight.begin(address)
        rid = request.request_id
        prefix = engine_prefix or rid
        self._decode_calls.setdefault(prefix, {})[rid] = address

        def done(_) -> None:
            self.in_flight.end(address)
            calls = self._decode_calls.get(prefix)
            if calls is not None and calls.get(rid) == address:
                del calls[rid]
                if not calls:
                    del self._decode_calls[prefix]
        call.add_done_callback(done)
        return call

    async def set_paused(self, engine_prefix: str, paused: bool, request_id: str) -> bool:
        """SetPaused on the decode instances running the engine requests of `engine_prefix`.

        Returns True when an instance held one of them (now paused or resumed); False when
        none did (not on a decode instance yet, or done) or every call failed (logged,
        counted in the control-call stats; never raised).
        """
        by_address: dict[str, list[str]] = {}
        for rid, address in self._decode_calls.get(engine_prefix, {}).items():
            by_address.setdefault(address, []).append(rid)
        held = False
        for address, ids in by_address.items():
            start, code = time.monotonic(), "OK"
            try:
                resp = await self._get(address).decode.SetPaused(
                    engine_pb2.SetPausedRequest(request_ids=ids, paused=paused),
                    timeout=self.rpc_timeout, metadata=self._metadata(request_id))
                held = held or bool(resp.request_ids)
            except grpc.aio.AioRpcError as e:
                code = e.code().name
                logger.warning("[%s] SetPaused(%s) on %s failed: %s", request_id, paused,
                               address, code)
            finally:
                self.control_calls.observe("SetPaused", code, time.monotonic() - start)
        return held

    async def load_lora_adapter(self, address: str, role: str,
                                adapter: engine_pb2.LoRAAdapter) -> engine_pb2.LoRAAdapterList:
        """LoadLoRAAdapter (the instance reads the adapter's files: request_timeout)."""
        return await self._stub(address, role).LoadLoRAAdapter(
            engine_pb2.LoadLoRAAdapterRequest(adapter=adapter), timeout=self.request_timeout,
            metadata=self._metadata())

    async def unload_lora_adapter(self, address: str, role: str, lora_name: str) -> bool:
        """UnloadLoRAAdapter; False when the instance had no adapter of that name. (It
        answers once the requests running under the adapter are done: request_timeout.)"""
        resp = await self._stub(address, role).UnloadLoRAAdapter(
            engine_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name),
            timeout=self.request_timeout, metadata=self._metadata())
        return resp.unloaded

    async def list_lora_adapters(self, address: str, role: str) -> engine_pb2.LoRAAdapterList:
        return await self._stub(address, role).ListLoRAAdapters(
            engine_pb2.ListLoRAAdaptersRequest(), timeout=self.rpc_timeout,
            metadata=self._metadata())

    def forget(self, address: str) -> bool:
        """Close the channel of an instance that is gone; False (nothing closed) while a
        Prefill or Generate call still runs on it. A later call opens a new one."""
        if self.in_flight[address] > 0:
            return False
        ch = self._channels.pop(address, None)
        if ch is not None:
            self._spawn(ch.channel.close())
        return True

    async def get_state(self, address: str, role: str,
                        check_invariants: bool = False) -> engine_pb2.EngineState:
        """The instance's EngineState; `check_invariants` also audits its block pool."""
        return await self._stub(address, role).GetState(
            engine_pb2.GetStateRequest(check_invariants=check_invariants),
            timeout=self.rpc_timeout, metadata=self._metadata())

    def watch_state(self, address: str, role: str,
                    interval_s: float = 0.0) -> grpc.aio.UnaryStreamCall:
        """The instance's state feed (WatchState: a snapshot, then deltas); no deadline,
        `cancel()` it to stop."""
        return self._stub(address, role).WatchState(
            engine_pb2.WatchStateRequest(interval_s=interval_s), metadata=self._metadata())

    async def health_status(self, address: str, timeout: float | None = None) -> int | None:
        """grpc.health.v1 Check of the whole server ("" service): the
        `HealthCheckResponse.ServingStatus` value, or None when it does not answer within
        `timeout` seconds (default rpc_timeout) or answers with an error status."""
        try:
            resp = await self._get(address).health.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=self.rpc_timeout if timeout is None else timeout)
        except grpc.aio.AioRpcError:
            return None
        return resp.status

    async def _abort(self, address: str, role: str, engine_request_ids: list[str],
                     request_id: str) -> None:
        start, code = time.monotonic(), "OK"
        try:
            await self._stub(address, role).Abort(
                engine_pb2.AbortRequest(request_ids=engine_request_ids),
                timeout=self.rpc_timeout, metadata=self._metadata(request_id))
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            logger.warning("[%s] Abort on %s %s failed: %s", request_id, role, address, code)
        finally:
            self.control_calls.observe("Abort", code, time.monotonic() - start)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_soon(self, address: str, role: str, engine_request_ids: list[str],
                   request_id: str) -> None:
        """Send Abort without waiting (safe inside a cancelled task's cleanup)."""
        self._spawn(self._abort(address, role, engine_request_ids, request_id))

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.rpc_timeout)
        for ch in self._channels.values():
            await ch.channel.close()
        self._channels.clear()
