"""GET /debug/kv-audit: the leak audit of every known prefill and decode instance.

Calls GetState(check_invariants=True) on each instance the placer knows (registry and
static lists) at once and reports, per instance, its block counts and whether its block
pool's invariants hold. An operator route: it needs the admin API key
(services/gateway/admin.py). Response:

    {"object": "kv_audit", "ok": true,
     "totals": {"num_gpu_blocks": ..., "num_free_blocks": ..., ...},   # reachable ones
     "instances": [
       {"address": "127.0.0.1:50051", "role": "prefill", "reachable": true, "error": null,
        "instance_id": "...", "num_gpu_blocks": 1000, "num_free_blocks": 1000,
        "num_cached_blocks": 25, "num_used_blocks": 0, "num_pinned_blocks": 0,
        "num_running": 0, "num_waiting": 0, "invariants_ok": true, "invariants_error": ""},
       {"address": "127.0.0.1:50099", "role": "decode", "reachable": false,
        "error": "UNAVAILABLE: ...", "instance_id": null, ... all counts null ...}]}

`ok` is true when at least one instance answered, every instance answered and every
pool's invariants hold. Blocks in use or pinned are reported, not judged: they are normal
while requests run.
"""

from __future__ import annotations

import asyncio

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.services.gateway.admin import require_admin
from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.placement import Placer

STATE_FIELDS = ("instance_id", "num_gpu_blocks", "num_free_blocks", "num_cached_blocks",
                "num_used_blocks", "num_pinned_blocks", "num_running", "num_waiting",
                "invariants_ok", "invariants_error")
"""What the audit copies from each EngineState."""
_COUNT_FIELDS = [f for f in STATE_FIELDS if f.startswith("num_")]


async def audit_instances(placer: Placer, channels: ChannelPool) -> dict:
    """The audit report (shape in the module docstring) of every instance `placer` knows.

    Raises:
        Exception: anything but a failed gRPC call (those are reported per instance).
    """
    targets = [(role, address) for role in ("prefill", "decode")
               for address in await placer.addresses(role)]
    replies = await asyncio.gather(
        *(channels.get_state(address, role, check_invariants=True) for role, address in targets),
        return_exceptions=True)
    instances = []
    for (role, address), reply in zip(targets, replies, strict=True):
        entry: dict = {"address": address, "role": role}
        if isinstance(reply, grpc.aio.AioRpcError):
            entry.update(reachable=False, error=f"{reply.code().name}: {reply.details()}",
                         **dict.fromkeys(STATE_FIELDS))
        elif isinstance(reply, BaseException):
            raise reply
        else:
            entry.update(reachable=True, error=None,
                         **{f: getattr(reply, f) for f in STATE_FIELDS})
        instances.append(entry)
    reachable = [i for i in instances if i["reachable"]]
    ok = bool(instances) and len(reachable) == len(instances) and all(
        i["invariants_ok"] for i in reachable)
    totals = {f: sum(i[f] for i in reachable) for f in _COUNT_FIELDS}
    return {"object": "kv_audit", "ok": ok, "totals": totals, "instances": instances}


async def kv_audit(request: Request) -> Response:
    require_admin(request)
    gw = request.app.state.gateway
    return JSONResponse(await audit_instances(gw.engine.placer, gw.channels))
