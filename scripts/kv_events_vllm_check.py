"""Check pdserve's KV events against vLLM's own decoder (outside CI: vLLM is not a dependency).

    .venv/bin/python scripts/kv_events_vllm_check.py capture /tmp/kv_events.msgpack
    /path/to/vllm-venv/bin/python -I scripts/kv_events_vllm_check.py decode /tmp/kv_events.msgpack

`capture` (pdserve's venv) starts a real prefill service with --kv-events-config on a free
port and a 16-block pool, subscribes with pyzmq, runs prompts that share a prefix (so blocks
are stored, hit and evicted), clears the prefix cache, and writes every multipart message it
received as a msgpack list of [topic, seq, payload]. `decode` (vLLM's venv; run it with -I
from outside vLLM's source tree) decodes each payload with
`msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`, the decoder vLLM's
consumers use, checks the frames and prints what it read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter


async def _capture(out: str, model: str | None) -> None:
    import grpc
    import msgpack
    import zmq

    from pdserve.services.common.config import ServiceConfig
    from pdserve.services.common.launch import build_runtime
    from pdserve.services.proto import engine_pb2 as pb
    from pdserve.services.proto import engine_pb2_grpc
    from pdserve.shared.engine_args import EngineArgs
    from pdserve.shared.models.convert import resolve_model_path

    config = ServiceConfig(role="prefill", host="127.0.0.1", port=0, redis_url=None,
                           publish_interval=0.05)
    args = EngineArgs(model=str(model or resolve_model_path()), num_gpu_blocks_override=16,
                      max_model_len=256, kv_events_config=json.dumps(
                          {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}))
    runtime = build_runtime(config, args)
    await runtime.start()
    await runtime.wait_ready(300)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("tcp://127.0.0.1:" + runtime.kv_events.endpoint.rsplit(":", 1)[1])
    await asyncio.sleep(0.3)
    frames = []
    try:
        async with grpc.aio.insecure_channel(runtime.identity.address) as channel:
            stub = engine_pb2_grpc.PrefillServiceStub(channel)
            prefix = list(range(1000, 1048))
            for i in range(6):
                await stub.Prefill(pb.PrefillRequest(
                    request_id=f"capture-{i}", prompt_token_ids=prefix + list(
                        range(2000 + 100 * i, 2040 + 100 * i)),
                    sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1)),
                    timeout=120)
        await runtime.worker.engine.call(lambda e: e.kv_cache_manager.reset_prefix_cache())
        await runtime.monitor.tick()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                len(frames) < runtime.kv_events.num_published
                or not runtime.kv_events._queue.empty()):
            while sub.poll(0):
                frames.append(sub.recv_multipart())
            await asyncio.sleep(0.02)
    finally:
        ctx.destroy(linger=0)
        await runtime.stop(0.5)
    with open(out, "wb") as f:
        f.write(msgpack.packb(frames, use_bin_type=True))
    print(f"captured {len(frames)} batches into {out}")


def _decode(path: str) -> int:
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    with open(path, "rb") as f:
        frames = msgspec.msgpack.decode(f.read())
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    kinds: Counter[str] = Counter()
    for i, (topic, seq, payload) in enumerate(frames):
        assert topic == b"" and int.from_bytes(seq, "big") == i, (topic, seq)
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 3600
        for event in batch.events:
            kinds[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                assert all(isinstance(h, int) for h in event.block_hashes)
                assert event.medium == "GPU"
            else:
                assert isinstance(event, BlockRemoved | AllBlocksCleared)
        if i == 0:
            print("first batch as vLLM decodes it:", batch)
    print(f"vLLM's KVEventBatch decoder read {len(frames)} batches: {dict(kinds)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    capture = sub.add_parser("capture")
    capture.add_argument("out")
    capture.add_argument("--model", default=None)
    decode = sub.add_parser("decode")
    decode.add_argument("path")
    ns = parser.parse_args()
    if ns.command == "capture":
        asyncio.run(_capture(ns.out, ns.model))
        return 0
    return _decode(ns.path)


if __name__ == "__main__":
    sys.exit(main())
