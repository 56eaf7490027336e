"""The peer tier against recomputing: TTFT of a prompt whose prefix another instance holds.

Two decode engines (unified: each prefills its own prompts) in this process, real gRPC
between them. For each of --prompts prompts of --prompt-len tokens (random ids, a --tail of
its own tokens after a shared --prefix-len prefix):
    A computes the prefix (a Generate of max_tokens 1; its blocks stay cached), then
    B serves the prompt twice, alternating which goes first: with a PeerKV hint naming A
    (PinKV, FetchKV, the tail computed on B) and, under another cache_salt (so none of A's
    or B's blocks hit), computing all of it.
Reports the median TTFT (Generate call to first token) of each and their ratio, measured in
the same run. Nothing else may run on the machine meanwhile.

    .venv/bin/python benchmarks/peer_tier.py --prompts 12 --prefix-len 1024 --tail 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from pdserve.services.common.config import ServiceConfig  # noqa: E402
from pdserve.services.common.launch import build_runtime  # noqa: E402
from pdserve.services.proto import engine_pb2 as pb  # noqa: E402
from pdserve.services.proto import engine_pb2_grpc  # noqa: E402
from pdserve.shared.engine_args import EngineArgs  # noqa: E402
from pdserve.shared.models.convert import resolve_model_path  # noqa: E402


async def _start(model: str, kv_cache_memory: str):
    runtime = build_runtime(ServiceConfig(role="decode", host="127.0.0.1", port=0,
                                          metrics_port=0, redis_url=None),
                            EngineArgs(model=model, kv_cache_memory=kv_cache_memory))
    await runtime.start()
    await runtime.wait_ready(300)
    return runtime


async def _ttft(stub, request_id: str, prompt: list[int], salt: str = "",
                peer: pb.PeerKV | None = None) -> float:
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, cache_salt=salt,
                           sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1))
    if peer is not None:
        req.peer_kv.CopyFrom(peer)
    start = time.perf_counter()
    async for _ in stub.Generate(req, timeout=600):
        break
    return time.perf_counter() - start


async def main(args) -> dict:
    model = str(resolve_model_path(args.model))
    a, b = await _start(model, args.kv_cache_memory), await _start(model, args.kv_cache_memory)
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    ch_a = grpc.aio.insecure_channel(a.identity.address, options=opts)
    ch_b = grpc.aio.insecure_channel(b.identity.address, options=opts)
    stub_a = engine_pb2_grpc.DecodeServiceStub(ch_a)
    stub_b = engine_pb2_grpc.DecodeServiceStub(ch_b)
    rng = random.Random(args.seed)
    peer_s, compute_s = [], []
    try:
        for i in range(args.prompts + 1):  # the first is a warm-up, not counted
            prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(args.tail)]
            await _ttft(stub_a, f"warm-{i}", prefix)
            hint = pb.PeerKV(address=a.identity.address, num_blocks=args.prefix_len // 16)
            runs = [("peer", dict(peer=hint)), ("compute", dict(salt=f"s{i}"))]
            for name, kwargs in (runs if i % 2 else runs[::-1]):
                seconds = await _ttft(stub_b, f"{name}-{i}", prompt, **kwargs)
                if i:
                    (peer_s if name == "peer" else compute_s).append(seconds)
        fetched = b.worker.metrics.value("kv_tier_loads_total", tier="peer")
        failures = sum(b.worker.metrics.value("kv_tier_failures_total", tier="peer", op=op)
                       for op in ("pin", "fetch"))
    finally:
        await ch_a.close()
        await ch_b.close()
        await asyncio.gather(a.stop(0.5), b.stop(0.5))
    result = {
        "prompts": args.prompts, "prefix_len": args.prefix_len, "tail": args.tail,
        "ttft_peer_p50_s": statistics.median(peer_s),
        "ttft_compute_p50_s": statistics.median(compute_s),
        "ttft_ratio": statistics.median(peer_s) / statistics.median(compute_s),
        "blocks_fetched": int(fetched), "peer_failures": int(failures)}
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    out = asyncio.run(main(args))
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
