"""Pooling throughput (issue 32): `--inputs` inputs of `--min-tokens`..`--max-tokens` random
token ids through /v1/embeddings in batches of `--batch-size` (one request per batch,
`--concurrency` requests in flight), inputs/s.

Without `--url` it starts `pdserve up --runner pooling` (its own ports; `--up-flags` adds
flags, e.g. `--convert embed --override-pooler-config '{"pooling_type": "MEAN"}'`) and stops
it afterwards; with `--url` it measures the server there (vLLM: `vllm serve MODEL --convert
embed`), so both run the same inputs (token ids, no tokenizer in the way; the same seed
gives the same inputs).

    .venv/bin/python benchmarks/pooling.py                        # pdserve, SmolLM2
    .venv/bin/python benchmarks/pooling.py --url http://127.0.0.1:8000   # any server

Prints one JSON object: inputs, prompt tokens, wall seconds, inputs/s, prompt tokens/s and
the batch latency p50 / p90 (after `--warmup` batches that are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.breakdown import DEFAULT_UP_FLAGS, Stack, log  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="measure the server at this URL instead of starting pdserve")
    p.add_argument("--model", help="the `model` field (default: the server's first model)")
    p.add_argument("--inputs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=1, help="batches in flight at once")
    p.add_argument("--warmup", type=int, default=1, help="batches sent first, not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8131, help="pdserve's port (without --url)")
    p.add_argument("--up-flags", default=DEFAULT_UP_FLAGS,
                   help="flags of the `pdserve up` started here (--runner pooling is added)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def make_inputs(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Token ids drawn away from the special tokens (SmolLM2's are below 20)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run(url: str, model: str | None, args: argparse.Namespace) -> dict:
    import httpx

    inputs = make_inputs(args.inputs, args.min_tokens, args.max_tokens, args.seed)
    batches = [inputs[i:i + args.batch_size] for i in range(0, len(inputs), args.batch_size)]
    warmup = make_inputs(args.warmup * args.batch_size, args.min_tokens, args.max_tokens,
                         args.seed + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def send(batch: list[list[int]]) -> float:
            start = time.perf_counter()
            r = await http.post("/v1/embeddings", json={"model": model, "input": batch,
                                                        "encoding_format": "float"})
            r.raise_for_status()
            assert len(r.json()["data"]) == len(batch)
            return time.perf_counter() - start

        for i in range(0, len(warmup), args.batch_size):
            await send(warmup[i:i + args.batch_size])
        gate = asyncio.Semaphore(args.concurrency)

        async def bounded(batch: list[list[int]]) -> float:
            async with gate:
                return await send(batch)

        start = time.perf_counter()
        latencies = await asyncio.gather(*(bounded(b) for b in batches))
        wall = time.perf_counter() - start
    tokens = sum(map(len, inputs))
    q = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
    return {"url": url, "model": model, "inputs": len(inputs), "batch_size": args.batch_size,
            "concurrency": args.concurrency, "prompt_tokens": tokens,
            "wall_s": round(wall, 3), "inputs_per_s": round(len(inputs) / wall, 2),
            "prompt_tokens_per_s": round(tokens / wall, 1),
            "batch_latency_p50_s": round(statistics.median(latencies), 3),
            "batch_latency_p90_s": round(q[8], 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        print(json.dumps(asyncio.run(run(args.url, args.model, args))))
        return 0
    logfile = Path(tempfile.mkdtemp(prefix="pdserve-pooling-")) / "up.log"
    stack = Stack(["--runner", "pooling", *shlex.split(args.up_flags)], args.port, logfile)
    try:
        stack.start(args.startup_timeout)
        result = asyncio.run(run(stack.url, args.model, args))
    finally:
        stack.stop()
    log(f"pdserve up log: {logfile}")
    print(json.dumps({"system": "pdserve", "up_flags": args.up_flags, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
