"""The gateway's overhead per token: one greedy stream through the gateway beside the
same stream straight from the decode service (gRPC Generate, local prefill), alternated
in the same run.

    .venv/bin/python benchmarks/gateway_overhead.py --gateway-url http://127.0.0.1:8000 \
        --decode-address 127.0.0.1:50052 [--reps 5 --max-tokens 128]

Start the services first (e.g. `pdserve up`; its banner lists the decode address).
Prints median TPOT both ways and their ratio (target: gateway ≤ 1.10 × decode alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import build_workload  # noqa: E402
from pdserve.services.proto import engine_pb2 as pb  # noqa: E402
from pdserve.services.proto import engine_pb2_grpc as pb_grpc  # noqa: E402


async def via_gateway(client: httpx.AsyncClient, model: str, prompt: str, n: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def via_decode(stub, prompt_ids: list[int], n: int) -> float:
    req = pb.DecodeRequest(request_id=f"bench-{uuid.uuid4().hex[:8]}",
                           prompt_token_ids=prompt_ids,
                           sampling_params=pb.SamplingParams(temperature=0, top_p=1.0,
                                                             max_tokens=n, ignore_eos=True,
                                                             repetition_penalty=1.0))
    stamps, tokens = [], 0
    async for chunk in stub.Generate(req, timeout=600):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(chunk.token_ids)
    return (stamps[-1] - stamps[0]) / max(1, tokens - 1)


async def run(args) -> dict:
    from pdserve.shared.models.convert import resolve_model_path
    from pdserve.shared.tokenizer import get_tokenizer

    tok = get_tokenizer(str(resolve_model_path(args.model_path)))
    prompt = build_workload("single", 0)[0].prompt
    ids = tok.encode(prompt, add_special_tokens=False)
    gw, dec = [], []
    async with httpx.AsyncClient(base_url=args.gateway_url, timeout=600) as client, \
            grpc.aio.insecure_channel(args.decode_address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        for _ in range(args.reps):
            gw.append(await via_gateway(client, args.model, prompt, args.max_tokens))
            dec.append(await via_decode(stub, ids, args.max_tokens))
    g, d = statistics.median(gw), statistics.median(dec)
    return {"reps": args.reps, "max_tokens": args.max_tokens,
            "gateway_tpot_s_median": g, "decode_alone_tpot_s_median": d,
            "gateway_over_decode": g / d}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    ap.add_argument("--decode-address", required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--model-path", default=None, help="for the tokenizer (default model)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    print(json.dumps(asyncio.run(run(ap.parse_args())), indent=2))


if __name__ == "__main__":
    main()
