"""API keys: every route but /health refuses a request without one of the keys (401, an
OpenAI error object); each key works; each key is a prefix-cache tenant whose salt reaches
the engines in place of (or in front of) the client's `cache_salt`. Keys from flags and env."""

from __future__ import annotations

import logging

import pytest
import pytest_asyncio

from pdserve.services.gateway.__main__ import build_parser
from pdserve.services.gateway.config import config_from_cli_args, split_api_keys
from pdserve.services.gateway.middleware import PUBLIC_ROUTES
from pdserve.services.gateway.routes import ROUTES
from pdserve.services.gateway.tenancy import request_cache_salt, tenant_cache_salt
from tests.services.gateway.helpers import CHAT, COMPLETIONS, assert_error_object, chat_body

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY_A, KEY_B = "sk-tenant-a-0123", "sk-tenant-b-4567"
SALT_A, SALT_B = tenant_cache_salt(KEY_A), tenant_cache_salt(KEY_B)
EXTRA_PATHS = ("/openapi.json", "/no/such/route", "/v1")
"""Checked whether they exist or not: an unknown path must not tell 404 before the key."""


def _requests() -> list[tuple[str, str]]:
    """(method, path) of every route of the app, plus the extra paths (GET and POST)."""
    out = [(m, r.path) for r in ROUTES for m in sorted(r.methods or ()) if m != "HEAD"]
    out += [(m, p) for p in EXTRA_PATHS for m in ("GET", "POST")]
    return list(dict.fromkeys(out))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(loop_scope="module")
async def keyed(make_gateway):
    return await make_gateway(api_key=(KEY_A, KEY_B))


async def test_every_route_but_the_public_ones_needs_a_key(keyed):
    """As vLLM, whose keys guard /v1 only: /health, /ping, /version, /docs, /openapi.json,
    /metrics (Prometheus, load balancers, browsers), /tokenize and /detokenize stay open."""
    refusals = {"none": {}, "wrong": _bearer("sk-wrong"), "prefix": _bearer(KEY_A[:-1]),
                "longer": _bearer(KEY_A + "0"), "scheme": {"Authorization": f"Basic {KEY_A}"},
                "both": _bearer(f"{KEY_A},{KEY_B}")}
    requests = _requests()
    assert ("GET", "/debug/kv-audit") in requests and ("GET", "/health") in requests
    for method, path in requests:
        for name, headers in refusals.items():
            r = await keyed.http.request(method, path, headers=headers)
            if path in PUBLIC_ROUTES:
                # 405: POST /metrics; 400: POST /tokenize without a body (not a 401)
                assert r.status_code in (200, 400, 405), (method, path, name, r.text)
                continue
            err = assert_error_object(r, 401)
            assert (err["type"], err["code"]) == ("AuthenticationError", 401), (method, path)
            assert r.headers["www-authenticate"] == "Bearer", (method, path)
    r = await keyed.http.head("/v1/models")  # no body to check, but the status
    assert r.status_code == 401
    assert {"/tokenize", "/detokenize"} <= PUBLIC_ROUTES
    r = await keyed.http.post("/tokenize", json={"prompt": "Hello there"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0, r.text


@pytest.mark.parametrize("key", [KEY_A, KEY_B])
async def test_each_key_opens_every_route(keyed, key):
    for method, path in _requests():
        r = await keyed.http.request(method, path, headers=_bearer(key))
        assert r.status_code != 401, (method, path, r.text)
    r = await keyed.http.get("/v1/models", headers=_bearer(key))
    assert r.status_code == 200 and r.json()["data"]
    r = await keyed.http.post(CHAT, json=chat_body(max_tokens=2), headers=_bearer(key))
    assert r.status_code == 200, r.text
    # An operator route: a tenant's key is known but not enough (tests in test_admin_auth.py).
    assert_error_object(await keyed.http.get("/debug/kv-audit", headers=_bearer(key)), 403)


async def test_the_engines_get_the_tenant_salt(keyed, cluster, caplog):
    """The salt of the presented key, never the body's alone; the body salt only narrows."""
    caplog.set_level(logging.DEBUG)
    cases = [(KEY_A, None, SALT_A), (KEY_B, None, SALT_B), (KEY_A, "", SALT_A),
             (KEY_A, "team-1", f"{SALT_A}:team-1"),
             (KEY_B, SALT_A, f"{SALT_B}:{SALT_A}")]  # B posing as A's salt stays in B
    for key, body_salt, _ in cases:
        body = chat_body(max_tokens=2, temperature=0)
        if body_salt is not None:
            body["cache_salt"] = body_salt
        r = await keyed.http.post(CHAT, json=body, headers=_bearer(key))
        assert r.status_code == 200, r.text
    assert [p.cache_salt for p in cluster.prefills[0].rec.requests] == [c[2] for c in cases]
    assert [d.cache_salt for d in cluster.decodes[0].rec.requests] == [c[2] for c in cases]
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


async def test_completions_get_the_tenant_salt(keyed, cluster):
    r = await keyed.http.post(COMPLETIONS, headers=_bearer(KEY_B), json={
        "prompt": "Hello", "max_tokens": 2, "temperature": 0, "cache_salt": "x"})
    assert r.status_code == 200, r.text
    assert cluster.prefills[0].rec.requests[-1].cache_salt == f"{SALT_B}:x"


async def test_without_keys_the_body_salt_is_used_as_is(gateway, cluster):
    for body_salt, expected in (("abc", "abc"), (None, ""), ("", "")):
        body = chat_body(max_tokens=2, temperature=0)
        if body_salt is not None:
            body["cache_salt"] = body_salt
        r = await gateway.http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        assert cluster.prefills[0].rec.requests[-1].cache_salt == expected


async def test_tenant_salts():
    assert SALT_A != SALT_B and len(SALT_A) == len(SALT_B) == 32
    assert int(SALT_A, 16) >= 0 and KEY_A not in SALT_A
    assert tenant_cache_salt(KEY_A) == SALT_A  # stable: replicas and restarts agree
    assert request_cache_salt(None, None) is None
    assert request_cache_salt(None, "") is None
    assert request_cache_salt(None, "s") == "s"
    assert request_cache_salt(SALT_A, None) == SALT_A
    assert request_cache_salt(SALT_A, "s") == f"{SALT_A}:s"
    # No body salt of one tenant reproduces another tenant's salt.
    assert not request_cache_salt(SALT_B, SALT_A).startswith(SALT_A)


async def test_keys_from_flags_and_env(model_path, monkeypatch):
    assert split_api_keys(None) == ()
    assert split_api_keys(" a , b,,a ") == ("a", "b")
    assert split_api_keys(("a", "b,c")) == ("a", "b", "c")
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert config_from_cli_args(parse(["--model", model_path])).api_keys == ()
    cfg = config_from_cli_args(parse(["--model", model_path, "--api-key", "k1",
                                      "--api-key", "k2,k3"]))
    assert cfg.api_keys == ("k1", "k2", "k3")
    monkeypatch.setenv("PDSERVE_API_KEY", "e1, e2")
    assert config_from_cli_args(parse(["--model", model_path])).api_keys == ("e1", "e2")
    cfg = config_from_cli_args(parse(["--model", model_path, "--api-key", "k1"]))
    assert cfg.api_keys == ("k1",)  # the flag wins over the variable
