"""KV transfer speed and the TTFT cost of the prefill/decode split, on loopback.

1. FetchKV throughput: a real prefill service (its own process) prefills a 2,000-token
   prompt, then FetchKV streams all of its blocks, again and again. Beside it, in the same
   run, a raw grpc.aio server (another process) streams pre-built messages of exactly the
   same sizes: the ceiling gRPC itself allows. Reported: median MiB/s of each, their ratio,
   and FetchKV with the receiving side's real work (check + write into a KV cache).
2. TTFT of the `single` workload (~30-token prompts): the engine in this process (first and
   second token) against prefill service -> decode service (first token = Prefill returns;
   second token = the first decode chunk, after the KV transfer), and the decode service
   prefilling locally.

    .venv/bin/python benchmarks/kv_transfer.py [--prompt-tokens 2000] [--repeats 7]

Prints a JSON summary. The machine is shared and noisy: quote medians and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import build_workload  # noqa: E402
from pdserve.services.proto import engine_pb2 as pb  # noqa: E402
from pdserve.services.proto import engine_pb2_grpc  # noqa: E402

MIB = 1 << 20
OPTIONS = [("grpc.max_send_message_length", 64 * MIB),
           ("grpc.max_receive_message_length", 64 * MIB)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the raw baseline server ----------------------------------------------------------------

class RawServicer(engine_pb2_grpc.PrefillServiceServicer):
    def __init__(self, sizes: list[int]) -> None:
        self.chunks = [pb.KVChunk(request_id="raw", block_indices=[i], dtype="float32",
                                  shape=[n // 4], data=os.urandom(n))
                       for i, n in enumerate(sizes)]

    async def FetchKV(self, request, context):
        for chunk in self.chunks:
            yield chunk


async def serve_raw(port: int, sizes: list[int]) -> None:
    server = grpc.aio.server(options=OPTIONS)
    engine_pb2_grpc.add_PrefillServiceServicer_to_server(RawServicer(sizes), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# -- processes ------------------------------------------------------------------------------

def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def spawn_service(role: str, port: int, model: str) -> subprocess.Popen:
    return spawn(["-m", f"services.{role}", "--host", "127.0.0.1", "--port", str(port),
                  "--metrics-port", "-1", "--model", model, "--kv-cache-memory", "256MiB"])


async def wait_serving(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service on port {port} exited with {proc.returncode}")
            try:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"service on port {port} never became SERVING")


# -- measurements ---------------------------------------------------------------------------

async def timed_stream(call, on_chunk=None) -> tuple[float, int, list[int]]:
    t0 = time.perf_counter()
    sizes = []
    async for chunk in call:
        sizes.append(len(chunk.data))
        if on_chunk is not None:
            on_chunk(chunk)
    return time.perf_counter() - t0, sum(sizes), sizes


def make_writer(handle: pb.KVTransferParams):
    """The decode side's work per chunk: validate, then write into a KV cache."""
    import torch

    from pdserve.shared.kv_transfer.codec import (
        KVChunkData,
        KVLayout,
        TransferTracker,
        write_kv_blocks,
    )

    n = -(-handle.num_tokens // handle.block_size)
    shape = (n + 1, handle.block_size, handle.num_kv_heads, handle.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(handle.num_layers)]
    layout = KVLayout.of(caches)

    def new_tracker():
        tracker = TransferTracker(layout, list(range(n)))

        def on_chunk(c) -> None:
            data = tracker.accept(KVChunkData(list(c.block_indices), c.layer_start, c.dtype,
                                              tuple(c.shape), c.data))
            write_kv_blocks(caches, [i + 1 for i in c.block_indices], c.layer_start, data)
        return on_chunk
    return new_tracker


async def bench_fetch(prefill_port: int, prompt_tokens: int, repeats: int) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill_port}", options=OPTIONS) as ch:
        stub = engine_pb2_grpc.PrefillServiceStub(ch)
        prompt = [100 + (i * 7919) % 30000 for i in range(prompt_tokens)]
        resp = await stub.Prefill(pb.PrefillRequest(
            request_id="bench-fetch", prompt_token_ids=prompt,
            sampling_params=pb.SamplingParams(max_tokens=2)), timeout=600)
        handle = resp.kv_transfer_params

        def fetch():
            return stub.FetchKV(pb.FetchKVRequest(request_id="bench-fetch"), timeout=600)

        _, total, sizes = await timed_stream(fetch())  # warm-up; learns the chunk sizes
        raw_port = free_port()
        raw = spawn([__file__, "--raw-server", str(raw_port),
                     "--sizes", ",".join(map(str, sizes))])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{raw_port}",
                                                 options=OPTIONS) as raw_ch:
                await asyncio.wait_for(raw_ch.channel_ready(), 120)  # the process starts
                raw_stub = engine_pb2_grpc.PrefillServiceStub(raw_ch)

                def raw_fetch():
                    return raw_stub.FetchKV(pb.FetchKVRequest(request_id="raw"), timeout=600)

                await timed_stream(raw_fetch())
                writer = make_writer(handle)
                fetch_s, raw_s, write_s = [], [], []
                for _ in range(repeats):  # interleaved, so that noise hits both alike
                    fetch_s.append((await timed_stream(fetch()))[0])
                    raw_s.append((await timed_stream(raw_fetch()))[0])
                    write_s.append((await timed_stream(fetch(), writer()))[0])
        finally:
            raw.terminate()
            raw.wait()
        await stub.ReleaseKV(pb.ReleaseKVRequest(request_id="bench-fetch"), timeout=60)
    mib = total / MIB

    def rate(xs):
        return mib / statistics.median(xs)
    return {"prompt_tokens": prompt_tokens, "blocks": -(-handle.num_tokens // handle.block_size),
            "mib": round(mib, 1), "chunks": len(sizes),
            "chunk_mib_max": round(max(sizes) / MIB, 2),
            "fetchkv_mib_s": round(rate(fetch_s), 1), "raw_grpc_mib_s": round(rate(raw_s), 1),
            "fetchkv_vs_raw": round(rate(fetch_s) / rate(raw_s), 3),
            "fetchkv_with_write_mib_s": round(rate(write_s), 1)}


class InProcessEngine:
    """The engine core in this process: the single-process baseline, no gRPC."""

    def __init__(self, model: str) -> None:
        from pdserve.shared.engine.engine_core import EngineCore
        from pdserve.shared.engine_args import EngineArgs

        self.core = EngineCore(*EngineArgs(model=model, kv_cache_memory="256MiB")
                               .create_engine_configs())

    def first_two_tokens(self, request_id: str, ids: list[int]) -> tuple[float, float]:
        from pdserve.shared.request import Request
        from pdserve.shared.sampling_params import SamplingParams

        t0 = time.perf_counter()
        self.core.add_request(Request(request_id, ids, SamplingParams(
            temperature=0, max_tokens=2, ignore_eos=True)))
        times = []
        while self.core.has_unfinished_requests():
            if self.core.step():
                times.append(time.perf_counter() - t0)
        return times[0], times[1]


async def bench_ttft(prefill_port: int, decode_port: int, engine: InProcessEngine,
                     prompts: list[list[int]]) -> dict:
    """Per prompt, interleaved so that noise hits all three alike: the in-process engine,
    prefill service -> decode service, and the decode service prefilling by itself."""
    params = pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out: dict[str, list[float]] = {k: [] for k in ("engine_first", "engine_second",
                                                   "split_first", "split_second", "local")}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{prefill_port}", options=OPTIONS) as pch, \
            grpc.aio.insecure_channel(f"127.0.0.1:{decode_port}", options=OPTIONS) as dch:
        prefill = engine_pb2_grpc.PrefillServiceStub(pch)
        decode = engine_pb2_grpc.DecodeServiceStub(dch)
        for i, ids in enumerate(prompts):
            first, second = engine.first_two_tokens(f"e{i}", ids)
            out["engine_first"].append(first)
            out["engine_second"].append(second)
            t0 = time.perf_counter()
            resp = await prefill.Prefill(pb.PrefillRequest(
                request_id=f"s{i}", prompt_token_ids=ids, sampling_params=params), timeout=600)
            out["split_first"].append(time.perf_counter() - t0)
            async for _ in decode.Generate(pb.DecodeRequest(
                    request_id=f"s{i}", prompt_token_ids=ids,
                    output_token_ids=[resp.first_token_id], sampling_params=params,
                    kv_transfer_params=resp.kv_transfer_params), timeout=600):
                out["split_second"].append(time.perf_counter() - t0)
                break
            # Another first token, so that the decode instance has no prefix-cache hit.
            t0 = time.perf_counter()
            async for _ in decode.Generate(pb.DecodeRequest(
                    request_id=f"l{i}", prompt_token_ids=[ids[0] + 1] + ids[1:],
                    sampling_params=params), timeout=600):
                out["local"].append(time.perf_counter() - t0)
                break
    return {k: v[1:] for k, v in out.items()}  # the first prompt is the warm-up


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 1)


