"""Failover in the gateway against the fake split engine (real gRPC, scripted model):
broken decode streams continue on another instance with no gap and no repeat, failed
prefills go elsewhere or to a decode instance that prefills itself, the retry budget, 503
with nothing left, health-aware placement and a /health that never waits on a hung peer."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from pdserve.services.gateway.health import HealthTracker, InstanceStatus
from tests.services.gateway.conftest import running_gateway
from tests.services.gateway.fake_engine import FakeCluster, start_fake_cluster
from tests.services.gateway.helpers import (
    CHAT,
    COMPLETIONS,
    assert_error_object,
    chat_body,
    completion_body,
    stream,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_cluster2(fake_model) -> AsyncIterator[FakeCluster]:
    """Two prefill and two decode instances."""
    c = await start_fake_cluster(fake_model, num_prefill=2, num_decode=2)
    yield c
    await c.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def cluster2(module_cluster2) -> FakeCluster:
    await module_cluster2.reset()
    return module_cluster2


def _body(path: str, **kwargs) -> dict:
    if path == CHAT:
        return chat_body("Count for me.", temperature=0, logprobs=True, top_logprobs=2,
                         **kwargs)
    return completion_body("Count for me:", temperature=0, logprobs=2, **kwargs)


def _choices(chunks: list) -> list:
    return [c["choices"] for c in chunks if c["choices"]]


def _usage(chunks: list) -> dict:
    return chunks[-1]["usage"]


async def _read_stream(http, path: str, body: dict, on_event=None) -> list:
    """Every SSE payload of a streamed request (JSON decoded, "[DONE]" as a string);
    `await on_event(events)` after each one."""
    events: list = []
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_event is not None:
                    await on_event(events)
    return events


async def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_broken_decode_stream_continues_without_gap_or_repeat(model_path, cluster2, path):
    body = _body(path, max_tokens=24, ignore_eos=True,
                 stream_options={"include_usage": True})
    async with running_gateway(model_path, cluster2) as gw:
        reference = await stream(gw.http, path, body)
        await cluster2.reset()
        d0, d1 = cluster2.decodes
        d0.rec.break_after = 5
        got = await stream(gw.http, path, body)
        stats = gw.app.state.gateway.engine.failover_stats
    assert not [c for c in got if "error" in c]
    assert _choices(got) == _choices(reference)  # text, logprobs, finish: chunk for chunk
    assert _usage(got) == _usage(reference)  # cached_tokens counted once
    first, retry = d0.rec.requests[0], d1.rec.requests[0]
    assert len(first.output_token_ids) == 1  # the prefill's first token
    assert retry.request_id == first.request_id + "-retry1"
    assert not retry.HasField("kv_transfer_params")
    assert retry.prompt_token_ids == first.prompt_token_ids
    assert len(retry.output_token_ids) == 6 and retry.output_token_ids[0] == \
        first.output_token_ids[0]
    assert retry.sampling_params.max_tokens == 24  # counts the tokens already out
    assert (stats.decode_failovers, stats.prefill_retries, stats.exhausted) == (1, 0, 0)
    # The prefill's pinned KV is released; the instance that broke gets no Abort.
    await _wait(lambda: first.request_id in cluster2.prefills[0].rec.aborted)
    assert not d0.rec.aborted


async def test_spent_retry_budget_ends_the_stream_with_an_error_event(model_path, cluster2):
    body = _body(COMPLETIONS, max_tokens=24, ignore_eos=True)
    async with running_gateway(model_path, cluster2, max_request_retries=1) as gw:
        reference = "".join(c["choices"][0]["text"] for c in await stream(gw.http, COMPLETIONS,
                                                                          body))
        await cluster2.reset()
        for d in cluster2.decodes:
            d.rec.break_after = 3
        events = await stream(gw.http, COMPLETIONS, body)
        stats = gw.app.state.gateway.engine.failover_stats
    texts, error = events[:-1], events[-1]
    assert all("error" not in e for e in texts) and len(texts) == 1 + 3 + 3
    assert reference.startswith("".join(c["choices"][0]["text"] for c in texts))
    assert error["error"]["code"] == 503 and error["error"]["type"] == "ServiceUnavailableError"
    assert "retried 1 times" in error["error"]["message"]
    assert (stats.decode_failovers, stats.exhausted) == (1, 1)


async def test_request_errors_are_not_retried(model_path, cluster2):
    async with running_gateway(model_path, cluster2) as gw:
        cluster2.decodes[0].rec.fail_with = grpc.StatusCode.INVALID_ARGUMENT
        assert_error_object(await gw.http.post(CHAT, json=_body(CHAT, max_tokens=4)), 400)
        assert len(cluster2.decodes[0].rec.requests) == 1
        assert not cluster2.decodes[1].rec.requests
        await _wait(lambda: cluster2.prefills[0].rec.aborted)  # its pin released


async def test_a_full_decode_makes_a_started_request_wait_not_fail(model_path, cluster2):
    """RESOURCE_EXHAUSTED from Generate after the prefill's first token: no 429 mid-stream;
    the request waits, is placed again (the other decode here), and the full instance is
    not marked failed."""
    body = _body(COMPLETIONS, max_tokens=12, ignore_eos=True)
    async with running_gateway(model_path, cluster2) as gw:
        reference = await stream(gw.http, COMPLETIONS, body)
        await cluster2.reset()
        d0, d1 = cluster2.decodes
        d0.rec.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
        got = await stream(gw.http, COMPLETIONS, body)
        engine = gw.app.state.gateway.engine
        stats = engine.failover_stats
        assert engine.health.is_usable(d0.address)
    assert not [c for c in got if "error" in c]
    assert _choices(got) == _choices(reference)
    assert len(d0.rec.requests) == 1 and len(d1.rec.requests) == 1
    assert (stats.overload_waits, stats.decode_failovers, stats.exhausted) == (1, 0, 0)


async def test_decodes_full_for_too_long_end_with_503(model_path, cluster2, monkeypatch):
    from pdserve.services.gateway import failover

    monkeypatch.setattr(failover, "OVERLOAD_MAX_WAIT_S", 1.0)
    async with running_gateway(model_path, cluster2) as gw:
        for d in cluster2.decodes:
            d.rec.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
        events = await stream(gw.http, COMPLETIONS, _body(COMPLETIONS, max_tokens=4))
        stats = gw.app.state.gateway.engine.failover_stats
    assert events[-1]["error"]["code"] == 503  # after the first token: an error event
    assert stats.overload_waits == 2 and stats.exhausted == 1  # waits 0.25 + 0.5 (+1 > 1 s)


async def test_failed_prefill_goes_to_another_prefill_then_to_local_prefill(model_path,
                                                                            cluster2):
    body = _body(CHAT, max_tokens=12)
    p0, p1 = cluster2.prefills
    async with running_gateway(model_path, cluster2) as gw:
        reference = (await gw.http.post(CHAT, json=body)).json()
        answer = reference["choices"][0]["message"]["content"]
        await cluster2.reset()
        p0.rec.fail_with = UNAVAILABLE
        other = (await gw.http.post(CHAT, json=body)).json()
        assert other["choices"] == reference["choices"]
        assert len(p1.rec.requests) == 1 and not p1.rec.cancelled
        await cluster2.reset()
        p0.rec.fail_with = p1.rec.fail_with = UNAVAILABLE
        local = (await gw.http.post(CHAT, json=body)).json()
        assert local["choices"][0]["message"]["content"] == answer
        assert local["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
        dec = cluster2.decodes[0].rec.requests[-1]
        assert not dec.HasField("kv_transfer_params") and not dec.output_token_ids
        assert dec.request_id.endswith("-retry2")
        stats = gw.app.state.gateway.engine.failover_stats
        assert (stats.prefill_retries, stats.decode_failovers, stats.exhausted) == (3, 0, 0)


async def test_lost_decode_servers_fail_over_then_503(model_path, fake_model):
    """Real transport loss: the serving decode's gRPC server stops mid-stream."""
    cluster = await start_fake_cluster(fake_model, num_prefill=1, num_decode=2)
    servers = dict(zip(cluster.prefill_urls + cluster.decode_urls, cluster.servers))
    body = _body(COMPLETIONS, max_tokens=30, ignore_eos=True)
    try:
        async with running_gateway(model_path, cluster) as gw:
            reference = await stream(gw.http, COMPLETIONS, body)
            for d in cluster.decodes:
                d.rec.delay = 0.01

            async def stop_serving_decode_after(n: int, events: list) -> None:
                if len(events) == n:
                    serving = next(d for d in cluster.decodes if d.rec.active)
                    await servers[serving.address].stop(None)

            got = await _read_stream(gw.http, COMPLETIONS, body,
                                     lambda ev: stop_serving_decode_after(6, ev))
            assert got[-1] == "[DONE]" and not [e for e in got[:-1] if "error" in e]
            assert _choices(got[:-1]) == _choices(reference)
            events = await _read_stream(gw.http, COMPLETIONS, body,
                                        lambda ev: stop_serving_decode_after(4, ev))
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
            assert not [e for e in events[:-2] if "error" in e]
            assert_error_object(await gw.http.post(COMPLETIONS, json=body), 503)
            assert (await gw.http.get("/health")).status_code == 503
            stats = gw.app.state.gateway.engine.failover_stats
            assert (stats.decode_failovers, stats.exhausted) == (1, 1)
    finally:
        await cluster.stop()


