"""Soak (issue 6 acceptance): 1,000 requests through the real gateway to real prefill and
decode services, with client disconnects, operator aborts and invalid bodies mixed in;
afterwards no pool holds a block, the invariants hold and Redis matches the caches.

Faults (drawn per request, seeded):
- invalid (~10%): one field broken (or truncated JSON) -> 400 with an OpenAI error object;
- disconnect (~15%): the client task is cancelled after a random 0-0.4 s (the connection
  closes wherever the request is: queued, prefilling, transferring, decoding, streaming);
- abort (~10%): once the gateway has called Prefill (half of them) or Generate (the other
  half), after a random 0-0.15 s (0-0.05 s), an operator sends the gRPC Abort for the
  request's engine ids to both services. The client then sees a complete answer (the abort
  came too late, or the gateway's failover re-submitted the request: Prefill answers
  ABORTED), or the gateway's answer to an engine abort (a decode stream finishing with
  FINISH_REASON_ABORT): a 503 error object, or an error event in a started stream.
Every other request must get 200 with a finish_reason per choice and usage; no 5xx at all.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tests.e2e.conftest import Urls
from tests.e2e.soak_helpers import (
    COMPLETIONS,
    EngineIdSpy,
    Plan,
    audit_pools,
    complete_problems,
    is_error_object,
    make_plan,
    operator_abort,
    send,
    shared_prefixes,
)
from tests.services.gateway.conftest import RunningGateway, running_gateway
from tests.services.helpers import Cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

NUM_REQUESTS = 1000
CONCURRENCY = 48
MAX_TOKENS = (1, 4)
"""Closed range of max_tokens (small: the run must fit ~2 minutes on 2 CPU cores)."""
DISCONNECT_DELAY = 0.4
FAULT_RATES = {"invalid": 0.10, "disconnect": 0.15, "abort": 0.10}
SEED = 20261129


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def soak_gateway(model_path, redis_cluster, redis_server) -> AsyncIterator[RunningGateway]:
    urls = Urls((redis_cluster.prefill.identity.address,),
                (redis_cluster.decode.identity.address,))
    # The registry (cache-aware routing) and the static lists as the fallback; the served
    # name must be the engine's, under which the instances register.
    async with running_gateway(model_path, urls,  # type: ignore[arg-type]
                               served_model_name=redis_cluster.prefill.worker.model_name,
                               redis_url=redis_server.url, rpc_timeout=10.0) as gw:
        yield gw


class Tally:
    """Outcomes by fault kind; `problems` lists every broken expectation."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.problems: list[str] = []
        self.aborts_sent: collections.Counter[str] = collections.Counter()

    def bad(self, plan: Plan, what: str) -> None:
        self.problems.append(f"#{plan.index} {plan.fault} {plan.route} stream={plan.stream} "
                             f"n={plan.n}: {what}")


async def abort_in_flight(cluster: Cluster, spy: EngineIdSpy, plan: Plan,
                          task: asyncio.Task) -> bool:
    """Once the gateway made the plan's `abort_stage` call, wait `delay` s and abort the
    request's engine ids on both services; False if it finished first."""
    deadline = time.monotonic() + 30
    while plan.abort_stage not in spy.stages.get(plan.request_id, ()) and not task.done() \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    await asyncio.wait({task}, timeout=plan.delay / (3 if plan.abort_stage == "decode" else 1))
    if task.done() or not spy.ids.get(plan.request_id):
        return False
    await operator_abort(cluster, list(spy.ids[plan.request_id]))
    return True


async def run_one(http: httpx.AsyncClient, cluster: Cluster, spy: EngineIdSpy, plan: Plan,
                  tally: Tally) -> None:
    task = asyncio.ensure_future(send(http, plan))
    aborted = False
    if plan.fault == "disconnect":
        done, _ = await asyncio.wait({task}, timeout=plan.delay)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            tally.outcomes["disconnected"] += 1
            return
        tally.outcomes["disconnect_too_late"] += 1
    elif plan.fault == "abort":
        aborted = await abort_in_flight(cluster, spy, plan, task)
        if aborted:
            tally.aborts_sent[plan.abort_stage] += 1
        else:
            tally.outcomes["abort_too_late"] += 1
    result = await task
    tally.statuses[result.status] += 1
    if result.status >= 500:
        tally.outcomes[f"5xx_{plan.fault}"] += 1
    if plan.fault == "invalid":
        if result.status != 400 or not is_error_object(result.body, 400):
            tally.bad(plan, f"expected a 400 error object, got {result.status} {result.body}")
        tally.outcomes["invalid_400"] += 1
        return
    problems = complete_problems(plan, result)
    if aborted:
        tag = f"aborted_at_{plan.abort_stage}"
        if not problems:
            tally.outcomes[f"{tag}_then_completed"] += 1
        elif result.status == 503 and is_error_object(result.body, 503):
            tally.outcomes[f"{tag}_503"] += 1
        elif result.status == 200 and result.error_event is not None and result.done \
                and is_error_object(result.error_event, result.error_event["error"]["code"]):
            tally.outcomes[f"{tag}_stream_error_event"] += 1
        else:
            tally.bad(plan, f"aborted, answered {result.status}: {problems}")
        return
    if problems:
        tally.bad(plan, "; ".join(problems))
    tally.outcomes["completed"] += 1


