"""The gateway's /metrics: its own families, every engine's, and (optionally) vLLM's names.

    GET /metrics ─▶ the gateway's registry
                 ├▶ each live instance in the registry (Redis) that published a metrics
                 │  address: GET http://<metrics_address>/metrics, concurrently, bounded by
                 │  SCRAPE_TIMEOUT; every sample gets `instance` and `role` labels
                 └▶ --metrics-compat vllm: the `vllm:` families of VLLM_NAMES, copied from
                    those above (model_name added where the source lacks it)

One scrape target shows the whole cluster. NOTE: Prometheus sets its own `instance` label
on every target; scrape the gateway with `honor_labels: true` to keep the engines' (else
they arrive as `exported_instance`). An engine that does not answer in time is left out of
that scrape (its families are missing; `pdserve_gateway_federation_errors_total` counts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 2.0
"""Seconds one engine's /metrics may take before this scrape goes on without it."""

VLLM_NAMES: dict[str, str] = {
    # engine-level (one series per instance, labelled instance and role)
    "vllm:num_requests_running": "pdserve_num_requests_running",
    "vllm:num_requests_waiting": "pdserve_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "pdserve_kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "pdserve_kv_cache_usage_perc",
    "vllm:prefix_cache_queries": "pdserve_prefix_cache_queries",
    "vllm:prefix_cache_hits": "pdserve_prefix_cache_hits",
    "vllm:num_preemptions": "pdserve_num_preemptions",
    "vllm:lora_requests_info": "pdserve_lora_requests_info",
    "vllm:inter_token_latency_seconds": "pdserve_inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "pdserve_inter_token_latency_seconds",
    "vllm:spec_decode_num_drafts": "pdserve_spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens": "pdserve_spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "pdserve_spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos":
        "pdserve_spec_decode_num_accepted_tokens_per_pos",
    # request-level, as clients see them (the gateway's: no double count across the split)
    "vllm:e2e_request_latency_seconds": "pdserve_gateway_e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds": "pdserve_gateway_time_to_first_token_seconds",
    "vllm:prompt_tokens": "pdserve_gateway_prompt_tokens",
    "vllm:generation_tokens": "pdserve_gateway_generation_tokens",
    "vllm:request_success": "pdserve_gateway_request_success",
    "vllm:request_prompt_tokens": "pdserve_gateway_request_prompt_tokens",
    "vllm:request_generation_tokens": "pdserve_gateway_request_generation_tokens",
    "vllm:request_max_num_generation_tokens":
        "pdserve_gateway_request_max_num_generation_tokens",
    "vllm:request_params_n": "pdserve_gateway_request_params_n",
    "vllm:request_params_max_tokens": "pdserve_gateway_request_params_max_tokens",
    "vllm:request_queue_time_seconds": "pdserve_gateway_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "pdserve_gateway_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "pdserve_gateway_request_decode_time_seconds",
    "vllm:request_inference_time_seconds": "pdserve_gateway_request_inference_time_seconds",
}
"""vLLM family name -> the pdserve family it copies (README "Metrics", vLLM's names)."""


def parse_families(text: str, extra_labels: dict[str, str] | None = None) -> list[Metric]:
    """Prometheus text -> families, `extra_labels` added to every sample."""
    families = list(text_string_to_metric_families(text))
    if extra_labels:
        for family in families:
            family.samples = [s._replace(labels={**s.labels, **extra_labels})
                              for s in family.samples]
    return families


def merge(families: Iterable[Metric]) -> dict[str, Metric]:
    """One family per name (the text format allows each name once), samples concatenated."""
    out: dict[str, Metric] = {}
    for family in families:
        if family.name in out:
            out[family.name].samples.extend(family.samples)
        else:
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = list(family.samples)
            out[family.name] = copy
    return out


def vllm_families(families: dict[str, Metric], model_name: str) -> list[Metric]:
    """The `vllm:` copies of VLLM_NAMES whose source family is present."""
    out = []
    for vllm_name, source in VLLM_NAMES.items():
        family = families.get(source)
        if family is None:
            continue
        copy = Metric(vllm_name, family.documentation + f" (pdserve: {source})", family.type)
        copy.samples = [s._replace(name=vllm_name + s.name[len(source):],
                                   labels={"model_name": model_name, **s.labels})
                        for s in family.samples]
        out.append(copy)
    return out


def render_families(families: dict[str, Metric], compat: str | None,
                    model_name: str) -> bytes:
    """The text of merged `families`, with the vllm: copies under --metrics-compat vllm."""
    out = list(families.values())
    if compat == "vllm":
        out += vllm_families(families, model_name)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(out))
    return generate_latest(registry)


class _Families:
    """A collector over prepared families (generate_latest formats them)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


class MetricsFederation:
    """Renders /metrics (module docstring).

    Args:
        own: the gateway's registry.
        registry: the instance registry (PrefixIndex); None: the gateway's families only.
        compat: "vllm" adds vLLM's names; None does not.
        model_name: the served model name (model_name label of the vllm: copies).
    """

    def __init__(self, own: CollectorRegistry, registry, compat: str | None,
                 model_name: str) -> None:
        self.own = own
        self.registry = registry
        self.compat = compat
        self.model_name = model_name
        self._errors = Counter("pdserve_gateway_federation_errors",
                               "Engine /metrics scrapes that failed or timed out.",
                               ["instance"], registry=own)
        self._http: httpx.AsyncClient | None = None

    async def _instances(self) -> list:
        if self.registry is None:
            return []
        try:
            live = await self.registry.live_instances()
        except Exception as e:  # the registry is optional
            logger.debug("federation: registry unavailable (%s)", e)
            return []
        return [i for i in live if getattr(i, "metrics_address", "")]

    async def _scrape(self, info) -> list[Metric]:
        if self._http is None:
            # NOTE: httpx logs every request at INFO: one line per engine per Prometheus
            # scrape in the gateway's log. Those lines are kept for --log-level DEBUG only.
            if not logger.isEnabledFor(logging.DEBUG):
                logging.getLogger("httpx").setLevel(logging.WARNING)
            # NOTE: trust_env=False: internal addresses never go through an HTTP(S)_PROXY.
            self._http = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT, trust_env=False)
        try:
            r = await self._http.get(f"http://{info.metrics_address}/metrics")
            r.raise_for_status()
            return parse_families(r.text, {"instance": info.instance_id, "role": info.role})
        except (httpx.HTTPError, ValueError) as e:
            logger.debug("federation: %s %s: %s", info.instance_id, info.metrics_address, e)
            self._errors.labels(info.instance_id).inc()
            return []

    async def families(self, own_labels: dict[str, str] | None = None) -> list[Metric]:
        """The gateway's families (`own_labels` added to them), then every engine's."""
        instances = await self._instances()
        scraped = await asyncio.gather(*(self._scrape(i) for i in instances))
        return [*parse_families(generate_latest(self.own).decode(), own_labels),
                *(f for fams in scraped for f in fams)]

    async def render(self) -> bytes:
        return render_families(merge(await self.families()), self.compat, self.model_name)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
