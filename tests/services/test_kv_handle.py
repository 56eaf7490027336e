"""The KV handle on the wire (services/proto KVTransferParams <-> shared KVHandle): only what
the decode needs crosses (no prefill block ids, no prefill instance id: their field numbers
reserved), and a decode refuses a handle whose block hashes do not count num_tokens' full
blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from google.protobuf import descriptor_pb2

from pdserve.services.common.convert import handle_from_proto, handle_to_proto
from pdserve.services.decode.worker import DecodeWorker
from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.kv_transfer.codec import KVLayout
from pdserve.shared.kv_transfer.params import KVHandle
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")


def make_handle(num_tokens: int = 40, num_hashes: int = 2, **changes) -> KVHandle:
    handle = KVHandle("127.0.0.1:1234", [bytes([i]) * 16 for i in range(num_hashes)],
                      num_tokens, LAYOUT, "m", "int8", "alpha", 7)
    return handle._replace(**changes)


def test_the_handle_round_trips_through_the_proto():
    handle = make_handle()
    assert handle_from_proto(handle_to_proto(handle)) == handle
    assert handle.num_blocks == 3  # 40 tokens: 2 full blocks and a partial one
    older = handle_to_proto(handle)
    older.quantization = ""  # a peer that predates the field
    assert handle_from_proto(older).quantization == "none"


def test_no_prefill_block_id_crosses_the_wire():
    fields = pb.KVTransferParams.DESCRIPTOR.fields_by_name
    assert "block_ids" not in fields and "prefill_instance_id" not in fields
    message = descriptor_pb2.DescriptorProto()
    pb.KVTransferParams.DESCRIPTOR.CopyToProto(message)
    assert {n for r in message.reserved_range for n in range(r.start, r.end)} == {1, 3}
    assert set(message.reserved_name) == {"block_ids", "prefill_instance_id"}


@pytest.mark.parametrize("num_tokens, num_hashes", [(40, 1), (40, 3), (32, 1), (15, 1)])
def test_a_decode_refuses_a_handle_whose_block_count_does_not_match(num_tokens, num_hashes):
    worker = SimpleNamespace(quantization="int8", layout=LAYOUT, model_name="m", block_size=16)
    request = Request("r", list(range(1, 41)), SamplingParams(), output_token_ids=[5],
                      lora_request=SimpleNamespace(lora_name="alpha", lora_int_id=7))
    handle = make_handle(num_tokens, num_hashes)
    with pytest.raises(ValueError, match=rf"kv_transfer_params.block_hashes has {num_hashes} "
                                         rf"hashes, {num_tokens} tokens fill "
                                         rf"{num_tokens // 16} blocks"):
        DecodeWorker.check_handle(worker, request, handle)  # type: ignore[arg-type]
