"""The request flow over the split engine: Prefill -> Generate, fan-out of choices, aborts.

Per engine request (one choice):

    place ──▶ prefill.Prefill ──▶ first token ──▶ decode.Generate(kv_transfer_params) ──▶ …
      │                      └─ finish_reason set: ReleaseKV, done (no decode call)
      └─ uncached part < local_prefill_threshold: decode.Generate without kv_transfer_params

Any way out of `generate` other than the engine reporting a finish (client gone, stop
string hit, error) cancels the open gRPC call and sends Abort to every instance the request
touched, so both free its blocks at once. Choices of one HTTP request run as concurrent
tasks merged into one stream; closing the stream cancels them all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import NamedTuple, TypeVar

import grpc

from services.gateway.backend import EngineBackend, EngineOutput
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError, from_grpc_error, no_backend
from services.gateway.output_processor import ChoiceDelta, ChoiceProcessor
from services.gateway.placement import Placer
from shared.proto import engine_pb2

logger = logging.getLogger(__name__)

_NOT_FINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED
_T = TypeVar("_T")


class EngineInfo(NamedTuple):
    max_model_len: int
    block_size: int
    model_name: str
    """The engine's served model name: the prefix-hash extra key."""


class ClientDisconnected(Exception):
    pass


class ServingEngine:
    def __init__(self, config: GatewayConfig, backend: EngineBackend, placer: Placer) -> None:
        self.config = config
        self.backend = backend
        self.placer = placer
        self._info: EngineInfo | None = None

    async def engine_info(self) -> EngineInfo:
        """max_model_len and block size from the instances' GetState (the flag wins).

        Raises:
            GatewayError: 503 when nothing answers and no --max-model-len was given.
        """
        if self._info is not None:
            return self._info
        cfg = self.config
        targets = [(role, address) for role in ("decode", "prefill")
                   for address in await self.placer.addresses(role)]
        replies = await asyncio.gather(*(self.backend.get_state(a, r) for r, a in targets),
                                       return_exceptions=True)
        states = []
        for (role, address), reply in zip(targets, replies):
            if isinstance(reply, grpc.aio.AioRpcError):
                logger.warning("GetState on %s %s failed: %s", role, address, reply.code().name)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                states.append(reply)
        if not states:
            if cfg.max_model_len:
                return EngineInfo(cfg.max_model_len, cfg.block_size, cfg.served_model_name)
            raise no_backend()
        reported = [s.max_model_len for s in states if s.max_model_len > 0]
        max_model_len = cfg.max_model_len or (min(reported) if reported else 0)
        if not max_model_len:
            raise no_backend("the instances do not report max_model_len")
        if reported and max_model_len > min(reported):
            logger.warning("--max-model-len %d exceeds the engine's %d", max_model_len,
                           min(reported))
        model_name = states[0].model or cfg.served_model_name
        if model_name != cfg.served_model_name:
            logger.warning("the engine serves %r, the gateway %r: routing hashes use %r",
                           model_name, cfg.served_model_name, model_name)
        self._info = EngineInfo(max_model_len, states[0].block_size or cfg.block_size,
                                model_name)
        logger.info("engine: %s", self._info)
        return self._info

    async def is_healthy(self) -> bool:
        """At least one prefill and one decode instance answer SERVING."""
        prefill, decode = await asyncio.gather(self.placer.addresses("prefill"),
                                               self.placer.addresses("decode"))
        if not prefill or not decode:
            return False
        ok = await asyncio.gather(*(self.backend.is_serving(a) for a in prefill + decode))
        return any(ok[:len(prefill)]) and any(ok[len(prefill):])

    async def generate(self, engine_request_id: str, prompt_token_ids: list[int],
                       params: engine_pb2.SamplingParams, *, cache_salt: str | None,
                       request_id: str) -> AsyncIterator[EngineOutput]:
        """The engine's outputs for one request, ending with the one that has a finish."""
        info = await self.engine_info()
        placement = await self.placer.place(prompt_token_ids, model_name=info.model_name,
                                            block_size=info.block_size, cache_salt=cache_salt)
        if placement is None:
            raise no_backend("no decode instance is configured or live")
        decode_req = engine_pb2.DecodeRequest(
            request_id=engine_request_id, prompt_token_ids=prompt_token_ids,
            sampling_params=params, cache_salt=cache_salt or "")
        used: list[tuple[str, str]] = []
        call = None
        finished = False
        try:
            if placement.prefill_address is not None:
                address = placement.prefill_address
                used.append((address, "prefill"))
                resp = await self._prefill(address, decode_req, request_id)
                first_logprobs = [resp.first_logprobs] if resp.HasField("first_logprobs") else []
                finished = resp.finish_reason != _NOT_FINISHED
                if finished:
                    self.backend.release_kv_soon(address, engine_request_id, request_id)
                yield EngineOutput([resp.first_token_id], first_logprobs, resp.finish_reason,
                                   resp.num_cached_tokens)
                if finished:
                    return
                decode_req.output_token_ids.append(resp.first_token_id)
                decode_req.kv_transfer_params.CopyFrom(resp.kv_transfer_params)
                if first_logprobs:
                    decode_req.first_logprobs.CopyFrom(resp.first_logprobs)
            address = placement.decode_address
            used.append((address, "decode"))
            self.placer.begin(address)
            try:
                call = self.backend.generate(address, decode_req, request_id)
                is_first = placement.prefill_address is None
                async for chunk in call:
                    finished = chunk.finish_reason != _NOT_FINISHED
                    yield EngineOutput(list(chunk.token_ids), list(chunk.logprobs),
                                       chunk.finish_reason,
                                       chunk.num_cached_tokens if is_first else None)
                    is_first = False
                    if finished:
                        return
            except grpc.aio.AioRpcError as e:
                raise from_grpc_error(e, "Generate") from None
            finally:
                self.placer.end(address)
            raise GatewayError("the decode stream ended without a finish reason", 503)
        finally:
            # NOTE: no awaits here: this also runs when the task is being cancelled.
            if call is not None and not call.done():
                call.cancel()
            if not finished:
                for address, role in used:
                    self.backend.abort_soon(address, role, [engine_request_id], request_id)

    async def _prefill(self, address: str, req: engine_pb2.DecodeRequest,
                       request_id: str) -> engine_pb2.PrefillResponse:
        self.placer.begin(address)
        try:
            return await self.backend.prefill(address, engine_pb2.PrefillRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params, cache_salt=req.cache_salt), request_id)
        except grpc.aio.AioRpcError as e:
            raise from_grpc_error(e, "Prefill") from None
        finally:
            self.placer.end(address)

    async def run_choice(self, processor: ChoiceProcessor, engine_request_id: str,
                         prompt_token_ids: list[int], params: engine_pb2.SamplingParams, *,
                         cache_salt: str | None, request_id: str) -> AsyncIterator[ChoiceDelta]:
        """One choice's deltas; stops the engine as soon as the processor finishes it."""
        outputs = self.generate(engine_request_id, prompt_token_ids, params,
                                cache_salt=cache_salt, request_id=request_id)
        try:
            async for out in outputs:
                delta = processor.process(out)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            await outputs.aclose()


_DONE = object()


async def merge_streams(streams: Sequence[AsyncIterator[_T]]) -> AsyncIterator[_T]:
    """Items of all streams as they come; the first error ends it; closing cancels all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[_T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((None, e))
        else:
            queue.put_nowait((_DONE, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(receive, awaitable: Awaitable[_T]) -> _T:
    """Run `awaitable` unless the client disconnects first (then cancel it).

    Raises:
        ClientDisconnected: the client went away; the work was cancelled.
    """
    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ClientDisconnected()
    return work.result()
