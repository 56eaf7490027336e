"""/health, /metrics, X-Request-Id, /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

import re
import socket

import pytest

from tests.services.gateway.helpers import CHAT, COMPLETIONS, chat_body, completion_body

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_health_is_200_while_a_decode_serves_and_names_what_is_degraded(gateway,
                                                                           make_gateway):
    r = await gateway.http.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "degraded": {},
                        "prefill": {"serving": 1, "instances": 1},
                        "decode": {"serving": 1, "instances": 1}, "redis": None}
    await gateway.cluster.set_serving(gateway.decode.address, False)
    r = await gateway.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert r.json()["degraded"] == {"decode": "0 of 1 decode instances serving"}
    await gateway.cluster.set_serving(gateway.decode.address, True)
    await gateway.cluster.set_serving(gateway.prefill.address, False)
    r = await gateway.http.get("/health")  # the decode instance prefills locally
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    assert r.json()["degraded"] == {"prefill": "0 of 1 prefill instances serving: the decode "
                                               "instances prefill every prompt themselves"}
    await gateway.cluster.set_serving(gateway.prefill.address, True)
    assert (await gateway.http.get("/health")).json()["status"] == "ok"
    decode_only = await make_gateway(prefill_urls=())
    r = await decode_only.http.get("/health")
    assert r.status_code == 200 and set(r.json()["degraded"]) == {"prefill"}
    unreachable = await make_gateway(decode_urls=("127.0.0.1:1",))
    assert (await unreachable.http.get("/health")).status_code == 503


async def test_health_stays_200_without_redis_and_says_so(make_gateway):
    """Issue 37: Redis is a cache; /health never asks it (its view's state is reported)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = await make_gateway(redis_url=f"redis://127.0.0.1:{port}/0")
    r = await gw.http.get("/health")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "degraded"
    assert r.json()["redis"] == {"up": False, "view_age_s": None}
    assert r.json()["degraded"] == {
        "redis": "unreachable: placing on the instances and cached prefixes last seen"}
    assert (await gw.http.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


def _sample(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? (\S+)$" if labels else \
        rf"^{re.escape(name)} (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


async def test_metrics_count_routes_statuses_and_latencies(gateway):
    before = (await gateway.http.get("/metrics")).text
    await gateway.http.post(CHAT, json=chat_body(max_tokens=3, temperature=0))
    await gateway.http.post(CHAT, json=chat_body(max_tokens=3, temperature=0, stream=True))
    await gateway.http.post(CHAT, json=chat_body(n=0))
    await gateway.http.post(COMPLETIONS, json=completion_body(max_tokens=2, temperature=0))
    r = await gateway.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text

    def delta(name, **labels):
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    requests = "pdserve_gateway_requests_total"
    assert delta(requests, route=CHAT, status="200") == 2
    assert delta(requests, route=CHAT, status="400") == 1
    assert delta(requests, route=COMPLETIONS, status="200") == 1
    assert delta("pdserve_gateway_time_to_first_token_seconds_count", route=CHAT) == 2
    assert delta("pdserve_gateway_e2e_request_latency_seconds_count", route=CHAT) == 2
    assert delta("pdserve_gateway_generation_tokens_total") == 8


async def test_request_id_is_honoured_returned_and_propagated(gateway):
    r = await gateway.http.post(CHAT, json=chat_body(max_tokens=3, n=2, temperature=0),
                                headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    assert gateway.prefill.rec.request_ids_metadata[-2:] == ["trace-42", "trace-42"]
    assert gateway.decode.rec.request_ids_metadata[-1] == "trace-42"
    engine_ids = sorted(req.request_id for req in gateway.prefill.rec.requests[-2:])
    assert all(i.startswith("trace-42-") for i in engine_ids)
    assert [i.rsplit("-", 1)[1] for i in engine_ids] == ["0", "1"]
    # The same client id twice never collides inside the engine.
    await gateway.http.post(CHAT, json=chat_body(max_tokens=1),
                            headers={"X-Request-Id": "trace-42"})
    assert gateway.prefill.rec.requests[-1].request_id not in engine_ids
    minted = await gateway.http.post(CHAT, json=chat_body(max_tokens=1))
    rid = minted.headers["x-request-id"]
    assert len(rid) >= 16 and gateway.prefill.rec.request_ids_metadata[-1] == rid
    bad = await gateway.http.get("/v1/models", headers={"X-Request-Id": "bad id\twith space"})
    assert bad.headers["x-request-id"] != "bad id\twith space"
    assert (await gateway.http.get("/health")).headers["x-request-id"]


async def test_models(gateway):
    body = (await gateway.http.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["pdserve-test"]
    assert body["data"][0]["max_model_len"] == 2048
    models = await gateway.client.models.list()
    assert [m.id for m in models.data] == ["pdserve-test"]


async def test_tokenize_and_detokenize(gateway, fast_tokenizer):
    r = (await gateway.http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert r["tokens"] == fast_tokenizer.encode("Hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    chat = (await gateway.http.post("/tokenize", json={
        "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True})).json()
    assert chat["tokens"] == list(fast_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False))
    assert len(chat["token_strs"]) == chat["count"]
    d = (await gateway.http.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert d == {"prompt": "Hello world"}
    assert (await gateway.http.post("/detokenize", json={"tokens": [-5]})).status_code == 400
    assert (await gateway.http.post("/tokenize", json={})).status_code == 400
