"""What the gateway's failover decides with: which engine statuses are worth another
instance, the failure of one placement, the counters, and when a retry is pointless.

See services/gateway/serving.py (ServingEngine.generate) for the flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from prometheus_client.core import CounterMetricFamily

from shared.proto import engine_pb2

_CODE = grpc.StatusCode
INSTANCE_FAILED = frozenset({_CODE.UNAVAILABLE, _CODE.CANCELLED, _CODE.INTERNAL,
                             _CODE.UNKNOWN})
"""Statuses that say the instance itself is unwell (gone, crashed, broke the stream): it is
marked failed and skipped until a health check says SERVING again. A CANCELLED we caused
never shows up as a status: our own cancel raises asyncio.CancelledError."""
TRANSFER_FAILED = frozenset({_CODE.ABORTED, _CODE.DATA_LOSS, _CODE.NOT_FOUND})
"""Generate statuses of a failed KV transfer (pin expired or released, a bad chunk): worth
another placement, but no verdict on any instance's health."""
RETRIABLE_PREFILL = INSTANCE_FAILED
"""Prefill statuses worth another placement. ABORTED is not one: it means the request was
aborted (an Abort call), and retrying would defeat the abort."""
RETRIABLE_GENERATE = INSTANCE_FAILED | TRANSFER_FAILED
"""Generate statuses worth another placement."""
OVERLOAD_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)
"""Waits before placing again a started stream whose decode instance was full (then 2 s)."""
OVERLOAD_MAX_WAIT_S = 60.0
"""How long a started stream keeps waiting for room on a decode instance before a 503."""


def is_overloaded(error: grpc.aio.AioRpcError) -> bool:
    """A decode instance's admission queue is full (not a message over the size limit)."""
    return error.code() == _CODE.RESOURCE_EXHAUSTED and \
        "larger than max" not in (error.details() or "")


@dataclass(slots=True, eq=False)  # hashable: registered as a Prometheus collector
class FailoverStats:
    """Counters since start (for tests and docs/reliability.md)."""

    decode_failovers: int = 0
    """Broken decode streams continued on another placement."""
    prefill_retries: int = 0
    """Other failed attempts (a Prefill, a decode stream before its first token) placed again."""
    exhausted: int = 0
    """Engine requests given up: retry budget spent or no decode instance left."""
    overload_waits: int = 0
    """Started streams whose decode instance was full, placed again after a wait."""

    def collect(self):
        """prometheus_client custom-collector hook: `pdserve_gateway_failovers_total{kind}`."""
        family = CounterMetricFamily(
            "pdserve_gateway_failovers", "Engine requests placed again after a failure "
            "(decode: a broken stream continued; prefill: another attempt; exhausted: given "
            "up).", labels=["kind"])
        family.add_metric(["decode"], self.decode_failovers)
        family.add_metric(["prefill"], self.prefill_retries)
        family.add_metric(["exhausted"], self.exhausted)
        family.add_metric(["overload_wait"], self.overload_waits)
        yield family

    def count_retry(self, failure: AttemptFailed, num_output_tokens: int) -> None:
        if failure.role == "decode" and num_output_tokens:
            self.decode_failovers += 1
        else:
            self.prefill_retries += 1


class AttemptFailed(Exception):
    """One placement of an engine request failed in a way another placement may not."""

    def __init__(self, address: str, role: str, error: grpc.aio.AioRpcError | str,
                 overloaded: bool = False) -> None:
        self.instance_failed = not overloaded and (not isinstance(error, grpc.aio.AioRpcError)
                                                   or error.code() in INSTANCE_FAILED)
        """Mark `address` failed in the health tracker (False: only this request failed)."""
        self.overloaded = overloaded
        """The instance was full: wait, then place again (outside the retry budget)."""
        if isinstance(error, grpc.aio.AioRpcError):
            error = f"{error.code().name}: {error.details()}"
        super().__init__(f"{role} {address}: {error}")
        self.address = address
        self.role = role


def at_length_limit(params: engine_pb2.SamplingParams, max_model_len: int,
                    num_prompt_tokens: int, num_output_tokens: int) -> bool:
    """Would the engine refuse to go on (max_tokens or max_model_len already reached)?
    max_tokens counts every output token (proto: 0 means up to max_model_len)."""
    return (bool(params.max_tokens) and num_output_tokens >= params.max_tokens) or \
        num_prompt_tokens + num_output_tokens >= max_model_len
