"""GET /debug/kv-audit against fake engines: every known instance is asked for its state
with check_invariants set; a broken pool and an unreachable instance turn `ok` false and
are reported with their errors; the route needs the admin API key."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from pdserve.services.proto import engine_pb2, engine_pb2_grpc
from tests.services.gateway.helpers import assert_error_object
from tests.services.helpers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-audit-tenant"
ADMIN = "sk-audit-admin"
AUDIT = "/debug/kv-audit"
BROKEN_STATE = dict(instance_id="decode-broken", role="decode", model="fake-model",
                    num_gpu_blocks=64, num_free_blocks=50, num_cached_blocks=7,
                    num_used_blocks=13, num_pinned_blocks=2, num_running=3, num_waiting=1,
                    invariants_ok=False, invariants_error="block 5: ref_cnt -1",
                    max_model_len=2048, block_size=16)


class BrokenDecode(engine_pb2_grpc.DecodeServiceServicer):
    """A decode instance whose pool fails its invariants; records the GetState requests."""

    def __init__(self) -> None:
        self.requests: list[engine_pb2.GetStateRequest] = []

    async def GetState(self, request, context):
        self.requests.append(request)
        return engine_pb2.EngineState(**BROKEN_STATE)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def broken():
    server = grpc.aio.server()
    servicer = BrokenDecode()
    engine_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    yield servicer
    await server.stop(None)


async def _audit(gw) -> dict:
    r = await gw.http.get(AUDIT, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()


async def test_audit_of_healthy_instances(make_gateway, cluster):
    gw = await make_gateway(api_key=KEY, admin_api_key=ADMIN)
    assert_error_object(await gw.http.get(AUDIT), 401)
    tenant = await gw.http.get(AUDIT, headers={"Authorization": f"Bearer {KEY}"})
    assert assert_error_object(tenant, 403)["type"] == "PermissionDeniedError"
    report = await _audit(gw)
    assert report["object"] == "kv_audit" and report["ok"] is True
    by_role = {i["role"]: i for i in report["instances"]}
    assert len(report["instances"]) == 2 and set(by_role) == {"prefill", "decode"}
    for role, entry in by_role.items():
        address = (cluster.prefill_urls if role == "prefill" else cluster.decode_urls)[0]
        assert entry["address"] == address and entry["instance_id"] == f"{role}-0"
        assert entry["reachable"] is True and entry["error"] is None
        assert entry["invariants_ok"] is True and entry["invariants_error"] == ""
        assert entry["num_used_blocks"] == entry["num_pinned_blocks"] == 0
        assert entry["num_running"] == entry["num_waiting"] == 0
    assert report["totals"]["num_used_blocks"] == 0


async def test_broken_and_unreachable_instances_are_reported(make_gateway, cluster, broken):
    dead = f"127.0.0.1:{free_port()}"
    gw = await make_gateway(api_key=KEY, admin_api_key=ADMIN,
                            decode_urls=cluster.decode_urls + (broken.address, dead))
    broken.requests.clear()
    report = await _audit(gw)
    assert report["ok"] is False
    by_address = {i["address"]: i for i in report["instances"]}
    assert len(report["instances"]) == 4 and len(by_address) == 4
    assert [r.check_invariants for r in broken.requests] == [True]

    bad = by_address[broken.address]
    assert bad["reachable"] is True and bad["role"] == "decode"
    assert bad["invariants_ok"] is False and bad["invariants_error"] == "block 5: ref_cnt -1"
    for field in ("instance_id", "num_gpu_blocks", "num_free_blocks", "num_cached_blocks",
                  "num_used_blocks", "num_pinned_blocks", "num_running", "num_waiting"):
        assert bad[field] == BROKEN_STATE[field], field

    gone = by_address[dead]
    assert gone["reachable"] is False and gone["role"] == "decode"
    assert gone["error"].startswith("UNAVAILABLE")
    assert gone["instance_id"] is None and gone["invariants_ok"] is None

    totals = report["totals"]  # the fakes report 0 blocks: the totals are the broken one's
    assert totals["num_used_blocks"] == 13 and totals["num_pinned_blocks"] == 2
    assert totals["num_gpu_blocks"] == 64 and totals["num_running"] == 3


async def test_audit_without_instances_is_not_ok(make_gateway):
    gw = await make_gateway(api_key=KEY, admin_api_key=ADMIN, prefill_urls=(), decode_urls=(),
                            max_model_len=2048)
    report = await _audit(gw)
    assert report == {"object": "kv_audit", "ok": False, "instances": [],
                      "totals": dict.fromkeys(report["totals"], 0)}
    assert len(report["totals"]) == 7
