"""One pure-ASGI middleware: X-Request-Id, the API keys, and per-route request metrics.

The presented API key picks the request's prefix-cache tenant: its salt is stored as
`request.state.tenant_cache_salt` (None without API keys); services/gateway/tenancy.py.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and a
client disconnect still reaches the endpoint.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.services.gateway.admin import AdminGuard, is_admin_path, unauthorized
from pdserve.services.gateway.config import split_api_keys
from pdserve.services.gateway.errors import GatewayError, error_response
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.shutdown import Draining, ShutdownNotice
from pdserve.services.gateway.tenancy import tenant_cache_salt

logger = logging.getLogger("pdserve.services.gateway.access")

# Client ids travel as gRPC metadata and in log lines: keep them short and printable.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
PUBLIC_ROUTES = frozenset({"/health", "/ping", "/version", "/docs", "/openapi.json",
                           "/metrics", "/tokenize", "/detokenize"})
"""Open with API keys too (as vLLM, whose keys guard /v1 only: its /tokenize and /detokenize
sit outside it); /metrics unless --protect-metrics."""


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | Sequence[str] | None,
                 metrics: GatewayMetrics, routes: frozenset[str],
                 protect_metrics: bool = False,
                 admin_api_key: str | Sequence[str] | None = None,
                 shutdown: ShutdownNotice | None = None) -> None:
        """`api_key`: the accepted keys (one, several, or comma-separated; None: open).
        `protect_metrics`: /metrics needs a key too (a tenant's or the admin's).
        `admin_api_key`: the operator's key(s) for /debug/* (services/gateway/admin.py).
        `shutdown`: while it drains, new requests get 503 (/metrics still answers)."""
        self.app = app
        self.shutdown = shutdown or ShutdownNotice()
        self.public = PUBLIC_ROUTES - {"/metrics"} if protect_metrics else PUBLIC_ROUTES
        # (key bytes, the tenant's cache salt) per accepted key; the key itself goes nowhere.
        self._tenants = [(k.encode(), tenant_cache_salt(k))
                         for k in split_api_keys(api_key)]
        self.admin = AdminGuard(admin_api_key, bool(self._tenants))
        self.metrics = metrics
        self.routes = routes

    def _tenant_salt(self, headers: Headers) -> str | None:
        """The salt of the key in `Authorization: Bearer <key>`; None if it is no known key.

        Every key is compared, in constant time each, so the time taken does not tell which.
        """
        scheme, _, token = headers.get("authorization", "").partition(" ")
        presented = token.strip().encode()
        salt = None
        for key, tenant_salt in self._tenants:
            if hmac.compare_digest(presented, key) and scheme.lower() == "bearer":
                salt = tenant_salt
        return salt

    def _refusal(self, path: str, headers: Headers, state: dict) -> GatewayError | None:
        """The 401 / 403 for this request, or None; sets `tenant_cache_salt` and `is_admin`."""
        if self._tenants:
            state["tenant_cache_salt"] = self._tenant_salt(headers)
        state["is_admin"] = self.admin.is_open or self.admin.is_admin(headers)
        if is_admin_path(path):
            return self.admin.check_admin_route(headers, bool(state["tenant_cache_salt"]))
        if path in self.public:
            return None
        if path == "/metrics" and state["is_admin"]:  # --protect-metrics: the operator too
            return None
        if self._tenants and not state["tenant_cache_salt"]:
            return self.admin.check_tenant_route(headers) or unauthorized()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client_id = headers.get("x-request-id", "")
        if _REQUEST_ID_RE.fullmatch(client_id):
            request_id = client_id
            # Two clients may send the same id: the engine ids must stay unique.
            engine_prefix = f"{client_id}-{secrets.token_hex(4)}"
        else:
            request_id = engine_prefix = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, engine_request_prefix=engine_prefix,
                     arrival_time=time.monotonic(), tenant_cache_salt=None)
        path = scope["path"]
        route = path if path in self.routes else (
            "/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        self.metrics.requests_running.inc()
        self.shutdown.num_requests += 1
        try:
            err = self._refusal(path, headers, state)
            if err is None and self.shutdown.draining and path != "/metrics":
                err = Draining()
            if err is not None:
                await error_response(err, getattr(err, "headers", None))(
                    scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.monotonic() - state["arrival_time"]
            # A stream ended by the shutdown's grace period: 200 was sent, the rest was not.
            cut = " cut (server_shutdown)" if state.get("cut_by_shutdown") else \
                " cut (slow client)" if state.get("cut_slow_client") else ""
            logger.info("[%s] %s %s %d %.3fs%s", request_id, scope["method"], path, status,
                        elapsed, cut)
            self.metrics.requests_running.dec()
            self.shutdown.num_requests -= 1
            self.metrics.requests.labels(route, str(status)).inc()
            if route in GENERATION_ROUTES and status == 200:
                self.metrics.e2e_request_latency.labels(route).observe(elapsed)
