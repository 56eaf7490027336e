"""services/common/kv_events.py: the config, vLLM's wire bytes, the PUB and replay sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from pdserve.services.common.kv_events import (
    END_SEQ,
    KVEventPublisher,
    KVEventsConfig,
    encode_batch,
    offset_endpoint_port,
    use_int_block_hashes,
)
from pdserve.shared.kv_cache.block_pool import (
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

H = [bytes(range(16 * i, 16 * i + 16)) for i in range(3)]
EVENTS = [BlockStored([H[0], H[1]], None, list(range(1, 9)), 4),
          BlockStored([H[2]], H[1], [9, 10, 11, 12], 4, 7, "GPU", "sql"),
          BlockRemoved([H[0]], MEDIUM_DISK),
          AllBlocksCleared([H[1], H[2]])]
TS = 1700000000.25
# NOTE: vLLM 0.32's own bytes for EVENTS: msgspec.msgpack.encode(KVEventBatch(...)) with
# vllm.distributed.kv_events' structs (scripts/vllm_decode_kv_events.py checks the reverse).
VLLM_INT_HASHES = bytes.fromhex(
    "93cb41d954fc401000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92cf08090a0b0c0d0e0fcf18191a1b1c1d1e1fb1706172656e745f626c6f636b5f68617368c0a9746f6b"
    "656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f68"
    "617368657391cf28292a2b2c2d2e2fb1706172656e745f626c6f636b5f68617368cf18191a1b1c1d1e1f"
    "a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f696407a66d65646975"
    "6da3475055a96c6f72615f6e616d65a373716c83a474797065ac426c6f636b52656d6f766564ac626c6f"
    "636b5f68617368657391cf08090a0b0c0d0e0fa66d656469756da753544f5241474581a474797065b041"
    "6c6c426c6f636b73436c656172656400")


def test_payload_is_vllms_bytes():
    assert encode_batch(TS, EVENTS, 0) == VLLM_INT_HASHES


def test_payload_decodes_as_vllms_kv_event_batch():
    """The structure vLLM's decoder reads (KVEventBatch: array_like; events: maps tagged by
    "type"), written out by hand; hashes as bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    ts, events, rank = msgpack.unpackb(encode_batch(TS, EVENTS, 3, int_hashes=False))
    assert (ts, rank) == (TS, 3)
    assert events == [
        {"type": "BlockStored", "block_hashes": [H[0], H[1]], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None,
         "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [H[2]], "parent_block_hash": H[1],
         "token_ids": [9, 10, 11, 12], "block_size": 4, "lora_id": 7, "medium": "GPU",
         "lora_name": "sql"},
        {"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "STORAGE"},
        {"type": "AllBlocksCleared"}]
    # As ints: the low 64 bits, big-endian (vLLM's maybe_convert_block_hash).
    _, events, _ = msgpack.unpackb(encode_batch(TS, EVENTS[:1]))
    assert events[0]["block_hashes"] == [0x08090A0B0C0D0E0F, 0x18191A1B1C1D1E1F]


def test_int_hashes_follow_vllms_variable():
    assert use_int_block_hashes({}) is True
    assert use_int_block_hashes({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) is False


def test_config_parses_like_vllm():
    assert KVEventsConfig.from_value(None) is None
    on = KVEventsConfig.from_value('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.is_publishing) == ("zmq", "tcp://*:5557", True)
    off = KVEventsConfig.from_value({"endpoint": "tcp://*:6000"})
    assert (off.publisher, off.is_publishing) == ("null", False)
    null = KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "null"})
    assert null.is_publishing is False
    full = KVEventsConfig.from_value(on.to_json())
    assert full == on


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_event": true}', "unknown key(s) ['enable_kv_cache_event']"),
    ('{"publisher": "kafka"}', "bad value for 'publisher'"),
    ('{"max_queue_size": 0}', "bad value for 'max_queue_size'"),
    ('{"hwm": "10"}', "bad value for 'hwm'"),
])
def test_config_errors_are_one_line(value, message):
    with pytest.raises(ValueError) as e:
        KVEventsConfig.from_value(value)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_endpoint_offset_per_engine():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint_port(None, 1) is None
    with pytest.raises(ValueError, match="cannot offset"):
        offset_endpoint_port("udp://x:1", 1)


def local(endpoint: str) -> str:
    """Where a client on this host connects to a bound tcp endpoint."""
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def test_publisher_frames_and_replay_over_real_sockets():
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint="tcp://*:0", replay_endpoint="tcp://127.0.0.1:0",
                            topic="kv")
    publisher = KVEventPublisher(config, int_hashes=False)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        assert publisher.endpoint.startswith("tcp://0.0.0.0:")  # bound: a wildcard
        sub.connect(local(publisher.endpoint))
        time.sleep(0.3)  # PUB drops what is sent before the subscription arrives
        publisher.publish(EVENTS[:2])
        publisher.publish([])  # nothing to send: no batch, no sequence number
        publisher.publish(EVENTS[2:])
        batches = [_recv(sub), _recv(sub)]
        assert [(topic, seq) for topic, seq, _ in batches] == [
            (b"kv", (0).to_bytes(8, "big")), (b"kv", (1).to_bytes(8, "big"))]
        assert [e["type"] for e in msgpack.unpackb(batches[1][2])[1]] == [
            "BlockRemoved", "AllBlocksCleared"]
        # A subscriber that missed batch 1 asks the ROUTER for everything from seq 1.
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        assert _recv(dealer) == [b"", b"kv", (1).to_bytes(8, "big"), batches[1][2]]
        assert _recv(dealer) == [b"", b"", END_SEQ, b""]
        assert (publisher.num_published, publisher.num_dropped) == (2, 0)
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        publisher.shutdown()
    assert not publisher._thread.is_alive()
    # Shut down means the port is free again.
    port = int(publisher.endpoint.rsplit(":", 1)[1])
    again = KVEventPublisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}"))
    again.shutdown()


def test_busy_endpoint_raises():
    first = KVEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0"))
    try:
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(KVEventsConfig(True, "zmq", first.endpoint.replace("0.0.0.0",
                                                                               "*")))
    finally:
        first.shutdown()


def test_serve_refuses_a_bad_config_before_loading(capsys):
    from pdserve.services.cli import main

    assert main(["serve", "prefill", "--kv-events-config", '{"topik": "kv"}']) == 2
    assert "--kv-events-config: unknown key(s) ['topik']" in capsys.readouterr().out
