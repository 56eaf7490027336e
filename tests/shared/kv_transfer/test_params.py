"""The typed KV transfer parameters on the engine side (shared/kv_transfer/params.py): the
connector holds only a `RemoteDecode` request's blocks, the scheduler answers `HeldBlocks`
and records a `RemotePrefill`'s computed tokens in the typed field."""

from __future__ import annotations

import pytest

from pdserve.shared.kv_transfer.connector import KVConnector
from pdserve.shared.kv_transfer.params import HeldBlocks, RemoteDecode, RemotePrefill
from pdserve.shared.request import RequestStatus
from tests.shared.engine.test_scheduler import (
    FakeRunner,
    make_request,
    make_scheduler,
    model_token,
    step,
)


@pytest.mark.parametrize("params, status, held", [
    (RemoteDecode(), RequestStatus.FINISHED_LENGTH_CAPPED, True),
    (RemoteDecode(), RequestStatus.FINISHED_STOPPED, False),
    (RemotePrefill(num_tokens=40), RequestStatus.FINISHED_LENGTH_CAPPED, False),
    (None, RequestStatus.FINISHED_LENGTH_CAPPED, False),
])
def test_the_connector_holds_only_a_length_capped_remote_decode(params, status, held):
    connector = KVConnector()
    req = make_request("a", 40)
    req.kv_transfer_params, req.status = params, status
    assert connector.request_finished(req, [3, 4, 5]) is held
    assert connector.is_held("a") is held
    assert connector.request_finished(make_request("b", 40), []) is False


def test_a_held_prefill_answers_its_prompt_block_hashes():
    sched = make_scheduler(kv_connector=KVConnector())
    req = make_request("a", 40, max_tokens=1)
    req.kv_transfer_params = RemoteDecode()
    sched.add_request(req)
    _, deltas = step(sched, FakeRunner(sched))
    held = sched.kv_cache_manager.req_to_blocks["a"]  # 40 tokens: 2 full blocks, cached
    want = HeldBlocks([held[0].block_hash, held[1].block_hash])
    assert None not in want.block_hashes
    assert deltas[0].kv_transfer_params == req.kv_transfer_params == want


def test_a_remote_prefill_records_the_tokens_its_receive_computes():
    connector = KVConnector()
    sched = make_scheduler(kv_connector=connector)
    req = make_request("a", 40, max_tokens=3)
    req.append_output_token(model_token(req))
    params = req.kv_transfer_params = RemotePrefill(num_tokens=40)
    connector.expect_recv("a", lambda ids, hit: None)
    sched.add_request(req)
    assert params.num_computed_tokens == 0
    sched.schedule()  # allocates its blocks
    assert params.num_computed_tokens == 40 and req.num_computed_tokens == 0
    connector.recv_finished("a", ok=True)
    sched.update_from_kv_xfer_finished()
    assert req.num_computed_tokens == 40 and req.status == RequestStatus.WAITING
