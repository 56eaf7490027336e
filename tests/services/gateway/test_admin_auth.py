"""Operator routes (services/gateway/admin.py): the 401/403 sweep over every route of the
app with no key, a tenant's key, a wrong key and the admin key; the admin key is no tenant;
a gateway without any key stays open; the flag, its variable and a clash with a tenant key."""

from __future__ import annotations

import pytest
import pytest_asyncio

from pdserve.services.gateway.__main__ import build_parser
from pdserve.services.gateway.admin import ADMIN_PATH_PREFIXES, is_admin_path
from pdserve.services.gateway.config import config_from_cli_args
from pdserve.services.gateway.middleware import PUBLIC_ROUTES
from pdserve.services.gateway.routes import ROUTES
from tests.services.gateway.helpers import assert_error_object, chat_body

pytestmark = pytest.mark.asyncio(loop_scope="module")

TENANT, ADMIN = "sk-tenant-0123", "sk-admin-4567"
EXTRA_PATHS = ("/debug/no-such-route", "/no/such/route")
"""An unknown operator path must not tell 404 before the key either."""


def _requests() -> list[tuple[str, str]]:
    out = [(m, r.path) for r in ROUTES for m in sorted(r.methods or ()) if m != "HEAD"]
    out += [(m, p) for p in EXTRA_PATHS for m in ("GET", "POST")]
    return list(dict.fromkeys(out))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _expected(path: str, who: str) -> int | None:
    """The refusal `who` gets on `path`, or None when the route itself answers."""
    if path in PUBLIC_ROUTES:
        return None
    if is_admin_path(path):
        return {"none": 401, "wrong": 401, "tenant": 403, "admin": None}[who]
    return {"none": 401, "wrong": 401, "tenant": None, "admin": 403}[who]


@pytest_asyncio.fixture(loop_scope="module")
async def guarded(make_gateway):
    return await make_gateway(api_key=TENANT, admin_api_key=ADMIN)


async def test_sweep_every_route_with_every_kind_of_key(guarded):
    headers = {"none": {}, "wrong": _bearer("sk-wrong"), "tenant": _bearer(TENANT),
               "admin": _bearer(ADMIN)}
    requests = _requests()
    admin_routes = [p for _, p in requests if is_admin_path(p)]
    assert "/debug/kv-audit" in admin_routes and ADMIN_PATH_PREFIXES[0] == "/debug/"
    seen: dict[int, int] = {}
    for method, path in requests:
        for who, h in headers.items():
            r = await guarded.http.request(method, path, headers=h)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            refusal = _expected(path, who)
            if refusal is None:
                assert r.status_code not in (401, 403), (method, path, who, r.text)
                continue
            err = assert_error_object(r, refusal)
            assert err["code"] == refusal, (method, path, who)
            if refusal == 401:
                assert err["type"] == "AuthenticationError"
                assert r.headers["www-authenticate"] == "Bearer", (method, path, who)
            else:
                assert err["type"] == "PermissionDeniedError", (method, path, who)
    assert seen[401] and seen[403] and seen[200], seen
    r = await guarded.http.get("/debug/kv-audit", headers=_bearer(ADMIN))
    assert r.status_code == 200 and r.json()["ok"] is True
    r = await guarded.http.post("/v1/chat/completions", json=chat_body(max_tokens=2),
                                headers=_bearer(TENANT))
    assert r.status_code == 200, r.text


async def test_metrics_protected_opens_to_tenants_and_the_operator(make_gateway):
    gw = await make_gateway(api_key=TENANT, admin_api_key=ADMIN, protect_metrics=True)
    assert_error_object(await gw.http.get("/metrics"), 401)
    for key in (TENANT, ADMIN):
        assert (await gw.http.get("/metrics", headers=_bearer(key))).status_code == 200


async def test_tenant_keys_without_an_admin_key_close_the_operator_routes(make_gateway):
    gw = await make_gateway(api_key=TENANT)
    assert_error_object(await gw.http.get("/debug/kv-audit"), 401)
    assert_error_object(await gw.http.get("/debug/kv-audit", headers=_bearer(TENANT)), 403)


async def test_admin_key_alone_guards_only_the_operator_routes(make_gateway):
    gw = await make_gateway(admin_api_key=ADMIN)
    assert_error_object(await gw.http.get("/debug/kv-audit"), 401)
    assert (await gw.http.get("/debug/kv-audit", headers=_bearer(ADMIN))).status_code == 200
    assert (await gw.http.get("/v1/models")).status_code == 200  # no tenant keys: open


async def test_a_gateway_without_keys_stays_open(gateway):
    assert (await gateway.http.get("/debug/kv-audit")).status_code == 200


async def test_admin_key_from_flag_and_env(model_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert config_from_cli_args(parse(["--model", model_path])).admin_api_key is None
    cfg = config_from_cli_args(parse(["--model", model_path, "--admin-api-key", "a1"]))
    assert cfg.admin_api_key == ("a1",)
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "e1")
    assert config_from_cli_args(parse(["--model", model_path])).admin_api_key == ("e1",)
    with pytest.raises(ValueError, match="--admin-api-key must differ"):
        config_from_cli_args(parse(["--model", model_path, "--api-key", "e1"]))
