"""Structured outputs: the cost of guided decoding under load, and grammar compile times.

    .venv/bin/python benchmarks/structured.py --base-url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct [--rounds 2] [--num-requests 64] [--compile-repeats 5]

1. Load (a running server): mixed64's requests (../shared/bench/workloads.md), all at once,
   streamed, greedy, ignore_eos, a fresh cache_salt per run (a cold prefix cache every time).
   Each round runs them twice, in alternating order: all
   unguided, then with every other request guided by a JSON schema (a list of at least
   1,000 records, so every guided answer runs to its max_tokens, as the unguided ones do).
   Reported: output tok/s of each, the guided/unguided
   ratio per round and its median (issue 12's bound: >= 0.85), TTFT and ITL percentiles.
2. Compile (in this process, xgrammar on the model's tokenizer, no cache): each of the 20
   acceptance-test schemas compiled `--compile-repeats` times; p50 / p99 / max seconds.

Prints one JSON object. `--no-load` or `--no-compile` skips a part. Measure with nothing else
running, and compare only ratios from one run (this machine is shared and noisy).
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

from benchmarks.serving import percentiles, stream_completion  # noqa: E402
from benchmarks.workloads import BenchRequest, build_workload  # noqa: E402

RECORDS = {"type": "object", "properties": {"records": {
    "type": "array", "minItems": 1000, "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "count": {"type": "integer", "minimum": 0, "maximum": 1000},
            "tag": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["name", "count", "tag"]}}}, "required": ["records"]}
"""The guided requests' schema: minItems 1000, so no guided answer can close its list (and
end) before its max_tokens; both runs then produce the same number of tokens, and the ratio
measures the cost of guiding, not a shorter workload (with minItems 1 the guided answers
ended early: 6,815 output tokens against 9,165, in about the same wall time)."""


async def one_request(client: httpx.AsyncClient, model: str, req: BenchRequest,
                      guided: bool, cache_salt: str) -> dict:
    body: dict = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                  "temperature": 0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}, "cache_salt": cache_salt}
    if guided:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "records", "schema": RECORDS}}
    result = await stream_completion(client, body, {})
    return {**result, "guided": guided} if "error" not in result else result


async def run_load(client: httpx.AsyncClient, model: str, reqs: list[BenchRequest],
                   half_guided: bool) -> dict:
    # NOTE: a fresh cache_salt per run: every run starts with a cold prefix cache, as the
    # first one does (without it, the later runs of the same prompts hit the cache and the
    # order of the runs decided the ratio).
    salt = f"structured-bench-{time.time_ns()}"
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, model, r, half_guided and i % 2 == 0,
                                                 salt) for i, r in enumerate(reqs)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    n_out = sum(r["output_tokens"] for r in ok)
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_per_s": n_out / wall,
            "guided_output_tokens": sum(r["output_tokens"] for r in ok if r["guided"]),
            "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if "error" in r][:3],
            "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
            "itl_s": percentiles([x for r in ok for x in r["itl"]])}


async def load_part(args) -> dict:
    reqs = build_workload("mixed64", args.seed)[:args.num_requests]
    if args.max_tokens:
        reqs = [BenchRequest(r.prompt, min(r.max_tokens, args.max_tokens)) for r in reqs]
    rounds = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout,
                                 limits=limits) as client:
        for k in range(args.rounds):
            order = (False, True) if k % 2 == 0 else (True, False)
            runs = {("half_guided" if g else "unguided"): await run_load(
                client, args.model, reqs, g) for g in order}
            runs["ratio"] = (runs["half_guided"]["output_tok_per_s"]
                             / runs["unguided"]["output_tok_per_s"])
            rounds.append(runs)
    return {"requests": len(reqs), "rounds": rounds,
            "median_ratio": statistics.median(r["ratio"] for r in rounds)}


def compile_part(args) -> dict:
    from pdserve.shared.models.convert import resolve_model_path
    from pdserve.shared.structured_output.backend import XgrammarBackend
    from pdserve.shared.structured_output.params import StructuredOutputsParams
    from tests.e2e.structured_schemas import SCHEMAS

    model_path = str(resolve_model_path(args.tokenizer or args.model, convert=False))
    backend = XgrammarBackend(model_path, args.vocab_size)
    backend.compile(StructuredOutputsParams(regex="warm"))  # tokenizer info, outside timing
    times = []
    for _ in range(args.compile_repeats):
        for _, schema in SCHEMAS:
            params = StructuredOutputsParams(json=json.dumps(schema))
            t0 = time.perf_counter()
            backend.compile(params)
            times.append(time.perf_counter() - t0)
    p = percentiles(times)
    return {"schemas": len(SCHEMAS), "compiles": len(times), "p50_s": p["p50"],
            "p99_s": p["p99"], "max_s": max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokenizer", default=None, help="for compile times (default: --model)")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the model's logits width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64, help="the first N of mixed64")
    ap.add_argument("--max-tokens", type=int, default=0, help="cap each max_tokens (0: off)")
    ap.add_argument("--compile-repeats", type=int, default=5)
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    out: dict = {}
    if not args.no_compile:
        out["compile"] = compile_part(args)
    if not args.no_load:
        out["load"] = asyncio.run(load_part(args))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