async def test_placement_skips_instances_that_are_not_serving(model_path, cluster2):
    d0, d1 = cluster2.decodes
    async with running_gateway(model_path, cluster2, health_check_interval=0.05) as gw:
        health = gw.app.state.gateway.engine.health
        await gw.http.get("/health")  # starts the polling
        await cluster2.set_serving(d0.address, False)
        await _wait(lambda: health.status(d0.address) is InstanceStatus.NOT_SERVING)
        for _ in range(3):
            r = await gw.http.post(CHAT, json=_body(CHAT, max_tokens=3))
            assert r.status_code == 200
        assert (len(d0.rec.requests), len(d1.rec.requests)) == (0, 3)
        await cluster2.set_serving(d0.address, True)
        await _wait(lambda: health.status(d0.address) is InstanceStatus.SERVING)
        assert (await gw.http.post(CHAT, json=_body(CHAT, max_tokens=3))).status_code == 200
        assert len(d0.rec.requests) == 1  # idle again, first in the list
        await cluster2.set_serving(d0.address, False)
        await cluster2.set_serving(d1.address, False)
        await _wait(lambda: not health.is_usable(d1.address))
        assert_error_object(await gw.http.post(CHAT, json=_body(CHAT, max_tokens=3)), 503)


async def test_health_never_waits_on_a_hung_instance(model_path, cluster2):
    hung = socket.socket()  # accepts TCP (backlog), never speaks HTTP/2
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    hung_url = f"127.0.0.1:{hung.getsockname()[1]}"
    try:
        async with running_gateway(model_path, cluster2, rpc_timeout=1.0,
                                   decode_urls=(cluster2.decode_urls[0], hung_url)) as gw:
            started = time.monotonic()
            assert (await gw.http.get("/health")).status_code == 200
            assert time.monotonic() - started < 1.0
        async with running_gateway(model_path, cluster2, rpc_timeout=1.0,
                                   decode_urls=(hung_url,)) as gw:
            started = time.monotonic()
            assert (await gw.http.get("/health")).status_code == 503
            assert time.monotonic() - started < 1.0
    finally:
        hung.close()


