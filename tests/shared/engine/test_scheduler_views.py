"""Scheduler.request_views() / block_holders(): every request it holds, in each state, as an
immutable snapshot; a block holder it does not own shows as a leak."""

from __future__ import annotations

import pytest

from pdserve.shared.engine.scheduler_output import RequestView
from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.kv_transfer.params import RemoteDecode, RemotePrefill
from pdserve.shared.request import RequestStatus
from tests.shared.engine.test_scheduler import (
    FakeRunner,
    make_request,
    make_scheduler,
    model_token,
    step,
)


def _states(sched) -> dict[str, tuple[RequestStatus, str, int]]:
    return {v.request_id: (v.status, v.kv_transfer, len(v.block_ids))
            for v in sched.request_views()}


def test_views_show_running_waiting_paused_and_preempted_requests():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for rid in "abc":
        sched.add_request(make_request(rid, 20))
    step(sched, runner)
    assert _states(sched) == {"a": (RequestStatus.RUNNING, "", 2),
                              "b": (RequestStatus.RUNNING, "", 2),
                              "c": (RequestStatus.WAITING, "", 0)}
    sched.pause_requests(["a"])
    assert sched.preempt_paused()
    views = sched.request_views()
    assert [v.request_id for v in views] == ["b", "c", "a"]  # running, waiting, paused
    assert views[2].status == RequestStatus.PAUSED and views[2].block_ids == ()
    sched.resume_requests(["a"])
    assert _states(sched)["a"] == (RequestStatus.PREEMPTED, "", 0)


def test_views_are_snapshots():
    sched = make_scheduler()
    sched.add_request(make_request("a", 20))
    before = sched.request_views()
    holders = sched.block_holders()
    step(sched, FakeRunner(sched))
    assert before == (RequestView("a", RequestStatus.WAITING, "", (), -1, 0, 20, 20, None),)
    assert dict(holders) == {} and dict(sched.block_holders()) == {"a": (1, 2)}
    view = sched.request_views()[0]
    assert view.block_ids == (1, 2) and view.num_computed_tokens == 20
    with pytest.raises(TypeError):
        sched.block_holders()["b"] = (3,)  # type: ignore[index]
    with pytest.raises(AttributeError):
        view.status = RequestStatus.RUNNING  # type: ignore[misc]


def test_views_show_requests_a_transfer_holds():
    connector = KVConnector()
    sched = make_scheduler(kv_connector=connector)
    sent = make_request("sent", 40, max_tokens=1)
    sent.kv_transfer_params = RemoteDecode()
    received, aborted = make_request("received", 40), make_request("aborted", 40)
    for req in (received, aborted):
        req.append_output_token(model_token(req))
        req.kv_transfer_params = RemotePrefill(num_tokens=40)
        connector.expect_recv(req.request_id, lambda ids, hit: None)
    sched.add_request(sent)
    step(sched, FakeRunner(sched))  # sent: finished, its blocks held for the decode
    for req in (received, aborted):
        sched.add_request(req)
    sched.schedule()
    sched.abort_requests(["aborted"])  # its receive still writes the blocks
    assert _states(sched) == {
        "sent": (RequestStatus.FINISHED_LENGTH_CAPPED, "send", 3),
        "received": (RequestStatus.WAITING_FOR_REMOTE_KVS, "receive", 3),
        "aborted": (RequestStatus.FINISHED_ABORTED, "receive", 3)}
    assert set(sched.block_holders()) == {"sent", "received", "aborted"}


def test_a_block_holder_the_scheduler_does_not_own_is_not_in_its_views():
    sched = make_scheduler()
    leaked = make_request("leaked", 20)
    assert sched.kv_cache_manager.allocate_slots(leaked, 20) is not None
    assert sched.request_views() == ()
    assert dict(sched.block_holders()) == {"leaked": (1, 2)}
