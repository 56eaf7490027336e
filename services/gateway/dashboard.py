"""The operator's live KV block map: GET /dashboard (the page), /dashboard/app.js and
GET /dashboard/feed (its data), all behind the admin key (services/gateway/admin.py).

    page (canvas grid) ◀──SSE── /dashboard/feed ◀──WatchState (gRPC stream)── each prefill
                                  fan-in, one task per instance      and decode instance

The feed follows the instances the placer knows (registry and static lists, looked up
again every DISCOVERY_INTERVAL_S) and forwards each instance's frames as they come: a
snapshot of its block map first, then deltas (services/common/state_feed.py). Events:

    event: frame     data: {"address", "role", "seq", "snapshot", "blocks" (base64, one byte
                            per block; delta: one per id in "ids"), "ids", "state" (the
                            leak audit's counts of that moment), "requests", "transfers",
                            counters and histograms, "tiers" (the KV tiers' blocks, bytes,
                            cumulative queries / hits / stores / loads / failures /
                            evictions and load-latency histogram; [] without a disk tier)}
    event: down      data: {"address", "role", "error"}   (the stream is retried)

A browser (EventSource) asks with `Accept: text/event-stream`; any other GET answers one
JSON document with each instance's current snapshot (curl, and route sweeps that read
whole bodies). A consumer that falls behind makes the instance's stream restart: it gets a
fresh snapshot, never a gap in the deltas.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from collections.abc import AsyncIterator
from importlib import resources

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.services.gateway.admin import require_admin
from pdserve.services.proto import engine_pb2 as pb

logger = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 2.0
RETRY_S = 1.0
MAX_QUEUED_EVENTS = 256
"""Events waiting for a slow page before its instances' streams restart (with snapshots)."""
SNAPSHOT_TIMEOUT_S = 5.0
ROLES = ("prefill", "decode")


def _static_route(name: str, media_type: str):
    """An operator route answering the shipped file static/`name`."""
    async def endpoint(request: Request) -> Response:
        require_admin(request)
        text = resources.files("pdserve.services.gateway").joinpath("static", name).read_text(
            "utf-8")
        return Response(text, media_type=f"{media_type}; charset=utf-8",
                        headers={"Cache-Control": "no-store"})
    return endpoint


dashboard_page = _static_route("dashboard.html", "text/html")
dashboard_script = _static_route("dashboard.js", "text/javascript")


