"""The request flow over the split engine: Prefill -> Generate, failover, fan-out, aborts.

Per engine request (one choice):

    place ──▶ prefill.Prefill ──▶ first token ──▶ decode.Generate(kv_transfer_params) ──▶ …
      │                      └─ finish_reason set: ReleaseKV, done (no decode call)
      └─ uncached part < local_prefill_threshold: decode.Generate without kv_transfer_params

Failover: when a call fails with a status that says the instance (not the request) is at
fault (UNAVAILABLE, a peer's CANCELLED, INTERNAL, UNKNOWN), the instance is marked failed in
the health tracker and the request is placed again, up to --max-request-retries times; a
failed KV transfer (ABORTED, DATA_LOSS, NOT_FOUND from Generate) is placed again without a
verdict on any instance. An aborted Prefill (ABORTED: someone called Abort) is not retried.
A failed Prefill goes to another prefill instance or to a decode instance that prefills
itself. A broken decode stream continues on another decode instance with
`output_token_ids` = every token already handed out: that instance prefills prompt + those
tokens locally and streams only the tokens after them, so the consumer sees no gap and no
repeat (greedy output is token-identical; penalties and max_tokens count the earlier tokens,
as in the decode worker). Each retry runs under the id `<engine id>-retry<k>`. With the
budget spent or no decode instance left: GatewayError 503 (mid-stream: an error event).

Any way out of `generate` other than the engine reporting a finish (client gone, stop
string hit, error) cancels the open gRPC call and sends Abort to every instance the request
touched (but the one that failed), so all free its blocks at once (a prefill instance its
pinned KV). Choices of one HTTP request run as concurrent tasks merged into one stream;
closing the stream cancels them all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import NamedTuple, TypeVar

import grpc

from services.gateway.backend import EngineBackend, EngineOutput
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError, from_grpc_error, no_backend
from services.gateway.failover import (
    OVERLOAD_BACKOFF_S,
    OVERLOAD_MAX_WAIT_S,
    RETRIABLE_GENERATE,
    RETRIABLE_PREFILL,
    AttemptFailed,
    FailoverStats,
    at_length_limit,
    is_overloaded,
)
from services.gateway.health import HealthTracker, InstanceStatus
from services.gateway.output_processor import ChoiceDelta, ChoiceProcessor
from services.gateway.placement import Placement, Placer
from shared.proto import engine_pb2

logger = logging.getLogger(__name__)

_NOT_FINISHED = engine_pb2.FINISH_REASON_UNSPECIFIED
_T = TypeVar("_T")
HEALTH_ROUTE_BOUND = 0.5  # s /health waits for live checks, then uses the last known states


class EngineInfo(NamedTuple):
    max_model_len: int
    block_size: int
    model_name: str
    """The engine's served model name and weight quantization: prefix-hash extra keys."""
    quantization: str = "none"


class ClientDisconnected(Exception):
    pass


