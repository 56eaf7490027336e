"""build_app: the gateway's Starlette application (torch-free to import).

    CORSMiddleware (preflights answered here, no key needed)
    GatewayMiddleware (request id, API key, metrics)
      └─ routes ─▶ CompletionServing / ChatServing / TokenizationServing
                     └─ EngineClient (placement, failover, ChannelPool gRPC channels)
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from pdserve.services.gateway.admission import AdmissionQueue
from pdserve.services.gateway.channel_pool import ChannelPool
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.failover import EngineClient
from pdserve.services.gateway.federation import MetricsFederation
from pdserve.services.gateway.lora import LoRAView
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.middleware import GatewayMiddleware
from pdserve.services.gateway.peer_tier import PeerFetchCost
from pdserve.services.gateway.placement import InstanceRegistry, Placer
from pdserve.services.gateway.registry_view import RegistryView
from pdserve.services.gateway.response_store import open_response_store
from pdserve.services.gateway.routes import EXCEPTION_HANDLERS, ROUTES
from pdserve.services.gateway.serving_chat import ChatServing
from pdserve.services.gateway.serving_completion import CompletionServing
from pdserve.services.gateway.serving_pooling import PoolingServing
from pdserve.services.gateway.serving_responses import ResponsesServing
from pdserve.services.gateway.serving_tokenization import TokenizationServing
from pdserve.services.gateway.shutdown import ShutdownNotice
from pdserve.services.gateway.tokenization import GatewayTokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Gateway:
    """Everything the handlers reach through `request.app.state.gateway`."""

    config: GatewayConfig
    tokenizer: GatewayTokenizer
    channels: ChannelPool
    engine: EngineClient
    metrics: GatewayMetrics
    completion: CompletionServing
    chat: ChatServing
    tokenization: TokenizationServing
    created: int
    federation: MetricsFederation
    shutdown: ShutdownNotice
    responses: ResponsesServing | None = None
    """/v1/responses (its store: Redis with --redis-url, else this gateway's memory)."""
    pooling: PoolingServing | None = None
    """/v1/embeddings, /pooling, /score, /rerank (a --runner pooling deployment)."""
    lora: LoRAView | None = None
    """The cluster's LoRA adapters: /v1/models, `model` -> adapter, the admin routes."""


def _connect_registry(config: GatewayConfig) -> RegistryView | None:
    """A background-refreshed view of the Redis PrefixIndex for --redis-url (None without
    one): no request and no /health ever waits on Redis."""
    if not config.redis_url:
        return None
    from pdserve.services.common.prefix_index import PrefixIndex

    # NOTE: instances register under their served model name: configure the same one here.
    return RegistryView(PrefixIndex(config.redis_url, config.served_model_name))


def build_app(config: GatewayConfig, channels: ChannelPool | None = None,
              registry: InstanceRegistry | None = None,
              shutdown: ShutdownNotice | None = None) -> Starlette:
    """The gateway app. `channels` and `registry` are injectable (tests, other transports);
    by default gRPC channels to the configured instances and the Redis prefix index.
    `shutdown`: a notice shared with other models' apps (multi_model.py)."""
    tokenizer = GatewayTokenizer(load_tokenizer(config.tokenizer or config.model_path),
                                 chat_template=config.chat_template)
    channels = channels or ChannelPool(config.request_timeout, config.rpc_timeout,
                                       config.internal_token)
    owned_registry = _connect_registry(config) if registry is None else None
    registry = registry if registry is not None else owned_registry
    placer = Placer(config.prefill_urls, config.decode_urls, registry,
                    config.local_prefill_threshold,
                    max_prefill_queue_size=config.max_prefill_queue_size,
                    in_flight=channels.in_flight,
                    peer_cost=PeerFetchCost(config.kv_peer_bandwidth,
                                            config.kv_peer_prefill_rate,
                                            config.kv_peer_overhead))
    engine = EngineClient(config, channels, placer)
    lora = engine.lora = LoRAView(channels, placer, config.served_model_name)
    metrics = GatewayMetrics()
    metrics.registry.register(engine.failover_stats)
    metrics.registry.register(channels.control_calls)
    admission = AdmissionQueue(config.max_num_queued_requests, config.max_queued_tokens,
                               metrics.registry)
    shutdown = shutdown or ShutdownNotice()
    chat = ChatServing(config, engine, tokenizer, metrics, admission, shutdown, lora)
    federation = MetricsFederation(metrics.registry, registry, config.metrics_compat,
                                   config.served_model_name)
    gateway = Gateway(config, tokenizer, channels, engine, metrics,
                      CompletionServing(config, engine, tokenizer, metrics, admission,
                                        shutdown, lora),
                      chat, TokenizationServing(chat), int(time.time()), federation, shutdown,
                      responses=ResponsesServing(chat, open_response_store(
                          config.redis_url, config.responses_ttl), metrics),
                      pooling=PoolingServing(config, engine, tokenizer, metrics, admission),
                      lora=lora)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if owned_registry is not None:
            await owned_registry.start()
        try:
            info = await engine.engine_info()
            logger.info("serving %s (max_model_len %d) via prefill %s, decode %s",
                        config.served_model_name, info.max_model_len,
                        list(config.prefill_urls), list(config.decode_urls))
        except GatewayError as e:
            logger.info("the engines are not ready yet (%s); asking again per request", e)
        yield
        await federation.close()
        await engine.close()
        await channels.close()
        tokenizer.close()
        await gateway.responses.store.close()
        if owned_registry is not None:
            await owned_registry.close()

    # NOTE: CORS is outermost: it answers preflights (OPTIONS) itself, so they never need
    # a key (browsers send no Authorization header on a preflight).
    cors = Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                      allow_methods=list(config.allowed_methods),
                      allow_headers=list(config.allowed_headers),
                      allow_credentials=config.allow_credentials)
    app = Starlette(routes=ROUTES, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan,
                    middleware=[cors, Middleware(GatewayMiddleware, api_key=config.api_key,
                                                 metrics=metrics,
                                                 routes=frozenset(r.path for r in ROUTES),
                                                 protect_metrics=config.protect_metrics,
                                                 admin_api_key=config.admin_api_key,
                                                 shutdown=shutdown)])
    app.state.gateway = gateway
    return app
