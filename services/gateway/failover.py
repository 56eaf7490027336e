"""EngineClient: the split engine as the OpenAI handlers (serving.py) see it, as vLLM's:
`generate` is the failover loop; `engine_info` and `health_report` ask health.py.

    generate ─▶ place ─▶ prefill_then_decode (prefill_decode.py: one placement) ─▶ outputs
                  ▲            │ AttemptFailed: mark the instance failed, avoid it
                  └────────────┘ (up to --max-request-retries; a full decode: wait, outside it)

A failed Prefill goes to another prefill instance or to a decode instance that prefills
itself. A broken decode stream continues on another decode instance with `output_token_ids`
= every token already handed out: that instance prefills prompt + those tokens and streams
only the tokens after them, so the consumer sees no gap and no repeat (greedy output is
token-identical). Each retry runs under the id `<engine id>-retry<k>`. With the budget spent
or no decode instance left: GatewayError 503 (mid-stream: an error event).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from pdserve.services.common.lora_modules import adapter_to_proto
from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import GatewayError, no_backend
from pdserve.services.gateway.health import (
    EngineInfo,
    HealthReport,
    HealthTracker,
    discover_engine,
)
from pdserve.services.gateway.lora import LoRAView
from pdserve.services.gateway.placement import Placer, PromptHashes
from pdserve.services.gateway.prefill_decode import AttemptFailed, EngineOutput, prefill_then_decode
from pdserve.services.proto import engine_pb2
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.stop_rules import at_length_limit

logger = logging.getLogger(__name__)

OVERLOAD_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)
"""Waits before placing again a started stream whose decode instance was full (then 2 s)."""
OVERLOAD_MAX_WAIT_S = 60.0
"""How long a started stream keeps waiting for room on a decode instance before a 503."""


@dataclass(slots=True, eq=False)  # hashable: registered as a Prometheus collector
class FailoverStats:
    """Counters since start (for tests and docs/reliability.md)."""

    decode_failovers: int = 0
    """Broken decode streams continued on another placement."""
    prefill_retries: int = 0
    """Other failed attempts (a Prefill, a decode stream before its first token) placed again."""
    exhausted: int = 0
    """Engine requests given up: retry budget spent or no decode instance left."""
    overload_waits: int = 0
    """Started streams whose decode instance was full, placed again after a wait."""

    def collect(self):
        """prometheus_client custom-collector hook: `pdserve_gateway_failovers_total{kind}`."""
        family = CounterMetricFamily(
            "pdserve_gateway_failovers", "Engine requests placed again after a failure "
            "(decode: a broken stream continued; prefill: another attempt; exhausted: given "
            "up).", labels=["kind"])
        for kind, n in (("decode", self.decode_failovers), ("prefill", self.prefill_retries),
                        ("exhausted", self.exhausted), ("overload_wait", self.overload_waits)):
            family.add_metric([kind], n)
        yield family


class EngineClient:
    def __init__(self, config: GatewayConfig, channels: ChannelPool, placer: Placer,
                 health: HealthTracker | None = None) -> None:
        """Without `health`, a HealthTracker of the placer's instances is made (and given to
        the placer, when it has no health view of its own)."""
        self.config = config
        self.channels = channels
        self.placer = placer
        self.health = health or HealthTracker(channels, self._all_addresses,
                                              config.health_check_interval, config.rpc_timeout)
        if placer.health is None:
            placer.health = self.health
        self.failover_stats = FailoverStats()
        self._info: EngineInfo | None = None
        self.lora: LoRAView | None = None
        """The cluster's LoRA adapters (placement keeps a request where its adapter is)."""

    async def _addresses(self) -> tuple[list[str], list[str]]:
        return await asyncio.gather(self.placer.addresses("prefill"),
                                    self.placer.addresses("decode"))

    async def _all_addresses(self) -> list[str]:
        prefill, decode = await self._addresses()
        return prefill + decode

    async def close(self) -> None:
        await self.health.close()  # the polling

    async def engine_info(self) -> EngineInfo:
        """What the instances report (health.discover_engine), asked until one answers; the
        flags meanwhile.

        Raises:
            GatewayError: 503 when nothing answers and no --max-model-len was given.
        """
        if self._info is None:
            cfg = self.config
            info = await discover_engine(cfg, self.channels, *await self._addresses())
            if info is None:
                if not cfg.max_model_len:
                    raise no_backend()
                return EngineInfo(cfg.max_model_len, cfg.block_size, cfg.served_model_name)
            self._info = info
            logger.info("engine: %s", info)
        return self._info

    async def health_report(self) -> HealthReport:
        """/health's answer (HealthTracker.report): the gateway can serve while a decode
        instance does."""
        return await self.health.report(*await self._addresses(), self.placer.registry,
                                        pooling=self.config.runner == "pooling")

    async def generate(self, engine_request_id: str, prompt_token_ids: list[int],
                       params: engine_pb2.SamplingParams, *, cache_salt: str | None,
                       request_id: str, lora_request: LoRARequest | None = None,
                       engine_prefix: str | None = None,
                       prompt_hashes: PromptHashes | None = None
                       ) -> AsyncIterator[EngineOutput]:
        """The engine's outputs for one request, ending with the one that has a finish; only
        the first output carries num_cached_tokens. `lora_request`: the adapter (None: the
        base model); placed on the instances that have it loaded. `engine_prefix`: the HTTP
        request's engine prefix, under which its decode calls are paused (None: the engine
        request id). `prompt_hashes`: the prompt's block hashes, shared by the HTTP request's
        choices (None: hashed here, once for every retry).

        Raises:
            GatewayError: 503 when no decode instance is usable or the retry budget is spent;
                the mapped status of a non-retriable engine error (400, 429, 504, ...).
        """
        info = await self.engine_info()
        self.health.ensure_started()
        max_retries, stats = self.config.max_request_retries, self.failover_stats
        output_token_ids: list[int] = []
        avoid: list[str] = []
        num_retries = 0
        overload_waits: list[float] = []
        retrying: AttemptFailed | None = None  # counted once placed again
        with_adapter = None if lora_request is None or self.lora is None else \
            await self.lora.addresses_with(lora_request)
        cached_reported = False
        prompt_hashes = prompt_hashes or PromptHashes(prompt_token_ids)
        while True:
            if output_token_ids and at_length_limit(params, info.max_model_len,
                                                    len(prompt_token_ids), len(output_token_ids)):
                yield EngineOutput([], [], engine_pb2.FINISH_REASON_LENGTH, None)
                return
            placement = await self.placer.place(
                prompt_token_ids, model_name=info.model_name, block_size=info.block_size,
                cache_salt=cache_salt, avoid=avoid, local_prefill=bool(output_token_ids),
                quantization=info.quantization, lora_request=lora_request,
                prefer=with_adapter, prompt_hashes=prompt_hashes)
            if placement is None:
                if num_retries:
                    stats.exhausted += 1
                    raise no_backend(f"request {engine_request_id} failed and no other decode "
                                     "instance is live")
                raise no_backend("no decode instance is configured or live")
            if retrying is not None:
                if retrying.role == "decode" and output_token_ids:
                    stats.decode_failovers += 1
                else:
                    stats.prefill_retries += 1
                logger.warning("[%s] %s failed (%s); retry %d/%d on %s with %d tokens done",
                               request_id, engine_request_id, retrying, num_retries,
                               max_retries, placement.decode_address,
                               len(output_token_ids))
                retrying = None
            decode_req = engine_pb2.DecodeRequest(
                request_id=f"{engine_request_id}-retry{num_retries}" if num_retries
                else engine_request_id, prompt_token_ids=prompt_token_ids,
                output_token_ids=output_token_ids, sampling_params=params,
                cache_salt=cache_salt or "",
                lora_request=None if lora_request is None else adapter_to_proto(lora_request))
            try:
                async with aclosing(prefill_then_decode(
                        self.channels, placement, decode_req, request_id,
                        engine_prefix or engine_request_id)) as outputs:
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
                        stats.exhausted += 1
                        raise GatewayError(f"Service unavailable: {failure} for "
                                           f"{sum(overload_waits):.0f} s.", 503) from None
                    overload_waits.append(wait)
                    logger.info("[%s] %s: decode full, placing again in %.2f s",
                                request_id, engine_request_id, wait)
                    stats.overload_waits += 1
                    avoid.append(failure.address)  # another decode instance if one has room
                    await asyncio.sleep(wait)
                    continue
                if failure.instance_failed:
                    self.health.mark_failed(failure.address)
                avoid.append(failure.address)
                if num_retries >= max_retries:
                    stats.exhausted += 1
                    raise GatewayError(
                        f"Service unavailable: {failure} (retried {num_retries} times).",
                        503) from None
                num_retries += 1
                retrying = failure