class _ScriptedHealth:
    """A backend whose health answers are futures the test resolves."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future] = []

    async def health_status(self, address: str, timeout: float | None = None) -> int | None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        return await fut


async def test_tracker_ignores_serving_answers_that_predate_a_failure():
    backend = _ScriptedHealth()

    async def instances() -> list[str]:
        return ["a:1"]

    tracker = HealthTracker(backend, instances, interval=60.0)  # type: ignore[arg-type]
    try:
        assert tracker.is_usable("a:1") and tracker.status("a:1") is InstanceStatus.UNKNOWN
        tracker.ensure_started()
        await _wait(lambda: len(backend.pending) == 1)  # the poll's check is in flight
        tracker.mark_failed("a:1")
        assert tracker.status("a:1") is InstanceStatus.UNREACHABLE
        await _wait(lambda: len(backend.pending) == 2)  # a fresh check after the failure
        backend.pending[0].set_result(health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.01)
        assert not tracker.is_usable("a:1")  # the old answer does not count
        backend.pending[1].set_result(health_pb2.HealthCheckResponse.SERVING)
        await _wait(lambda: tracker.status("a:1") is InstanceStatus.SERVING)
        tracker.mark_failed("a:1")
        await _wait(lambda: len(backend.pending) == 3)
        backend.pending[2].set_result(health_pb2.HealthCheckResponse.NOT_SERVING)
        await _wait(lambda: tracker.status("a:1") is InstanceStatus.NOT_SERVING)
    finally:
        await tracker.close()
