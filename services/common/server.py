"""ServiceRuntime: the life of one prefill or decode instance.

    start():  gRPC server up (health NOT_SERVING) ─▶ model loads in a thread ─▶ worker,
              registry monitor, stall watchdog ─▶ health SERVING
    stalled:  work queued, no engine step for `stall_timeout` ─▶ NOT_SERVING until steps
              resume (readiness; liveness is the server answering at all)
    stop():   health NOT_SERVING, new Prefill/Generate refused (UNAVAILABLE), unregistered
              from Redis (gateways stop placing here) ─▶ in-flight requests and pinned KV
              get `grace_period` ─▶ server.stop ─▶ engine thread joined

The servicers hold the runtime and ask it for the worker on every call, so they can be
registered before the model is loaded (they answer UNAVAILABLE meanwhile).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
from collections.abc import Callable

import grpc
import zmq
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.services.common.auth import TokenAuthInterceptor
from pdserve.services.common.config import ServiceConfig
from pdserve.services.common.errors import ServiceError
from pdserve.services.common.kv_events import KVEventPublisher, KVEventsConfig
from pdserve.services.common.metrics import ServiceMetrics
from pdserve.services.common.monitor import InstanceMonitor
from pdserve.services.common.prefix_index import PrefixIndex
from pdserve.services.common.readiness import (
    STEP_FAULT_ENV,
    StallWatchdog,
    stall_file_hook,
    step_fault_hook,
)
from pdserve.services.common.spec_decode_metrics import SpecDecodeCollector
from pdserve.services.common.worker import EngineWorker, Identity
from pdserve.shared.config import grpc_keepalive_server_options
from pdserve.shared.engine.async_engine import AsyncEngine
from pdserve.shared.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

LoadEngine = Callable[[], tuple[EngineCore, int | None]]
"""Builds the engine core (slow: loads the model) and returns it with the EOS token id."""
MakeWorker = Callable[[AsyncEngine, ServiceConfig, Identity, ServiceMetrics, int | None],
                      EngineWorker]
AddServicer = Callable[[grpc.aio.Server, "ServiceRuntime"], None]


class Phase(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServiceRuntime:
    def __init__(self, config: ServiceConfig, load_engine: LoadEngine, make_worker: MakeWorker,
                 add_servicer: AddServicer, service_name: str,
                 kv_events_config: KVEventsConfig | None = None) -> None:
        """`kv_events_config`: the parsed --kv-events-config (None: no KV events out)."""
        self.config = config
        self.kv_events_config = kv_events_config
        self.kv_events: KVEventPublisher | None = None
        self.service_name = service_name
        self._load_engine = load_engine
        self._make_worker = make_worker
        self._add_servicer = add_servicer
        self.phase = Phase.LOADING
        self.worker: EngineWorker | None = None
        self.monitor: InstanceMonitor | None = None
        self.watchdog: StallWatchdog | None = None
        self.index: PrefixIndex | None = None
        self.registry = CollectorRegistry()
        self.identity: Identity | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._metrics_httpd = None
        self._loaded = asyncio.Event()
        self._load_task: asyncio.Task | None = None
        self._stop_task: asyncio.Future | None = None
        self.startup_error: str | None = None
        """Why the start failed on a bad flag (a LoRA adapter): serve_forever exits 2."""

    async def start(self) -> None:
        """Serve health (NOT_SERVING) at once; load the model in the background."""
        interceptors = ([TokenAuthInterceptor(self.config.internal_token)]
                        if self.config.internal_token else [])
        # Keepalive: accept the gateway's and decodes' pings (else GOAWAY too_many_pings).
        server = grpc.aio.server(
            options=self.config.grpc_options() + grpc_keepalive_server_options(),
            interceptors=interceptors)
        add_HealthServicer_to_server(self._health, server)
        self._add_servicer(server, self)
        bound = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if bound == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self.identity = Identity(self.config.resolve_instance_id(bound),
                                 self.config.resolve_address(bound))
        if self.config.metrics_port is not None:
            self._metrics_httpd, _ = start_http_server(self.config.metrics_port,
                                                       addr=self.config.host,
                                                       registry=self.registry)
            self.metrics_port = self._metrics_httpd.server_port
        logger.info("%s %s listening on %s (metrics port %s); loading the model",
                    self.config.role, self.identity.instance_id, self.identity.address,
                    self.metrics_port)
        self._load_task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        assert self.identity is not None
        try:
            core, eos_token_id = await asyncio.to_thread(self._load_engine)
        except Exception:
            logger.exception("%s: loading the engine failed", self.identity.instance_id)
            self.phase = Phase.FAILED
            self._loaded.set()
            return
        engine = AsyncEngine(core, name=f"{self.config.role}-engine")
        if self.config.test_stall_file:
            logger.warning("test hook: the engine stalls while %s exists",
                           self.config.test_stall_file)
            engine.stall_hook = stall_file_hook(engine, self.config.test_stall_file)
        fault_file = os.environ.get(STEP_FAULT_ENV, "")
        if fault_file:
            logger.warning("test hook: every engine step raises while %s exists", fault_file)
            engine.fault_hook = step_fault_hook(fault_file)
        metrics = ServiceMetrics(core.model_config.served_model_name, self.registry)
        metrics.set_memory(core.memory_bytes())
        if core.speculative_config is not None:
            self.registry.register(SpecDecodeCollector(core.scheduler.spec_decoding_stats,
                                                       core.model_config.served_model_name))
        self.worker = self._make_worker(engine, self.config, self.identity, metrics,
                                        eos_token_id)
        if not await self._load_lora_modules(self.worker):
            return
        if self.config.redis_url:
            self.index = PrefixIndex(self.config.redis_url, self.worker.model_name,
                                     ttl=self.config.registration_ttl,
                                     max_backoff=self.config.redis_max_backoff)
        metrics_address = ""
        if self.metrics_port is not None:
            host = self.identity.address.rsplit(":", 1)[0]
            metrics_address = f"{host}:{self.metrics_port}"
        if not self._start_kv_events():
            return
        self.monitor = InstanceMonitor(self.worker, self.index, metrics_address, self.kv_events)
        self.monitor.start()
        self.worker.on_lora_change = self.monitor.heartbeat  # gateways see it at once
        # NOTE: also with --stall-timeout 0: it turns NOT_SERVING on failing steps too.
        interval = self.config.stall_check_interval if self.config.stall_timeout > 0 else 1.0
        self.watchdog = StallWatchdog(engine, self.config.stall_timeout, interval,
                                      self._on_stall)
        self.watchdog.start()
        if self.phase is Phase.LOADING:
            self.phase = Phase.SERVING
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            logger.info("%s %s: SERVING (%d KV blocks)", self.config.role,
                        self.identity.instance_id, core.num_gpu_blocks)
        self._loaded.set()

    async def _load_lora_modules(self, worker: EngineWorker) -> bool:
        """Load --lora-modules before serving; a bad adapter fails the start (exit 2, its
        one-line reason in `startup_error`)."""
        for lora in self.config.lora_modules:
            try:
                await worker.load_lora(lora)
            except ServiceError as e:
                self.startup_error = f"--lora-modules {lora.lora_name}: {e}"
                logger.error("%s", self.startup_error)
                self.phase = Phase.FAILED
                self._loaded.set()
                return False
            logger.info("LoRA adapter %s (id %d) loaded from %s", lora.lora_name,
                        lora.lora_int_id, lora.lora_path)
        return True

    def _start_kv_events(self) -> bool:
        """Bind the KV events publisher when asked; an endpoint that cannot be bound fails
        the start (exit 2, its one-line reason in `startup_error`)."""
        config = self.kv_events_config
        if config is None or not config.is_publishing:
            return True
        try:
            self.kv_events = KVEventPublisher(config)
        except zmq.ZMQError as e:
            self.startup_error = f"--kv-events-config: cannot use {config.endpoint}: {e}"
            logger.error("%s", self.startup_error)
            self.phase = Phase.FAILED
            self._loaded.set()
            return False
        return True

    async def wait_ready(self, timeout: float | None = None) -> EngineWorker:
        """The worker once loaded. Raises RuntimeError if loading failed."""
        await asyncio.wait_for(self._loaded.wait(), timeout)
        if self.worker is None or self.phase is Phase.FAILED:
            raise RuntimeError(f"{self.config.role}: "
                               f"{self.startup_error or 'the engine failed to load'}")
        return self.worker

    def require_worker(self, new_request: bool = True) -> EngineWorker:
        """The worker, or ServiceError(UNAVAILABLE) while loading (or, for a new request,
        draining)."""
        worker = self.worker
        if worker is None or self.phase in (Phase.LOADING, Phase.FAILED, Phase.STOPPED):
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.config.role} instance is {self.phase.value}")
        if new_request and self.phase is Phase.DRAINING:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.config.role} instance is draining")
        return worker

    async def _on_stall(self, stalled: bool, seconds: float) -> None:
        if self.phase is Phase.SERVING:  # loading and draining keep their own status
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                   else health_pb2.HealthCheckResponse.SERVING)

    async def _set_health(self, status) -> None:
        for name in ("", self.service_name):
            await self._health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then stop everything. Idempotent; concurrent callers share one stop."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(
                self.config.grace_period if grace is None else grace))
        await asyncio.shield(self._stop_task)

    async def _stop(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        self.phase = Phase.DRAINING
        await self._health.enter_graceful_shutdown()
        if self.monitor is not None:  # streams and KV fetches in flight know our address
            await self._bounded("registry leave", self.monitor.leave(), 5)
        worker = self.worker
        while worker is not None and time.monotonic() < deadline and (
                worker.num_in_flight() or worker.num_pinned_blocks()):
            await asyncio.sleep(0.05)
        # NOTE: every step is bounded: a shutdown must end even if a peer or a call hangs.
        if self._server is not None:
            remaining = max(0.0, deadline - time.monotonic())
            await self._bounded("gRPC server stop", self._server.stop(remaining), remaining + 5)
        if self._load_task is not None and not self._load_task.done():
            await asyncio.gather(self._load_task, return_exceptions=True)
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.monitor is not None:
            await self._bounded("registry monitor stop", self.monitor.stop(), 5)
        if self.kv_events is not None:
            await self._bounded("KV events publisher stop",
                                asyncio.to_thread(self.kv_events.shutdown), 5)
        if worker is not None:
            await self._bounded("worker close", worker.close(), self.config.rpc_timeout + 5)
            await self._bounded("engine shutdown", asyncio.to_thread(worker.engine.shutdown), 10)
        if self.index is not None:
            await self._bounded("Redis close", self.index.close(), 5)
        if self._metrics_httpd is not None:
            await self._bounded("metrics endpoint stop",
                                asyncio.to_thread(self._metrics_httpd.shutdown), 5)
            self._metrics_httpd.server_close()
        self.phase = Phase.STOPPED
        logger.info("%s stopped", self.identity.instance_id if self.identity else "service")

    async def _bounded(self, what: str, aw, timeout: float) -> None:
        try:
            await asyncio.wait_for(aw, timeout)
        except TimeoutError:
            logger.warning("%s did not finish within %g s; going on", what, timeout)

    async def serve_forever(self) -> int:
        """start(), then run until SIGTERM / SIGINT (or a failed load); returns an exit code."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        loaded = loop.create_task(self._loaded.wait())
        await asyncio.wait([loaded, loop.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if self.phase is not Phase.FAILED:
            await stop.wait()
        failed = self.phase is Phase.FAILED
        await self.stop()
        if self.startup_error is not None:
            print(f"error: {self.startup_error}", flush=True)
            return 2
        return 1 if failed else 0
