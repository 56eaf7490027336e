"""LoRAView: the cluster's LoRA adapters as the gateway sees them, and vLLM's admin routes.

    where an instance's adapters come from        (newest first)
      its answer to this gateway's Load / Unload / ListLoRAAdapters, for LOCAL_TTL_S
      its registration in Redis (InstanceInfo.lora_adapters; every gateway reads it)
      a ListLoRAAdapters call, at most every POLL_INTERVAL_S (instances not in the registry:
      the static --prefill-url / --decode-url lists)

A request's `model` picks its adapter: the served model name is the base model, an adapter's
name that adapter, anything else vLLM's 404. Placement keeps a request on the instances
that have its adapter loaded (`addresses_with`).

POST /v1/load_lora_adapter {"lora_name", "lora_path"} loads the adapter on every prefill and
decode instance. It is all or nothing: when an instance refuses (a bad adapter) or does not
answer, the instances where this call loaded it unload it again, and the 4xx / 503 names
each failed instance and why. POST /v1/unload_lora_adapter {"lora_name"} unloads it
everywhere; an instance that does not answer keeps it, and the 503 names it (the partial
state is reported, not hidden: unload again once it is back). Both need the admin key
(admin.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable

import grpc
from starlette.requests import Request
from starlette.responses import Response

from pdserve.services.common.lora_modules import (
    adapter_from_proto,
    adapter_to_proto,
    make_lora_request,
)
from pdserve.services.gateway.admin import require_admin
from pdserve.services.gateway.errors import GatewayError, model_not_found
from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.lora.request import LoRARequest

logger = logging.getLogger(__name__)

LOCAL_TTL_S = 3.0
"""Seconds an instance's own answer outranks its registration (the registry view lags by up
to a refresh and a heartbeat)."""
POLL_INTERVAL_S = 1.0
"""Seconds between ListLoRAAdapters calls to an instance that is not in the registry."""

Adapters = dict[str, LoRARequest]


def adapters_of_info(info) -> Adapters:
    """The adapters an InstanceInfo registered (none from an instance that predates them)."""
    return {a["lora_name"]: LoRARequest(a["lora_name"], int(a["lora_int_id"]), a["lora_path"],
                                        a.get("base_model_name"))
            for a in getattr(info, "lora_adapters", ()) or ()}


class LoRAView:
    def __init__(self, channels, placer, served_model_name: str) -> None:
        """`channels`: the ChannelPool; `placer`: the Placer (its registry and instances)."""
        self.channels = channels
        self.placer = placer
        self.served_model_name = served_model_name
        self._answered: dict[str, tuple[float, Adapters]] = {}
        """address -> (time.monotonic(), its adapters) from the instance's own answer."""
        self._known: frozenset[str] = frozenset()
        """The adapter names of the last `by_instance`."""
        self._lock = asyncio.Lock()
        """One admin operation at a time (a load's rollback must not race an unload)."""

    # -- the view ----------------------------------------------------------------------------

    async def _instances(self) -> dict[str, str]:
        """address -> role of every known prefill and decode instance."""
        out = dict.fromkeys(await self.placer.addresses("prefill"), "prefill")
        for address in await self.placer.addresses("decode"):
            out.setdefault(address, "decode")
        return out

    async def by_instance(self) -> dict[str, Adapters]:
        """Every known instance's adapters (module docstring's order of sources)."""
        registered: dict[str, Adapters] = {}
        registry = self.placer.registry
        if registry is not None:
            try:
                registered = {i.address: adapters_of_info(i)
                              for i in await registry.live_instances()}
            except Exception as e:  # the registry is optional
                logger.debug("registry unavailable for LoRA adapters: %r", e)
        instances = await self._instances()
        now = time.monotonic()
        stale = [a for a in instances if a not in registered and
                 now - self._answered.get(a, (-1e9, {}))[0] > POLL_INTERVAL_S]
        if stale:
            await asyncio.gather(*(self._poll(a, instances[a]) for a in stale))
        out: dict[str, Adapters] = {}
        for address in instances:
            at, answered = self._answered.get(address, (-1e9, None))
            fresh = answered is not None and (address not in registered or now - at < LOCAL_TTL_S)
            out[address] = answered if fresh else registered.get(address, {})
        self._known = frozenset(name for adapters in out.values() for name in adapters)
        return out

    def is_known(self, model: str) -> bool:
        """`model` names an adapter some instance had loaded at the last look (sync)."""
        return model in self._known

    async def _poll(self, address: str, role: str) -> None:
        try:
            resp = await self.channels.list_lora_adapters(address, role)
        except grpc.aio.AioRpcError as e:
            logger.debug("ListLoRAAdapters on %s: %s", address, e.code().name)
            self._answered[address] = (time.monotonic(), {})
            return
        self._record(address, resp)

    def _record(self, address: str, resp: pb.LoRAAdapterList) -> None:
        adapters = {}
        for p in resp.adapters:
            try:
                adapters[p.lora_name] = adapter_from_proto(p)
            except ValueError as e:
                logger.warning("instance %s lists a bad LoRA adapter: %s", address, e)
        self._answered[address] = (time.monotonic(), adapters)

    async def adapters(self) -> list[LoRARequest]:
        """Every adapter some instance has loaded, by name."""
        merged: Adapters = {}
        for adapters in (await self.by_instance()).values():
            for name, lora in adapters.items():
                merged.setdefault(name, lora)
        return [merged[name] for name in sorted(merged)]

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model).

        Raises:
            GatewayError: 404 (vLLM's), no model or adapter of that name.
        """
        if model is None or model == self.served_model_name:
            return None
        for adapters in (await self.by_instance()).values():
            if model in adapters:
                return adapters[model]
        raise model_not_found(model)

    async def addresses_with(self, lora: LoRARequest) -> frozenset[str]:
        """The instances that have `lora` loaded (placement keeps the request on them)."""
        return frozenset(a for a, adapters in (await self.by_instance()).items()
                         if lora.lora_name in adapters)

    # -- admin: load / unload everywhere ---------------------------------------------------

    async def load(self, lora: LoRARequest) -> None:
        """Load `lora` on every instance, all or nothing (module docstring).

        Raises:
            GatewayError: 400 already loaded everywhere, or refused by an instance; 503 no
                instance, or one did not answer.
        """
        async with self._lock:
            instances = await self._instances()
            if not instances:
                raise GatewayError("Service unavailable: no prefill/decode instance is known.",
                                   503)
            before = await self.by_instance()
            if all(before.get(a, {}).get(lora.lora_name) == lora for a in instances):
                raise GatewayError(f"The lora adapter '{lora.lora_name}' has already been "
                                   "loaded.", 400, "lora_name")
            results = await asyncio.gather(*(self._load_one(a, role, lora)
                                             for a, role in instances.items()))
            failed = {a: e for a, e in zip(instances, results) if e is not None}
            if not failed:
                return
            loaded_here = [a for a in instances if a not in failed
                           and lora.lora_name not in before.get(a, {})]
            undone = await asyncio.gather(*(self._unload_one(a, instances[a], lora.lora_name)
                                             for a in loaded_here))
            stuck = [a for a, u in zip(loaded_here, undone) if isinstance(u, grpc.RpcError)]
        reasons = "; ".join(f"{a}: {e.details() or e.code().name}" for a, e in failed.items())
        rollback = (f" It was unloaded again from {len(loaded_here) - len(stuck)} instance(s)"
                    if loaded_here else "")
        if stuck:
            rollback += f"; unloading it failed on {', '.join(stuck)} (unload it again)"
        refused = any(e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                   grpc.StatusCode.ALREADY_EXISTS) for e in failed.values())
        raise GatewayError(f"Loading LoRA adapter '{lora.lora_name}' failed on "
                           f"{len(failed)} of {len(instances)} instance(s): {reasons}."
                           f"{rollback}", 400 if refused else 503, "lora_path")

    async def unload(self, lora_name: str) -> None:
        """Unload `lora_name` everywhere.

        Raises:
            GatewayError: 404 loaded nowhere; 503 an instance did not answer (named).
        """
        async with self._lock:
            instances = await self._instances()
            results = await asyncio.gather(*(self._unload_one(a, role, lora_name)
                                             for a, role in instances.items()))
        failed = {a: r for a, r in zip(instances, results) if isinstance(r, grpc.RpcError)}
        if failed:
            reasons = "; ".join(f"{a}: {e.details() or e.code().name}"
                                for a, e in failed.items())
            raise GatewayError(f"Unloading LoRA adapter '{lora_name}' failed on "
                               f"{len(failed)} of {len(instances)} instance(s), which may "
                               f"still serve it: {reasons}. Unload it again once they "
                               "answer.", 503, "lora_name")
        if not any(r is True for r in results):
            raise GatewayError(f"The lora adapter '{lora_name}' cannot be found.", 404,
                               "lora_name")

    async def _load_one(self, address: str, role: str, lora: LoRARequest
                        ) -> grpc.aio.AioRpcError | None:
        try:
            resp = await self.channels.load_lora_adapter(address, role, adapter_to_proto(lora))
        except grpc.aio.AioRpcError as e:
            logger.warning("LoadLoRAAdapter %s on %s: %s %s", lora.lora_name, address,
                           e.code().name, e.details())
            return e
        self._record(address, resp)
        return None

    async def _unload_one(self, address: str, role: str, lora_name: str
                          ) -> bool | grpc.aio.AioRpcError:
        """True: unloaded; False: it had no such adapter; else the call's error."""
        try:
            unloaded = await self.channels.unload_lora_adapter(address, role, lora_name)
        except grpc.aio.AioRpcError as e:
            logger.warning("UnloadLoRAAdapter %s on %s: %s %s", lora_name, address,
                           e.code().name, e.details())
            return e
        await self._poll(address, role)  # its adapters now, outranking its registration
        return unloaded


def _body(raw: bytes, fields: Iterable[str]) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError:
        raise GatewayError("The request body is not valid JSON.", 400) from None
    if not isinstance(body, dict):
        raise GatewayError("The request body must be a JSON object.", 400)
    for name in fields:
        if not isinstance(body.get(name), str) or not body[name]:
            raise GatewayError(f"'{name}' must be a non-empty string.", 400, name)
    return body


async def load_lora_adapter(request: Request) -> Response:
    """POST /v1/load_lora_adapter (vLLM's route; admin key)."""
    from pdserve.services.gateway.routes import read_body

    require_admin(request)
    body = _body(await read_body(request), ("lora_name", "lora_path"))
    if body["lora_name"] == request.app.state.gateway.config.served_model_name:
        raise GatewayError("lora_name must not be the served model's name.", 400, "lora_name")
    lora = make_lora_request(body["lora_name"], body["lora_path"], body.get("base_model_name"))
    await request.app.state.gateway.lora.load(lora)
    logger.info("LoRA adapter %s loaded from %s", lora.lora_name, lora.lora_path)
    return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.",
                    media_type="text/plain")


async def unload_lora_adapter(request: Request) -> Response:
    """POST /v1/unload_lora_adapter (vLLM's route; admin key)."""
    from pdserve.services.gateway.routes import read_body

    require_admin(request)
    body = _body(await read_body(request), ("lora_name",))
    await request.app.state.gateway.lora.unload(body["lora_name"])
    logger.info("LoRA adapter %s unloaded", body["lora_name"])
    return Response(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.",
                    media_type="text/plain")