class ServingEngine:
    def __init__(self, config: GatewayConfig, backend: EngineBackend, placer: Placer,
                 health: HealthTracker | None = None) -> None:
        """Without `health`, a HealthTracker of the placer's instances is made (and given to
        the placer, when it has no health view of its own)."""
        self.config = config
        self.backend = backend
        self.placer = placer
        self.health = health or HealthTracker(backend, self._all_addresses,
                                              config.health_check_interval, config.rpc_timeout)
        if placer.health is None:
            placer.health = self.health
        self.failover_stats = FailoverStats()
        self._info: EngineInfo | None = None

    async def _all_addresses(self) -> list[str]:
        prefill, decode = await asyncio.gather(self.placer.addresses("prefill"),
                                               self.placer.addresses("decode"))
        return prefill + decode

    async def close(self) -> None:
        await self.health.close()  # the polling

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
            if isinstance(reply, grpc.aio.AioRpcError):  # UNAVAILABLE: loading (every start)
                (logger.debug if reply.code() == grpc.StatusCode.UNAVAILABLE else logger.warning)(
                    "GetState on %s %s failed: %s", role, address, reply.code().name)
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
                                model_name, states[0].quantization or "none")
        logger.info("engine: %s", self._info)
        return self._info

    async def is_healthy(self) -> bool:
        """At least one prefill and one decode instance answer SERVING.

        Every instance is checked live, but for at most HEALTH_ROUTE_BOUND s: one that has not
        answered by then counts with the health tracker's last known status.
        """
        self.health.ensure_started()
        prefill, decode = await asyncio.gather(self.placer.addresses("prefill"),
                                               self.placer.addresses("decode"))
        if not prefill or not decode:
            return False
        await self.health.refresh(prefill + decode, HEALTH_ROUTE_BOUND)
        serving = [self.health.status(a) is InstanceStatus.SERVING for a in prefill + decode]
        return any(serving[:len(prefill)]) and any(serving[len(prefill):])

    async def generate(self, engine_request_id: str, prompt_token_ids: list[int],
                       params: engine_pb2.SamplingParams, *, cache_salt: str | None,
                       request_id: str) -> AsyncIterator[EngineOutput]:
        """The engine's outputs for one request, ending with the one that has a finish.

        Failures of an instance are retried elsewhere (module docstring); only the first
        output carries num_cached_tokens.

        Raises:
            GatewayError: 503 when no decode instance is usable or the retry budget is spent;
                the mapped status of a non-retriable engine error (400, 429, 504, ...).
        """
        info = await self.engine_info()
        self.health.ensure_started()
        output_token_ids: list[int] = []
        avoid: list[str] = []
        num_retries = 0
        overload_waits: list[float] = []
        retrying: AttemptFailed | None = None  # counted once placed again
        cached_reported = False
        while True:
            if output_token_ids and at_length_limit(params, info.max_model_len,
                                                    len(prompt_token_ids), len(output_token_ids)):
                yield EngineOutput([], [], engine_pb2.FINISH_REASON_LENGTH, None)
                return
            placement = await self.placer.place(
                prompt_token_ids, model_name=info.model_name, block_size=info.block_size,
                cache_salt=cache_salt, avoid=avoid, local_prefill=bool(output_token_ids),
                quantization=info.quantization)
            if placement is None:
                if num_retries:
                    self.failover_stats.exhausted += 1
                    raise no_backend(f"request {engine_request_id} failed and no other decode "
                                     "instance is live")
                raise no_backend("no decode instance is configured or live")
            if retrying is not None:
                self.failover_stats.count_retry(retrying, len(output_token_ids))
                logger.warning("[%s] %s failed (%s); retry %d/%d on %s with %d tokens done",
                               request_id, engine_request_id, retrying, num_retries,
                               self.config.max_request_retries, placement.decode_address,
                               len(output_token_ids))
                retrying = None
            attempt_id = f"{engine_request_id}-retry{num_retries}" if num_retries else \
                engine_request_id
            try:
                async with aclosing(self._attempt(
                        attempt_id, placement, prompt_token_ids, output_token_ids, params,
                        cache_salt, request_id)) as outputs:
                    async for out in outputs:
                        if cached_reported:
                            out = out._replace(num_cached_tokens=None)
                        cached_reported = cached_reported or out.num_cached_tokens is not None
                        output_token_ids.extend(out.token_ids)
                        yield out
                return
            except AttemptFailed as failure:
                if failure.overloaded:
                    wait = OVERLOAD_BACKOFF_S[min(len(overload_waits),
                                                  len(OVERLOAD_BACKOFF_S) - 1)]
                    if sum(overload_waits) + wait > OVERLOAD_MAX_WAIT_S:
                        self.failover_stats.exhausted += 1
                        raise GatewayError(f"Service unavailable: {failure} for "
                                           f"{sum(overload_waits):.0f} s.", 503) from None
                    overload_waits.append(wait)
                    logger.info("[%s] %s: decode full, placing again in %.2f s",
                                request_id, engine_request_id, wait)
                    self.failover_stats.overload_waits += 1
                    avoid.append(failure.address)  # another decode instance if one has room
                    await asyncio.sleep(wait)
                    continue
                if failure.instance_failed:
                    self.health.mark_failed(failure.address)
                avoid.append(failure.address)
                if num_retries >= self.config.max_request_retries:
                    self.failover_stats.exhausted += 1
                    raise GatewayError(
                        f"Service unavailable: {failure} (retried {num_retries} times).",
                        503) from None
                num_retries += 1
                retrying = failure

    async def _attempt(self, engine_request_id: str, placement: Placement,
                       prompt_token_ids: list[int], output_token_ids: list[int],
                       params: engine_pb2.SamplingParams, cache_salt: str | None,
                       request_id: str) -> AsyncIterator[EngineOutput]:
        """One placement of the request; the outputs after `output_token_ids`.

        Raises:
            AttemptFailed: a retriable failure (the instance is at fault).
            GatewayError: any other engine error.
        """
        decode_req = engine_pb2.DecodeRequest(
            request_id=engine_request_id, prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids, sampling_params=params,
            cache_salt=cache_salt or "")
        used: list[tuple[str, str]] = []
        failed: str | None = None
        call = None
        finished = False
        # NOTE: decode counts as loaded from placement on (requests placed meanwhile spread)
        self.placer.begin(placement.decode_address)
        try:
            if placement.prefill_address is not None:
                address = placement.prefill_address
                used.append((address, "prefill"))
                try:
                    resp = await self._prefill(address, decode_req, request_id)
                except grpc.aio.AioRpcError as e:
                    if e.code() not in RETRIABLE_PREFILL:
                        raise from_grpc_error(e, "Prefill") from None
                    failed = address
                    raise AttemptFailed(address, "prefill", e) from None
                first_logprobs = [resp.first_logprobs] if resp.HasField("first_logprobs") else []
                finished = resp.finish_reason != _NOT_FINISHED
                if finished:
                    self.backend.release_kv_soon(address, engine_request_id, request_id)
                yield EngineOutput([resp.first_token_id], first_logprobs, resp.finish_reason,
                                   resp.num_cached_tokens, list(resp.prompt_logprobs) or None)
                if finished:
                    return
                decode_req.output_token_ids.append(resp.first_token_id)
                decode_req.kv_transfer_params.CopyFrom(resp.kv_transfer_params)
                if first_logprobs:
                    decode_req.first_logprobs.CopyFrom(resp.first_logprobs)
            address = placement.decode_address
            used.append((address, "decode"))
            try:
                call = self.backend.generate(address, decode_req, request_id)
                is_first = placement.prefill_address is None
                async for chunk in call:
                    finished = chunk.finish_reason != _NOT_FINISHED
                    yield EngineOutput(list(chunk.token_ids), list(chunk.logprobs),
                                       chunk.finish_reason,
                                       chunk.num_cached_tokens if is_first else None,
                                       list(chunk.prompt_logprobs) or None)
                    is_first = False
                    if finished:
                        return
            except grpc.aio.AioRpcError as e:
                if is_overloaded(e) and decode_req.output_token_ids:
                    # NOTE: the client already has tokens (a started stream): a 429 now would
                    # break it; wait for room instead (generate's loop).
                    failed = address
                    raise AttemptFailed(address, "decode", e, overloaded=True) from None
                if e.code() not in RETRIABLE_GENERATE:
                    raise from_grpc_error(e, "Generate") from None
                failed = address
                raise AttemptFailed(address, "decode", e) from None
            failed = address
            raise AttemptFailed(address, "decode", "the stream ended without a finish reason")
        finally:
            # NOTE: no awaits here: this also runs when the task is being cancelled.
            self.placer.end(placement.decode_address)
            if call is not None and not call.done():
                call.cancel()
            if not finished:
                for address, role in used:
                    if address != failed:  # it ended the call itself, or is gone
                        self.backend.abort_soon(address, role, [engine_request_id], request_id)

    async def _prefill(self, address: str, req: engine_pb2.DecodeRequest,
                       request_id: str) -> engine_pb2.PrefillResponse:
        self.placer.begin(address)
        try:
            return await self.backend.prefill(address, engine_pb2.PrefillRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params, cache_salt=req.cache_salt), request_id)
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
        work.cancel()  # and wait: the caller may close the generators `work` iterates
        await asyncio.gather(work, return_exceptions=True)
        raise
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ClientDisconnected()
    return work.result()

