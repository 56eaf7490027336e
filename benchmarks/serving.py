"""OpenAI-API load generator (streaming /v1/completions) for the workloads of
../shared/bench/workloads.md, against any base URL.

    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 \
        --model SmolLM2-135M-Instruct --workload mixed64 [--no-prefix-hint]

Reports TTFT, ITL, TPOT and e2e percentiles (seconds) and output tokens/s as JSON.
Every request is greedy with ignore_eos, so it makes exactly max_tokens tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import BenchRequest, build_workload  # noqa: E402


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)

    def pick(q: float) -> float:
        return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
            "mean": statistics.fmean(v)}


async def one_request(client: httpx.AsyncClient, model: str, req: BenchRequest,
                      headers: dict) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return await stream_completion(client, body, headers)


async def stream_completion(client: httpx.AsyncClient, body: dict, headers: dict) -> dict:
    """POST a streamed /v1/completions `body`; its TTFT, ITLs, e2e and token counts (seconds),
    or {"error": ...} for a non-200 answer."""
    t0 = time.perf_counter()
    ttft, last, itl, usage = None, None, [], None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.append(now - last)
                last = now
    e2e = time.perf_counter() - t0
    n_out = (usage or {}).get("completion_tokens", len(itl) + 1)
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "output_tokens": n_out,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get(
                "cached_tokens"),
            "tpot": (e2e - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None}


async def run(args) -> dict:
    reqs = build_workload(args.workload, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout,
                                 limits=limits) as client:
        t0 = time.perf_counter()
        if args.workload == "single":
            results = [await one_request(client, args.model, r, headers) for r in reqs]
        else:
            results = await asyncio.gather(*(one_request(client, args.model, r, headers)
                                             for r in reqs))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    n_out = sum(r["output_tokens"] for r in ok)
    return {
        "workload": args.workload, "base_url": args.base_url, "requests": len(reqs),
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if "error" in r][:3],
        "wall_s": wall, "output_tokens": n_out, "output_tok_per_s": n_out / wall,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
        "tpot_s": percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--workload", default="mixed64", choices=["single", "mixed64", "prefix32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
