"""The gateway's own Prometheus metrics (latencies as clients see them), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket edges for TTFT and end-to-end latency (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_gateway_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.requests_running = Gauge("pdserve_gateway_num_requests_running",
                                      "HTTP requests being served.", registry=r)
        self.time_to_first_token = Histogram(
            "pdserve_gateway_time_to_first_token_seconds",
            "From request arrival to the first generated token leaving the gateway.",
            ["route"], buckets=_TTFT_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "pdserve_gateway_e2e_request_latency_seconds",
            "From request arrival to the last byte of the response (generation routes).",
            ["route"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_gateway_prompt_tokens",
                                     "Prompt tokens of served requests.", registry=r)
        self.generation_tokens = Counter("pdserve_gateway_generation_tokens",
                                         "Generated tokens of served requests.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