async def run(args) -> dict:
    from pdserve.shared.models.convert import resolve_model_path
    from pdserve.shared.tokenizer import get_tokenizer

    model = str(resolve_model_path(args.model))
    tokenizer = get_tokenizer(model)
    prompts = [tokenizer.encode(r.prompt, add_special_tokens=False)
               for r in build_workload("single", seed=1) + build_workload("single", seed=2)]
    prompts = prompts[:args.ttft_requests + 1]
    prefill_port, decode_port = free_port(), free_port()
    procs = [spawn_service("prefill", prefill_port, model),
             spawn_service("decode", decode_port, model)]
    engine = InProcessEngine(model)
    try:
        await wait_serving(prefill_port, procs[0])
        await wait_serving(decode_port, procs[1])
        fetch = await bench_fetch(prefill_port, args.prompt_tokens, args.repeats)
        t = await bench_ttft(prefill_port, decode_port, engine, prompts)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    ttft = {"requests": len(t["local"]),
            "prompt_tokens_median": statistics.median(len(p) for p in prompts),
            "engine_first_token_ms": ms(t["engine_first"]),
            "engine_second_token_ms": ms(t["engine_second"]),
            "decode_service_local_first_token_ms": ms(t["local"]),
            "split_first_token_ms": ms(t["split_first"]),
            "split_second_token_ms": ms(t["split_second"])}
    ttft["split_added_vs_local_service_ms"] = round(
        ttft["split_first_token_ms"] - ttft["decode_service_local_first_token_ms"], 1)
    ttft["split_added_vs_engine_ms"] = round(
        ttft["split_first_token_ms"] - ttft["engine_first_token_ms"], 1)
    ttft["engine_first_to_second_token_ms"] = round(
        ttft["engine_second_token_ms"] - ttft["engine_first_token_ms"], 1)
    ttft["split_first_to_second_token_ms"] = round(
        ttft["split_second_token_ms"] - ttft["split_first_token_ms"], 1)
    return {"fetch_kv": fetch, "ttft_single": ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ttft-requests", type=int, default=8)
    parser.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        asyncio.run(serve_raw(args.raw_server, [int(s) for s in args.sizes.split(",")]))
        return
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
