"""ControlCallStats: outcomes and latencies of the gateway's fire-and-forget control calls.

`Abort` runs in the background (ChannelPool.abort_soon): nobody waits for it, so a failed
one shows only here and in the log; so does a failed `SetPaused` (engine-side backpressure:
the stream stays unpaused, and is asked again). Exposed as
`pdserve_gateway_control_calls_total{method,code}` (code: OK or the gRPC status name) and
`pdserve_gateway_control_call_seconds{method}` (a histogram).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds); the issue's bound for Abort is 0.5 s."""


class ControlCallStats:
    """Counters since start; a prometheus_client custom collector (register it)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        """(method, code) -> calls; code "OK" or a grpc.StatusCode name."""
        self._counts: dict[str, list[int]] = {}
        """method -> calls per bucket (the last one: above every bound)."""
        self._sums: Counter[str] = Counter()

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.calls[method, code] += 1
        counts = self._counts.setdefault(method, [0] * (len(BUCKETS) + 1))
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._sums[method] += seconds

    def num_failed(self, method: str | None = None) -> int:
        return sum(n for (m, code), n in self.calls.items()
                   if code != "OK" and method in (None, m))

    def collect(self):
        calls = CounterMetricFamily(
            "pdserve_gateway_control_calls", "Abort and SetPaused calls to the "
            "engines by outcome (OK or the gRPC status).", labels=["method", "code"])
        for (method, code), n in sorted(self.calls.items()):
            calls.add_metric([method, code], n)
        yield calls
        seconds = HistogramMetricFamily(
            "pdserve_gateway_control_call_seconds", "Duration of one control call.",
            labels=["method"])
        for method, counts in sorted(self._counts.items()):
            buckets = list(zip((*map(str, BUCKETS), "+Inf"), itertools.accumulate(counts)))
            seconds.add_metric([method], buckets, self._sums[method])
        yield seconds
