"""The KV tiers' Prometheus metrics (`pdserve_kv_tier_*`), per tier: "memory" (the pool's
cached blocks) and "disk" (`--kv-offload-dir`, shared/engine/kv_offload.py).

    pdserve_kv_tier_blocks{tier}            blocks held now
    pdserve_kv_tier_bytes{tier}             their bytes
    pdserve_kv_tier_queries_total{tier}     blocks looked up at admission (disk: those past
                                            the pool's hits)
    pdserve_kv_tier_hits_total{tier}        of those, found          (hit rate = hits / queries)
    pdserve_kv_tier_stores_total{tier}      blocks written to the tier (disk)
    pdserve_kv_tier_loads_total{tier}       blocks read back from it (disk)
    pdserve_kv_tier_failures_total{tier, op}  writes dropped (full disk, no directory, writer
                                            behind) and reads found bad (corrupt, truncated,
                                            missing): each recomputed, never served
    pdserve_kv_tier_evictions_total{tier}   blocks dropped to stay within --kv-offload-size
    pdserve_kv_tier_load_seconds            one load (a request's run of disk blocks)

The peer tier (another instance's blocks, fetched over FetchKV: docs/kv-tiers.md) counts as
tier "peer": queries (blocks asked of a peer), hits and loads (blocks fetched),
failures{op="pin"|"fetch"} (each recomputed here), and `pdserve_kv_tier_served_total`
(blocks this instance held for a peer's fetch).

The dashboard's state feed reads them back (`tier_views`): each frame's tiers are these
series' values at that moment, so the page and /metrics never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.shared.engine.kv_offload import TierSnapshot

if TYPE_CHECKING:
    from pdserve.services.common.state_feed import HistogramView

TIERS = ("memory", "disk")

_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class TierView(NamedTuple):
    """One tier's series now (the proto TierView); stores / loads / failures / evictions
    and the load histogram are the disk tier's only (0 and None for "memory"). The "peer"
    row: queries, hits and loads of fetches from peers, stores = blocks held for peers,
    failures = pins and fetches that failed (recomputed), no blocks or bytes of its own."""

    tier: str
    blocks: int
    bytes: int
    queries: int
    hits: int
    stores: int
    loads: int
    failures: int
    evictions: int
    load_seconds: HistogramView | None


def tier_views(value: Callable[..., float],
               load_seconds: HistogramView | None) -> list[TierView]:
    """Each tier's values, read through `value(name, **labels)` (ServiceMetrics.value);
    `load_seconds` is the pdserve_kv_tier_load_seconds histogram (the disk tier's)."""
    def total(name: str, tier: str, **labels: str) -> int:
        return int(value(f"kv_tier_{name}_total", tier=tier, **labels))

    views = [TierView(tier, int(value("kv_tier_blocks", tier=tier)),
                      int(value("kv_tier_bytes", tier=tier)), total("queries", tier),
                      total("hits", tier), total("stores", tier), total("loads", tier),
                      total("failures", tier, op="store") + total("failures", tier, op="load"),
                      total("evictions", tier), load_seconds if tier == "disk" else None)
             for tier in TIERS]
    # The peer tier, once this instance fetched from a peer or served one: blocks asked,
    # fetched, failed fetches; `stores` counts the blocks it held for peers (served).
    peer = [total(name, "peer") for name in ("queries", "hits", "loads", "served")]
    if any(peer):
        views.append(TierView("peer", 0, 0, peer[0], peer[1], peer[3], peer[2],
                              total("failures", "peer", op="pin")
                              + total("failures", "peer", op="fetch"), 0, None))
    return views


class TierMetrics:
    """Raises the `pdserve_kv_tier_*` series to an engine's snapshots (`update`)."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name", "tier"]
        self._model = model_name
        self._blocks = Gauge("pdserve_kv_tier_blocks", "KV blocks held, by tier.", labels,
                             registry=registry)
        self._bytes = Gauge("pdserve_kv_tier_bytes", "Bytes of the KV blocks held, by tier.",
                            labels, registry=registry)
        self._counters = {name: Counter(f"pdserve_kv_tier_{name}", doc, labels,
                                        registry=registry)
                          for name, doc in (
                              ("queries", "Blocks looked up in the tier at admission."),
                              ("hits", "Blocks found in the tier at admission."),
                              ("stores", "Blocks written to the tier."),
                              ("loads", "Blocks read back from the tier."),
                              ("evictions", "Blocks the tier dropped to stay in its size."))}
        self._failures = Counter("pdserve_kv_tier_failures", "Tier writes dropped and reads "
                                 "found bad (recomputed, never served), by operation.",
                                 [*labels, "op"], registry=registry)
        self._load_seconds = Histogram("pdserve_kv_tier_load_seconds", "Duration of one load "
                                       "from the disk tier (a request's run of blocks).",
                                       ["model_name"], buckets=_LOAD_BUCKETS,
                                       registry=registry)
        self._served = Counter("pdserve_kv_tier_served", "Blocks held for a peer's fetch "
                               "(PinKV).", labels, registry=registry)
        self._seen: dict[tuple[str, ...], int] = {}

    def peer_served(self, num_blocks: int) -> None:
        """This instance held `num_blocks` blocks for a peer (PinKV)."""
        self._served.labels(self._model, "peer").inc(num_blocks)

    def peer_fetched(self, num_queried: int, num_fetched: int,
                     failed_op: str | None = None) -> None:
        """A fetch from a peer asked `num_queried` blocks and wrote `num_fetched`;
        `failed_op` ("pin" | "fetch"): it failed there (the request recomputes)."""
        self._counters["queries"].labels(self._model, "peer").inc(num_queried)
        if num_fetched:
            self._counters["hits"].labels(self._model, "peer").inc(num_fetched)
            self._counters["loads"].labels(self._model, "peer").inc(num_fetched)
        if failed_op is not None:
            self._failures.labels(self._model, "peer", failed_op).inc()

    def _inc_to(self, counter: Counter, total: int, *labels: str) -> None:
        key = (counter._name, *labels)
        if total > (seen := self._seen.get(key, 0)):
            counter.labels(self._model, *labels).inc(total - seen)
            self._seen[key] = total

    def update(self, s: TierSnapshot) -> None:
        for tier in TIERS:
            self._blocks.labels(self._model, tier).set(s.blocks[tier])
            self._bytes.labels(self._model, tier).set(s.bytes[tier])
            self._inc_to(self._counters["queries"], s.queries[tier], tier)
            self._inc_to(self._counters["hits"], s.hits[tier], tier)
        for name, total in (("stores", s.stores), ("loads", s.loads),
                            ("evictions", s.evictions)):
            self._inc_to(self._counters[name], total, "disk")
        self._inc_to(self._failures, s.store_failures + s.writes_dropped, "disk", "store")
        self._inc_to(self._failures, s.load_failures, "disk", "load")
        for seconds in s.load_seconds:
            self._load_seconds.labels(self._model).observe(seconds)