class HealthProbe:
    """GET /health every `interval` s while the soak runs: statuses and the worst latency."""

    def __init__(self, url: str, interval: float = 0.25) -> None:
        self.url, self.interval = url, interval
        self.statuses: collections.Counter[int] = collections.Counter()
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            while True:
                t0 = time.monotonic()
                try:
                    status = (await http.get("/health")).status_code
                except httpx.HTTPError:
                    status = 0
                self.worst = max(self.worst, time.monotonic() - t0)
                self.statuses[status] += 1
                await asyncio.sleep(self.interval)

    def __enter__(self) -> HealthProbe:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_soak_1000_requests_leave_nothing_behind(soak_gateway, redis_cluster):
    rng = random.Random(SEED)
    prefixes = shared_prefixes(SEED)
    model = soak_gateway.config.served_model_name
    plans = [make_plan(i, rng, model, prefixes, FAULT_RATES, MAX_TOKENS,
                       DISCONNECT_DELAY) for i in range(NUM_REQUESTS)]
    faults = collections.Counter(p.fault for p in plans)
    spy = EngineIdSpy(soak_gateway.app.state.gateway.channels)
    tally = Tally()
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def bounded(plan: Plan) -> None:
        async with semaphore:
            try:
                await run_one(http, redis_cluster, spy, plan, tally)
            except Exception as e:  # a dropped connection, a timeout: counted, then failed
                tally.outcomes["client_exception"] += 1
                tally.bad(plan, f"{type(e).__name__}: {e}")

    limits = httpx.Limits(max_connections=2 * CONCURRENCY,
                          max_keepalive_connections=2 * CONCURRENCY)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=soak_gateway.url, timeout=60,
                                 limits=limits) as http:
        with HealthProbe(soak_gateway.url) as health:
            await asyncio.gather(*(bounded(p) for p in plans))
        run_seconds = time.monotonic() - t0
        audit = await audit_pools(redis_cluster, timeout=30)
        drain_seconds = time.monotonic() - t0 - run_seconds
        kv_audit = (await http.get("/debug/kv-audit")).json()  # the gateway's own audit
        # The gateway still serves after all that.
        probe = Plan(NUM_REQUESTS, COMPLETIONS, {"model": model, "max_tokens": 4,
                                                 "prompt": "The capital of France is",
                                                 "temperature": 0}, False, 1, 4, "none", 0.0)
        probe_problems = complete_problems(probe, await send(http, probe))

    five_xx = sum(v for s, v in tally.statuses.items() if s >= 500)
    failover = getattr(soak_gateway.app.state.gateway.engine, "failover_stats", None)
    print(f"\nSOAK requests={NUM_REQUESTS} concurrency={CONCURRENCY} faults={dict(faults)} "
          f"aborts_sent={dict(tally.aborts_sent)} retried={spy.num_retried()} "
          f"failover={failover} "
          f"health={dict(health.statuses)} health_worst={health.worst:.2f}s "
          f"outcomes={dict(sorted(tally.outcomes.items()))} "
          f"statuses={dict(sorted(tally.statuses.items()))} 5xx={five_xx} "
          f"blocks_leaked={audit.blocks_leaked} index_ok={audit.index_ok} "
          f"problems={len(tally.problems)} run={run_seconds:.1f}s drain={drain_seconds:.2f}s")
    assert not tally.problems, "\n".join(tally.problems[:20])
    assert not audit.problems(), audit.problems()
    assert audit.index_ok is True
    assert not probe_problems, probe_problems
    assert kv_audit["ok"] and len(kv_audit["instances"]) == 2, kv_audit
    assert kv_audit["totals"]["num_used_blocks"] == kv_audit["totals"]["num_pinned_blocks"] == 0
    # Only the engine's own answer to an operator abort may be a 5xx.
    assert five_xx == tally.outcomes["5xx_abort"], tally.statuses
    # The faults really happened (the check would be void otherwise).
    assert tally.outcomes["invalid_400"] == faults["invalid"] >= NUM_REQUESTS * 0.05
    assert tally.outcomes["disconnected"] >= NUM_REQUESTS * 0.05
    assert tally.aborts_sent["prefill"] >= NUM_REQUESTS * 0.01
    assert tally.aborts_sent["decode"] >= NUM_REQUESTS * 0.01
    assert tally.outcomes["completed"] >= NUM_REQUESTS * 0.5
