"""A browser opening the operator dashboard: a 401 with a Basic challenge (it cannot add a
Bearer header to a page it navigates to), the admin key accepted as the Basic password,
and nothing else about the keys changed (services/gateway/admin.py)."""

from __future__ import annotations

import base64

import pytest
import pytest_asyncio

from pdserve.services.gateway.admin import BROWSER_CHALLENGE

pytestmark = pytest.mark.asyncio(loop_scope="module")

TENANT, ADMIN = "sk-tenant-0123", "sk-admin-4567"
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@pytest_asyncio.fixture(loop_scope="module")
async def guarded(make_gateway):
    return await make_gateway(api_key=TENANT, admin_api_key=ADMIN)


async def test_a_browser_is_asked_for_the_admin_key(guarded):
    r = await guarded.http.get("/dashboard", headers=HTML)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == BROWSER_CHALLENGE
    assert r.json()["error"]["code"] == 401
    # A script (no text/html in Accept) still gets the Bearer challenge.
    r = await guarded.http.get("/dashboard")
    assert (r.status_code, r.headers["www-authenticate"]) == (401, "Bearer")


async def test_the_admin_key_as_basic_password_opens_the_page_and_its_feed(guarded):
    r = await guarded.http.get("/dashboard", headers={**HTML, **_basic("ops", ADMIN)})
    assert r.status_code == 200 and "text/html" in r.headers["content-type"], r.text
    r = await guarded.http.get("/dashboard/app.js", headers=_basic("", ADMIN))
    assert r.status_code == 200, r.text
    r = await guarded.http.get("/debug/kv-audit", headers=_basic("anyone", ADMIN))
    assert r.status_code == 200 and r.json()["ok"] is True


@pytest.mark.parametrize("header", [
    _basic("ops", "sk-wrong"), _basic("ops", ""), _basic(ADMIN, "x"),
    {"Authorization": "Basic !!!not-base64"}, {"Authorization": "Basic"},
])
async def test_anything_but_the_admin_key_as_password_is_refused(guarded, header):
    r = await guarded.http.get("/dashboard", headers={**HTML, **header})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == BROWSER_CHALLENGE


async def test_a_tenant_key_sent_as_basic_opens_no_operator_route(guarded):
    r = await guarded.http.get("/dashboard", headers={**HTML, **_basic("t", TENANT)})
    assert r.status_code == 401, r.text
    r = await guarded.http.get("/dashboard", headers={"Authorization": f"Bearer {TENANT}"})
    assert r.status_code == 403, r.text