async def dashboard_feed(request: Request) -> Response:
    """SSE for `Accept: text/event-stream`, else one JSON snapshot of every instance.
    Query: `interval` (seconds between frames, default 0.25)."""
    require_admin(request)
    gw = request.app.state.gateway
    try:
        interval = float(request.query_params.get("interval", "0.25"))
    except ValueError:
        interval = 0.25
    interval = min(max(interval if math.isfinite(interval) else 0.25, 0.05), 5.0)
    if "text/event-stream" not in request.headers.get("accept", ""):
        return JSONResponse(await snapshot_all(gw, interval))
    return StreamingResponse(_sse(gw, interval), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def _targets(gw) -> list[tuple[str, str]]:
    placer = gw.engine.placer
    return [(role, address) for role in ROLES for address in await placer.addresses(role)]


async def snapshot_all(gw, interval: float) -> dict:
    """{"object": "dashboard_snapshot", "instances": [frame or {address, role, error}]}."""

    async def first(role: str, address: str) -> dict:
        call = gw.channels.watch_state(address, role, interval)
        try:
            frame = await asyncio.wait_for(anext(aiter(call)), SNAPSHOT_TIMEOUT_S)
            return frame_json(frame, address, role)
        except grpc.aio.AioRpcError as e:
            return {"address": address, "role": role,
                    "error": f"{e.code().name}: {e.details()}"}
        except (TimeoutError, StopAsyncIteration):
            return {"address": address, "role": role, "error": "no frame in time"}
        finally:
            call.cancel()

    targets = await _targets(gw)
    instances = await asyncio.gather(*(first(role, address) for role, address in targets))
    return {"object": "dashboard_snapshot", "instances": list(instances)}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse(gw, interval: float) -> AsyncIterator[str]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    watchers: dict[tuple[str, str], asyncio.Task] = {}
    overflow = asyncio.Event()

    def put(kind: str, data: dict) -> bool:
        if queue.qsize() >= MAX_QUEUED_EVENTS:
            overflow.set()
            return False
        queue.put_nowait(_event(kind, data))
        return True

    async def watch(role: str, address: str) -> None:
        while True:
            call = gw.channels.watch_state(address, role, interval)
            try:
                async for frame in call:
                    if not put("frame", frame_json(frame, address, role)):
                        break  # the page is behind: start over with a snapshot
                else:
                    put("down", {"address": address, "role": role, "error": "stream ended"})
            except grpc.aio.AioRpcError as e:
                put("down", {"address": address, "role": role,
                             "error": f"{e.code().name}: {e.details()}"})
            finally:
                call.cancel()
            await asyncio.sleep(RETRY_S)

    async def discover() -> None:
        while True:
            try:
                targets = set(await _targets(gw))
            except Exception:  # a registry hiccup: keep what we have
                logger.warning("dashboard: instance discovery failed", exc_info=True)
                targets = set(watchers)
            for key in targets - watchers.keys():
                watchers[key] = asyncio.ensure_future(watch(*key))
            for key in watchers.keys() - targets:
                watchers.pop(key).cancel()
                put("down", {"address": key[1], "role": key[0], "error": "gone"})
            await asyncio.sleep(DISCOVERY_INTERVAL_S)

    discovery = asyncio.ensure_future(discover())
    try:
        yield _event("hello", {"interval": interval, "roles": list(ROLES)})
        while not gw.shutdown.draining:
            if overflow.is_set():  # drop the backlog; every stream restarts with a snapshot
                overflow.clear()
                while not queue.empty():
                    queue.get_nowait()
                for key, task in list(watchers.items()):
                    task.cancel()
                    watchers[key] = asyncio.ensure_future(watch(*key))
                yield _event("resync", {})
            try:
                yield await asyncio.wait_for(queue.get(), 1.0)
            except TimeoutError:  # idle for a second: a comment keeps proxies from closing
                yield ": keepalive\n\n"
    finally:
        discovery.cancel()
        for task in watchers.values():
            task.cancel()
        await asyncio.gather(discovery, *watchers.values(), return_exceptions=True)


def _histogram(h: pb.HistogramView) -> dict:
    return {"bounds": [b if math.isfinite(b) else None for b in h.bounds],
            "counts": list(h.counts), "sum": h.sum}


def frame_json(f: pb.StateFrame, address: str, role: str) -> dict:
    """One frame as the page reads it (keys in the module docstring)."""
    s = f.state
    return {
        "address": address, "role": role, "instance_id": s.instance_id, "seq": f.seq,
        "snapshot": f.snapshot, "blocks": base64.b64encode(f.block_states).decode(),
        "ids": list(f.changed_block_ids),
        "state": {k: getattr(s, k) for k in (
            "num_gpu_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks",
            "num_pinned_blocks", "num_running", "num_waiting", "block_size", "model")},
        "requests": [{"id": r.request_id, "status": r.status, "blocks": list(r.block_ids),
                      "cached": r.num_cached_tokens, "computed": r.num_computed_tokens,
                      "prompt": r.num_prompt_tokens, "tokens": r.num_tokens,
                      "lora": r.lora_name}
                     for r in f.requests],
        "transfers": [{"id": t.request_id, "direction": t.direction, "peer": t.peer,
                       "blocks": t.num_blocks, "seconds": round(t.seconds, 3)}
                      for t in f.transfers],
        "preemptions": f.num_preemptions, "prefix_queries": f.prefix_cache_queries,
        "prefix_hits": f.prefix_cache_hits, "prompt_tokens": f.prompt_tokens,
        "generation_tokens": f.generation_tokens, "time": f.time,
        "ttft": _histogram(f.ttft), "itl": _histogram(f.itl),
        "tiers": [{"tier": t.tier, "blocks": t.blocks, "bytes": t.bytes, "queries": t.queries,
                   "hits": t.hits, "stores": t.stores, "loads": t.loads,
                   "failures": t.failures, "evictions": t.evictions,
                   "load_seconds": _histogram(t.load_seconds)
                   if t.HasField("load_seconds") else None}
                  for t in f.tiers],
    }
