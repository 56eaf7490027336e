"""The gateway's own Prometheus metrics (latencies as clients see them), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's bucket edges for TTFT and end-to-end latency (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
"""vLLM's 1-2-5 series for token counts (up to 500000)."""
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
        self.streams_cut_slow_client = Counter(
            "pdserve_gateway_streams_cut_slow_client",
            "Streams cut because their client fell --max-stream-backlog bytes behind, or stayed "
            "paused longer than --max-stream-pause-s.", registry=r)
        self.streams_paused = Counter(
            "pdserve_gateway_streams_paused",
            "Pauses of a stream's engine requests because its client fell --stream-pause-bytes "
            "behind (engine-side backpressure; a stream may be paused many times).",
            registry=r)
        self.prompt_tokens = Counter("pdserve_gateway_prompt_tokens",
                                     "Prompt tokens of served requests.", registry=r)
        self.generation_tokens = Counter("pdserve_gateway_generation_tokens",
                                         "Generated tokens of served requests.", registry=r)
        # Per request, as vLLM's request-level families (their `vllm:` copies: federation.py).
        self.request_success = Counter("pdserve_gateway_request_success",
                                       "Finished choices by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_prompt_tokens = Histogram(
            "pdserve_gateway_request_prompt_tokens", "Prompt tokens per prompt.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "pdserve_gateway_request_generation_tokens", "Generated tokens per choice.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_max_num_generation_tokens = Histogram(
            "pdserve_gateway_request_max_num_generation_tokens",
            "The most tokens one choice of a request generated.", buckets=_TOKEN_BUCKETS,
            registry=r)
        self.request_params_n = Histogram("pdserve_gateway_request_params_n",
                                          "The n of each request.",
                                          buckets=(1, 2, 5, 10, 20), registry=r)
        self.request_params_max_tokens = Histogram(
            "pdserve_gateway_request_params_max_tokens", "The max_tokens of each choice.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "pdserve_gateway_request_queue_time_seconds",
            "From arrival to the engine call (tokenization, validation, admission).",
            buckets=_E2E_BUCKETS, registry=r)
        self.request_prefill_time = Histogram(
            "pdserve_gateway_request_prefill_time_seconds",
            "From the engine call to the first token (engine queue, prefill, KV transfer).",
            buckets=_E2E_BUCKETS, registry=r)
        self.request_decode_time = Histogram(
            "pdserve_gateway_request_decode_time_seconds",
            "From the first token to the last.", buckets=_E2E_BUCKETS, registry=r)
        self.request_inference_time = Histogram(
            "pdserve_gateway_request_inference_time_seconds",
            "From the engine call to the last token.", buckets=_E2E_BUCKETS, registry=r)
