"""vLLM's speculative-decoding counters as `pdserve_spec_decode_*`, read from the engine's
`SpecDecodingStats` at scrape time (registered only when speculation is configured)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.shared.engine.spec_decode.verification import SpecDecodingStats


class SpecDecodeCollector(Collector):
    """Counters (vLLM v1's names and meanings, pdserve_ prefix):

    - pdserve_spec_decode_num_drafts_total: scored draft sequences (one per request-step)
    - pdserve_spec_decode_num_draft_tokens_total: draft tokens scored
    - pdserve_spec_decode_num_accepted_tokens_total: draft tokens accepted
    - pdserve_spec_decode_num_accepted_tokens_per_pos_total{position}: accepted at draft
      position j (0-based); position j / num_drafts is the acceptance rate per position.

    NOTE: the engine thread increments the counters; a scrape reads them from the HTTP
    thread without a lock (plain ints: a scrape may be one step behind, never torn).
    """

    def __init__(self, stats: SpecDecodingStats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        s, labels = self.stats, [self.model_name]
        for name, doc, value in (
                ("num_drafts", "Draft sequences scored (one per request and step).",
                 s.num_drafts),
                ("num_draft_tokens", "Draft tokens scored.", s.num_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)):
            family = CounterMetricFamily(f"pdserve_spec_decode_{name}", doc,
                                         labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        family = CounterMetricFamily("pdserve_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position (0-based).",
                                     labels=["model_name", "position"])
        for position, value in enumerate(list(s.num_accepted_tokens_per_pos)):
            family.add_metric(labels + [str(position)], value)
        yield family
