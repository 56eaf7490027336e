"""The gateway's /metrics federation, without engines: two real ServiceMetrics registries on
real Prometheus endpoints, registered in a real Redis; one unreachable instance. Each family
comes out once (one TYPE line), samples labelled instance and role; the vllm: copies carry
model_name; a dead endpoint only drops its own samples."""

from __future__ import annotations

import shutil

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.common.metrics import EngineStats, ServiceMetrics
from pdserve.services.common.prefix_index import InstanceInfo, PrefixIndex
from pdserve.services.gateway.federation import MetricsFederation
from pdserve.services.gateway.metrics import GatewayMetrics
from tests.services.helpers import RedisServer, free_port

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
MODEL = "m"


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    server.start()
    yield server.url
    server.stop()


def _engine(running: int):
    metrics = ServiceMetrics(MODEL, CollectorRegistry())
    metrics.update_engine(EngineStats(running, 0, 0.25, 0, 10, 4, 100, 90, 5, 10), 0)
    metrics.inter_token(0.03)
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    return httpd


async def test_federation_labels_merges_and_survives_a_dead_endpoint(redis_url):
    servers = [_engine(1), _engine(3)]
    index = PrefixIndex(redis_url, MODEL)
    try:
        infos = [InstanceInfo(f"{role}-x", role, f"127.0.0.1:{free_port()}", MODEL,
                              metrics_address=f"127.0.0.1:{s.server_port}")
                 for role, s in zip(("prefill", "decode"), servers)]
        infos.append(InstanceInfo("decode-dead", "decode", "127.0.0.1:1", MODEL,
                                  metrics_address=f"127.0.0.1:{free_port()}"))
        for info in infos:
            await index.register(info)
        own = GatewayMetrics()
        own.e2e_request_latency.labels("/v1/chat/completions").observe(0.5)
        federation = MetricsFederation(own.registry, index, "vllm", MODEL)
        text = (await federation.render()).decode()
        await federation.close()
    finally:
        await index.close()
        for s in servers:
            s.shutdown()
    assert text.count("# TYPE pdserve_num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {(s.labels["instance"], s.labels["role"]): s.value
               for s in families["pdserve_num_requests_running"].samples}
    assert running == {("prefill-x", "prefill"): 1.0, ("decode-x", "decode"): 3.0}
    vllm_running = {s.labels["instance"]: s.value
                    for s in families["vllm:num_requests_running"].samples}
    assert vllm_running == {"prefill-x": 1.0, "decode-x": 3.0}
    e2e = [s for s in families["vllm:e2e_request_latency_seconds"].samples
           if s.name.endswith("_count")]
    assert [(s.labels["model_name"], s.value) for s in e2e] == [(MODEL, 1.0)]
    errors = {s.labels["instance"]: s.value
              for s in families["pdserve_gateway_federation_errors"].samples
              if s.name.endswith("_total")}
    assert errors == {"decode-dead": 1.0}


async def test_scrapes_do_not_log_a_line_per_engine_at_info(redis_url, caplog):
    """At INFO, a Prometheus scraping the gateway every few seconds must not put httpx's
    'HTTP Request: GET http://<engine>/metrics' line per engine per scrape in the log."""
    import logging

    httpx_logger = logging.getLogger("httpx")
    saved = httpx_logger.level
    server = _engine(1)
    index = PrefixIndex(redis_url, "quiet")
    caplog.set_level(logging.INFO)
    try:
        await index.register(InstanceInfo("decode-q", "decode", f"127.0.0.1:{free_port()}",
                                          "quiet",
                                          metrics_address=f"127.0.0.1:{server.server_port}"))
        federation = MetricsFederation(GatewayMetrics().registry, index, None, "quiet")
        text = (await federation.render()).decode()
        await federation.close()
    finally:
        await index.close()
        server.shutdown()
        httpx_logger.setLevel(saved)
    assert 'instance="decode-q"' in text
    assert [r.getMessage() for r in caplog.records if r.name.startswith("httpx")] == []
