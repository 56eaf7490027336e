"""ServiceMetrics: one prefill or decode instance's Prometheus metrics, vLLM's meanings.

Engine-side figures (running, waiting, KV usage, prefix cache, preemptions, block counts)
are polled from the engine thread every `publish_interval` by the InstanceMonitor; request
latencies and KV transfer counters are recorded where they happen. One registry per
instance, so several instances can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.services.common.tier_metrics import TierMetrics, TierView, tier_views
from pdserve.shared.engine.kv_offload import TierSnapshot

# vLLM's bucket edges (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0)


class EngineStats(NamedTuple):
    """A snapshot taken on the engine thread (counters cumulative since start-up)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_gpu_blocks: int
    num_free_blocks: int
    """In the free queue, cached or not."""
    num_cached_blocks: int
    """Holding a block hash (free or in use)."""
    num_used_blocks: int
    """ref_cnt > 0, null block excluded."""
    num_paused: int = 0
    """Requests paused by backpressure (SetPaused), in neither num_running nor num_waiting."""


class ServiceMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"pdserve_{name}", doc, labels + list(extra), registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pdserve_{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pdserve_{name}", doc, labels, buckets=buckets, registry=r)

        self._running = gauge("num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("num_requests_waiting",
                              "Requests waiting: the engine's queue plus KV admissions.")
        self._paused = gauge("num_requests_paused", "Requests paused by backpressure: their "
                             "client reads too slowly (SetPaused; not scheduled, KV kept "
                             "until the pool needs it).")
        self._kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use, 0-1.")
        self._kv_blocks = gauge("kv_blocks", "KV blocks by state: free (in the free queue), "
                                "cached (hashed), used (ref_cnt > 0), pinned (held for a "
                                "transfer).", ("state",))
        self._prefix_queries = counter("prefix_cache_queries",
                                       "Tokens looked up in the prefix cache.")
        self._prefix_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self._preemptions = counter("num_preemptions", "Preemptions (by recompute).")
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled here.")
        self._generation_tokens = counter("generation_tokens", "Tokens generated here.")
        self._after_abort = counter(
            "prompt_tokens_after_abort", "Prompt tokens computed by steps that ended after "
            "their request's abort had arrived (work for nobody: at most the chunk of the step "
            "in flight when the abort came).")
        self._ttft_unreachable = counter(
            "slo_ttft_unreachable", "New prompts predicted at arrival to miss the TTFT target "
            "(--slo-ttft-ms), by what happened to them: served anyway, or rejected "
            "(--slo-early-reject).", ("action",))
        self._request_success = counter("request_success", "Finished requests by reason.",
                                        ("finished_reason",))
        self._ttft = histogram("time_to_first_token_seconds",
                               "From request arrival to its first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds",
                              "Between consecutive tokens of a request.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds",
                              "From request arrival to its last token.", _E2E_BUCKETS)
        self._blocks_sent = counter("kv_transfer_blocks_sent", "KV blocks sent by FetchKV.")
        self._bytes_sent = counter("kv_transfer_bytes_sent", "KV payload bytes sent.")
        self._blocks_received = counter("kv_transfer_blocks_received",
                                        "KV blocks received and written into the cache.")
        self._bytes_received = counter("kv_transfer_bytes_received",
                                       "KV payload bytes received.")
        self._redis_up = gauge("redis_up", "1 while the Redis prefix index is reachable, 0 "
                               "while serving without it (absent without --redis-url).")
        self._index_dropped = counter(
            "prefix_index_writes_dropped", "Block-hash changes not written to the Redis prefix "
            "index (Redis slow or unreachable); the whole hash map is republished instead once "
            "Redis answers.")
        self._transfer_seconds = histogram("kv_transfer_seconds", "Duration of one KV transfer.",
                                           _TRANSFER_BUCKETS)
        self._lora_info = gauge(
            "lora_requests_info", "vLLM's lora_requests_info: the LoRA adapters of the running "
            "and waiting requests (comma-separated names) and max_lora, as labels; the value "
            "is when they were read (unix seconds). Absent without --enable-lora.",
            ("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
        self._memory = gauge(
            "engine_memory_bytes", "Bytes the engine holds by kind, set at start-up: weights "
            "(as loaded), packed_weights (panels or oneDNN copies held privately), "
            "int8_weights, mapped_weights (mapped from the host's weight cache: one copy for "
            "every engine of the host), kv_cache (the KV pool), draft_weights; on the "
            "engine's device.", ("kind",))
        self._model = model_name
        self._tiers: TierMetrics | None = None
        self._seen: dict[tuple, float] = {}
        """(counter, label values) -> the engine's cumulative total it was raised to."""
        # Every series without extra labels exists from the start, at 0 (a dashboard's
        # rate() then has a baseline; a family seen only after its first event reads "no
        # data" until then). pdserve_redis_up stays absent without --redis-url.
        for metric in (self._running, self._waiting, self._paused, self._kv_usage,
                       self._prefix_queries, self._prefix_hits, self._preemptions,
                       self._prompt_tokens, self._generation_tokens, self._after_abort,
                       self._ttft, self._itl,
                       self._e2e, self._blocks_sent, self._bytes_sent, self._blocks_received,
                       self._bytes_received, self._transfer_seconds, self._index_dropped):
            self._l(metric)

    def _l(self, metric, **extra):
        return metric.labels(model_name=self._model, **extra)

    def _inc_to(self, metric: Counter, total: float, **extra: str) -> None:
        """Raise `metric` to an engine's cumulative `total` (counted since start-up)."""
        key = (metric, *extra.values())
        seen = self._seen.get(key, 0)
        if total > seen:
            self._l(metric, **extra).inc(total - seen)
            self._seen[key] = total

    def set_memory(self, memory: dict[str, int]) -> None:
        """The engine's `memory_bytes()`, once at start-up."""
        for kind, n in memory.items():
            self._l(self._memory, kind=kind).set(n)

    def update_engine(self, s: EngineStats, num_pinned_blocks: int) -> None:
        self._l(self._running).set(s.num_running)
        self._l(self._paused).set(s.num_paused)
        self._l(self._waiting).set(s.num_waiting)
        self._l(self._kv_usage).set(s.kv_cache_usage)
        for state, value in (("free", s.num_free_blocks), ("cached", s.num_cached_blocks),
                             ("used", s.num_used_blocks), ("pinned", num_pinned_blocks)):
            self._l(self._kv_blocks, state=state).set(value)
        self._inc_to(self._prefix_queries, s.prefix_cache_queries)
        self._inc_to(self._prefix_hits, s.prefix_cache_hits)
        self._inc_to(self._preemptions, s.num_preemptions)

    def kv_tiers(self, snapshot: TierSnapshot) -> None:
        """The KV tiers' series (services/common/tier_metrics.py), made at the first
        snapshot or peer event: absent without a disk tier or a peer fetch."""
        self.tier_metrics().update(snapshot)

    def tier_metrics(self) -> TierMetrics:
        """The `pdserve_kv_tier_*` series (made at the first use)."""
        if self._tiers is None:
            self._tiers = TierMetrics(self._model, self.registry)
        return self._tiers

    def kv_tier_views(self) -> list[TierView]:
        """Each tier's `pdserve_kv_tier_*` values now, as /metrics shows them; [] without a
        disk tier (no snapshot yet)."""
        if self._tiers is None:
            return []
        return tier_views(self.value, self.histogram("kv_tier_load_seconds"))

    def prompt_tokens_after_abort(self, total: int) -> None:
        """The engine's cumulative count (EngineCore.num_prompt_tokens_after_abort)."""
        self._inc_to(self._after_abort, total)

    def slo_ttft_unreachable(self, total: int, rejected: int) -> None:
        """The engine's cumulative counts (EngineCore.num_ttft_unreachable, of which
        num_ttft_rejected were refused)."""
        self._inc_to(self._ttft_unreachable, total - rejected, action="served")
        self._inc_to(self._ttft_unreachable, rejected, action="rejected")

    def lora_info(self, running: Iterable[str], waiting: Iterable[str], max_loras: int) -> None:
        """One series (the previous one dropped), as vLLM's gauge: the adapters' names."""
        self._lora_info.clear()
        self._l(self._lora_info, running_lora_adapters=",".join(sorted(running)),
                waiting_lora_adapters=",".join(sorted(waiting)),
                max_lora=str(max_loras)).set_to_current_time()

    def redis_up(self, up: bool) -> None:
        self._l(self._redis_up).set(1 if up else 0)

    def index_writes_dropped(self, num_hashes: int) -> None:
        self._l(self._index_dropped).inc(num_hashes)

    def request_finished(self, reason: str, num_prompt_tokens: int, num_generated: int,
                         e2e_seconds: float) -> None:
        self._l(self._request_success, finished_reason=reason).inc()
        if num_prompt_tokens:
            self._l(self._prompt_tokens).inc(num_prompt_tokens)
        if num_generated:
            self._l(self._generation_tokens).inc(num_generated)
        self._l(self._e2e).observe(e2e_seconds)

    def first_token(self, seconds: float) -> None:
        self._l(self._ttft).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._l(self._itl).observe(seconds)

    def kv_sent(self, num_blocks: int, num_bytes: int) -> None:
        self._l(self._blocks_sent).inc(num_blocks)
        self._l(self._bytes_sent).inc(num_bytes)

    def kv_received(self, num_blocks: int, num_bytes: int) -> None:
        self._l(self._blocks_received).inc(num_blocks)
        self._l(self._bytes_received).inc(num_bytes)

    def kv_transfer(self, seconds: float) -> None:
        self._l(self._transfer_seconds).observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 if absent), e.g. value("kv_transfer_blocks_received_total")."""
        v = self.registry.get_sample_value(f"pdserve_{name}",
                                           {"model_name": self._model, **labels})
        return v or 0.0

    def histogram(self, name: str):
        """A histogram's cumulative buckets now, as a state_feed.HistogramView (None if
        absent), e.g. histogram("time_to_first_token_seconds")."""
        from pdserve.services.common.state_feed import HistogramView

        family = f"pdserve_{name}"
        for metric in self.registry.collect():
            if metric.name != family:
                continue
            bounds, counts, total = [], [], 0.0
            for sample in metric.samples:
                if sample.labels.get("model_name") != self._model:
                    continue
                if sample.name.endswith("_bucket"):
                    bounds.append(float(sample.labels["le"]))
                    counts.append(int(sample.value))
                elif sample.name.endswith("_sum"):
                    total = sample.value
            return HistogramView(bounds, counts, total)
        return None

    def render(self) -> bytes:
        return generate_latest(self.registry)
