"""AdmissionQueue on its own: the counters, 429 + Retry-After, and what never fits."""

from __future__ import annotations

import pytest

from pdserve.services.gateway.admission import AdmissionQueue, QueueFullError
from pdserve.services.gateway.errors import GatewayError


def test_admission_counts_waiting_running_and_tokens():
    q = AdmissionQueue(max_num_queued_requests=3, max_queued_tokens=100)
    g = q.admit([10, 20])
    assert (q.num_waiting, q.num_running, q.queued_tokens) == (2, 0, 30)
    g.start(0)
    g.start(0)  # idempotent
    assert (q.num_waiting, q.num_running, q.queued_tokens) == (1, 1, 20)
    with pytest.raises(QueueFullError) as e:
        q.admit([5, 5, 5])  # 1 + 3 waiting > 3
    assert e.value.status_code == 429 and e.value.headers == {"Retry-After": "1"}
    with pytest.raises(QueueFullError):
        q.admit([90])  # 20 + 90 tokens > 100
    g2 = q.admit([5, 5])
    assert q.num_waiting == 3 and q.peak_waiting == 3
    g.finish(0)
    g.finish(1)  # never started: leaves the queue
    g.finish(1)
    g2.release()
    g2.release()
    assert (q.num_waiting, q.num_running, q.queued_tokens) == (0, 0, 0)
    assert q.num_rejected == 2


def test_admission_refuses_what_never_fits_with_400():
    q = AdmissionQueue(max_num_queued_requests=4, max_queued_tokens=50)
    for tokens, param in (([1] * 5, "n"), ([51], "max_tokens")):
        with pytest.raises(GatewayError) as e:
            q.admit(tokens)
        assert e.value.status_code == 400 and e.value.param == param
    unbounded = AdmissionQueue()
    unbounded.admit([10**6] * 1000)
    assert unbounded.num_waiting == 1000


def test_retry_after_follows_the_first_token_wait():
    q = AdmissionQueue(max_num_queued_requests=1)
    q.mean_wait = 2.3
    q.admit([1])
    with pytest.raises(QueueFullError) as e:
        q.admit([1])
    assert e.value.retry_after == 3 and e.value.headers["Retry-After"] == "3"
    q.mean_wait = 1e6
    assert q.retry_after == 60
