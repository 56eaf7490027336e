"""Operator routes: who may call /debug/* (and any other path in ADMIN_PATH_PREFIXES).

    --admin-api-key KEY (or PDSERVE_ADMIN_API_KEY)     the operator's key(s)
    --api-key KEY                                       the tenants' keys

    on an operator route        no / unknown key: 401     a tenant's key: 403
                                the admin key: the route
    without any key configured  everything is open (a loopback dev gateway, as before)
    tenant keys but no admin key: operator routes answer 403 to every tenant, 401 otherwise

A browser cannot add a Bearer header to a page it navigates to, so an operator route asked
for HTML gets a Basic challenge (BROWSER_CHALLENGE) and takes the admin key as the Basic
password. The admin key is not a tenant: on /v1 and the other tenant routes it gets 403 (it has no
prefix-cache tenant of its own); on the public routes (/health, /metrics ...) it is ignored.

GatewayMiddleware calls `AdminGuard.check` for every request; a handler of an operator
route may also call `require_admin(request)` (it raises unless the middleware recognised
the admin key, or no key at all is configured).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.requests import Request

from pdserve.services.gateway.config import split_api_keys
from pdserve.services.gateway.errors import GatewayError

ADMIN_PATH_PREFIXES = ("/debug/", "/dashboard", "/v1/load_lora_adapter",
                       "/v1/unload_lora_adapter")
"""Paths that need the admin key: every /debug/* route, the operator dashboard and vLLM's
LoRA adapter routes (services/gateway/lora.py)."""


def is_admin_path(path: str) -> bool:
    """True for an operator route (a path in or under ADMIN_PATH_PREFIXES)."""
    return path.startswith(ADMIN_PATH_PREFIXES)


def presented_key(headers: Headers) -> str | None:
    """The key of `Authorization: Bearer <key>`, or the password of `Authorization: Basic
    base64(<any user>:<key>)` (how a browser sends it after the Basic challenge of
    `unauthorized`); None otherwise."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if not token:
        return None
    if scheme.lower() == "bearer":
        return token
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(token, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, colon, password = decoded.partition(":")
        return password if colon and password else None
    return None


def _matches(presented: str | None, keys: Sequence[bytes]) -> bool:
    """Constant time per key, every key compared (the time does not tell which matched)."""
    got = (presented or "").encode()
    hit = False
    for key in keys:
        hit |= hmac.compare_digest(got, key) and presented is not None
    return hit


BROWSER_CHALLENGE = 'Basic realm="pdserve operator", charset="UTF-8"'
"""The 401 challenge of an operator route to a browser (the module docstring says why)."""


def unauthorized(headers: Headers | None = None) -> GatewayError:
    """401: no key, or a key that is nobody's, with `WWW-Authenticate: Bearer`; on an
    operator route (`headers` given) asked for by a browser (Accept: text/html), with
    BROWSER_CHALLENGE instead."""
    err = GatewayError("Invalid or missing API key.", 401)
    browser = headers is not None and "text/html" in headers.get("accept", "")
    err.headers = {  # type: ignore[attr-defined]
        "WWW-Authenticate": BROWSER_CHALLENGE if browser else "Bearer"}
    return err


def forbidden(message: str) -> GatewayError:
    """403: a known key that may not use this route (OpenAI's PermissionDeniedError)."""
    return GatewayError(message, 403, err_type="PermissionDeniedError")


class AdminGuard:
    """Decides, from the headers alone, whether a request may reach its route."""

    def __init__(self, admin_api_key: str | Sequence[str] | None,
                 tenant_keys_configured: bool) -> None:
        """`admin_api_key`: one key, several, or comma-separated; None: no operator key.
        `tenant_keys_configured`: --api-key was given (the gateway is not open)."""
        self._admin = [k.encode() for k in split_api_keys(admin_api_key)]
        self._tenants = tenant_keys_configured

    @property
    def is_open(self) -> bool:
        """No key of any kind: every route is open (the local dev gateway)."""
        return not self._admin and not self._tenants

    def is_admin(self, headers: Headers) -> bool:
        """The request presents an admin key."""
        return bool(self._admin) and _matches(presented_key(headers), self._admin)

    def check_admin_route(self, headers: Headers, is_tenant: bool) -> GatewayError | None:
        """None when the request may use an operator route; otherwise the 401 / 403.
        `is_tenant`: the request presents one of the tenants' keys."""
        if self.is_open or self.is_admin(headers):
            return None
        if is_tenant:
            return forbidden("This route is for the operator: it needs the admin API key "
                             "(--admin-api-key), not a tenant's key.")
        return unauthorized(headers)

    def check_tenant_route(self, headers: Headers) -> GatewayError | None:
        """The admin key on a tenant route (/v1 ...) when tenant keys exist: 403."""
        if self._tenants and self.is_admin(headers):
            return forbidden("The admin API key opens the operator routes only; use a "
                             "tenant's API key (--api-key) here.")
        return None


def require_admin(request: Request) -> None:
    """For a handler of an operator route: raise unless the middleware let it through as
    the operator's (admin key presented, or no key configured at all).

    Raises:
        GatewayError: 401 (no or unknown key) or 403 (a tenant's key).
    """
    state = request.scope.get("state", {})
    if not state.get("is_admin", False):
        raise forbidden("This route is for the operator: it needs the admin API key "
                        "(--admin-api-key).") if state.get("tenant_cache_salt") \
            else unauthorized(request.headers)
