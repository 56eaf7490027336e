"""Abort storm (issue 13, item 7): many long prompts, clients leaving at random points.

Starts `pdserve up` (its own ports, a random internal token), then sends `--requests`
streamed /v1/completions with prompts of `--prompt-tokens` random token ids (no two share a
prefix, so every one goes through the prefill service), `--concurrency` at once. A client
leaves (closes its connection) after a uniform 0..`--leave-max-s` seconds with probability
`--leave-fraction` (mostly while its prompt waits or is prefilled), after a random number of
streamed tokens with probability `--leave-mid-stream-fraction`; the others read to the end.
Meanwhile it probes the prefill instance
directly every `--probe-interval-s` (Abort of an unknown id, GetState, health Check).

    .venv/bin/python benchmarks/abort_storm.py --requests 1000     # the issue's storm
    .venv/bin/python benchmarks/abort_storm.py --requests 100      # a quick look

Prints one JSON object: failed control calls (the gateway's Abort / SetPaused by gRPC
status, `pdserve_gateway_control_calls_total`) and the gateway's Abort latency p50 / p99 (the
upper bound of the histogram bucket `pdserve_gateway_control_call_seconds` holding it), the
probes' exact latencies, prompt tokens computed after their request's abort had arrived
(`pdserve_prompt_tokens_after_abort_total`, summed over the engines) as a share of the
storm's prompt tokens, and the blocks in use / pinned on every engine afterwards
(GetState with the invariant check, polled until idle or `--drain-timeout-s`). Control calls
between the engines (the decode's ReleaseKV to the prefill) and pins that expired are
counted from the stack's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.breakdown import Stack, log  # noqa: E402
from benchmarks.serving import percentiles  # noqa: E402
from pdserve.services.proto import engine_pb2 as pb  # noqa: E402
from pdserve.services.proto import engine_pb2_grpc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(1000, 1800),
                   metavar=("MIN", "MAX"), help="prompt length, uniform (tokens)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    p.add_argument("--leave-fraction", type=float, default=0.85)
    p.add_argument("--leave-mid-stream-fraction", type=float, default=0.1)
    p.add_argument("--leave-max-s", type=float, default=30.0)
    p.add_argument("--probe-interval-s", type=float, default=0.5)
    p.add_argument("--drain-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8431, help="the gateway's port")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log", default=None, help="the stack's log file (default: a temp file)")
    p.add_argument("--up-flag", action="append", default=[],
                   help="one more `pdserve up` flag (repeatable), e.g. --up-flag=--no-cpu-share")
    return p.parse_args(argv)


# -- the clients ----------------------------------------------------------------------------

async def one_client(client: httpx.AsyncClient, model: str, rng: random.Random,
                     args: argparse.Namespace, outcomes: Counter) -> int:
    """One request; its prompt length (tokens)."""
    n = rng.randint(*args.prompt_tokens)
    body = {"model": model, "prompt": [rng.randrange(100, 40000) for _ in range(n)],
            "max_tokens": rng.randint(*args.max_tokens), "temperature": 0,
            "ignore_eos": True, "stream": True}
    u = rng.random()
    leave_after = rng.uniform(0, args.leave_max_s) if u < args.leave_fraction else None
    leave_at_chunk = rng.randint(1, max(1, body["max_tokens"] - 1)) \
        if leave_after is None and u < args.leave_fraction + args.leave_mid_stream_fraction \
        else None

    async def read() -> str:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith('data: {"error"'):
                    return "stream_error"
                if line == "data: [DONE]":
                    return "completed"
                chunks += line.startswith("data: ")
                if leave_at_chunk is not None and chunks >= leave_at_chunk:
                    return "left_mid_stream"  # leaving the block closes the connection
            return "no_done"

    try:
        outcomes[await asyncio.wait_for(read(), leave_after)] += 1
    except TimeoutError:
        outcomes["left_by_time"] += 1  # the stream was closed: the client went away
    except httpx.HTTPError as e:
        outcomes[f"client_{type(e).__name__}"] += 1
    return n


# -- direct probes of the prefill instance ---------------------------------------------------

async def probe(address: str, token: str, interval: float, stop: asyncio.Event) -> dict:
    """Abort (unknown id), GetState and health Check every `interval` s until `stop`."""
    md = (("authorization", f"Bearer {token}"),)
    latencies: dict[str, list[float]] = {"Abort": [], "GetState": [], "health": []}
    failures: Counter = Counter()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.PrefillServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        calls = {
            "Abort": lambda: stub.Abort(pb.AbortRequest(request_ids=["storm-probe"]),
                                        timeout=5, metadata=md),
            "GetState": lambda: stub.GetState(pb.GetStateRequest(), timeout=5, metadata=md),
            "health": lambda: health.Check(health_pb2.HealthCheckRequest(service=""),
                                           timeout=5),
        }
        while not stop.is_set():
            for name, call in calls.items():
                start = time.monotonic()
                try:
                    await call()
                    latencies[name].append(time.monotonic() - start)
                except grpc.aio.AioRpcError as e:
                    failures[f"{name}:{e.code().name}"] += 1
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass
    return {"failures": dict(failures),
            **{name: {**percentiles(v), "max": max(v, default=None), "n": len(v)}
               for name, v in latencies.items()}}


# -- metrics and the leak check --------------------------------------------------------------

def scrape(url: str) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} of a Prometheus text endpoint."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


LOG_FAILURES = {"Abort": re.compile(r"Abort on \S+ \S+ failed: (\w+)"),
                "ReleaseKV": re.compile(r"ReleaseKV on \S+ failed: (\w+)"),
                "pin_expired": re.compile(r"KV pin expired")}
"""Failed control calls the gateway or the decode logged, and pins nobody released."""


def log_failures(text: str) -> dict[str, int]:
    return {name: len(pattern.findall(text)) for name, pattern in LOG_FAILURES.items()}


def bucket_quantile(samples: list, method: str, q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile `q` (None: no calls)."""
    buckets = sorted((float(labels["le"]), value) for labels, value in samples
                     if labels.get("method") == method)
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(bound for bound, cumulative in buckets if cumulative >= q * total)


async def engine_states(engines: list[dict], token: str) -> list[dict]:
    md = (("authorization", f"Bearer {token}"),)
    states = []
    for engine in engines:
        address = engine["grpc"]
        async with grpc.aio.insecure_channel(address) as ch:
            stub = engine_pb2_grpc.PrefillServiceStub(ch) if engine["role"] == "prefill" \
                else engine_pb2_grpc.DecodeServiceStub(ch)
            s = await stub.GetState(pb.GetStateRequest(check_invariants=True), timeout=30,
                                    metadata=md)
        states.append({"address": address, "role": s.role, "used": s.num_used_blocks,
                       "pinned": s.num_pinned_blocks, "running": s.num_running,
                       "waiting": s.num_waiting, "invariants_ok": s.invariants_ok})
    return states


async def wait_idle(engines: list[dict], token: str, timeout: float) -> tuple[list, float]:
    start = time.monotonic()
    while True:
        states = await engine_states(engines, token)
        idle = all(s["used"] == 0 and s["pinned"] == 0 and s["running"] == 0
                   and s["waiting"] == 0 for s in states)
        if idle or time.monotonic() - start > timeout:
            return states, time.monotonic() - start
        await asyncio.sleep(0.5)


# -- the run ---------------------------------------------------------------------------------

async def storm(args: argparse.Namespace, stack: Stack, token: str) -> dict:
    engines = list(stack.engines.values())
    prefill = next(e["grpc"] for e in engines if e["role"] == "prefill")
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    semaphore = asyncio.Semaphore(args.concurrency)
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(3600.0),
                                 limits=limits) as client:

        async def run(i: int) -> int:
            async with semaphore:
                if i and i % 100 == 0:
                    log(f"request {i}: {dict(outcomes)}")
                return await one_client(client, stack.model, random.Random(rng.random()),
                                        args, outcomes)

        probes = asyncio.ensure_future(probe(prefill, token, args.probe_interval_s, stop))
        start = time.monotonic()
        prompt_tokens = sum(await asyncio.gather(*(run(i) for i in range(args.requests))))
        wall = time.monotonic() - start
        log(f"storm done in {wall:.0f} s: {dict(outcomes)}; waiting for the engines")
        states, drain = await wait_idle(engines, token, args.drain_timeout_s)
        stop.set()
        probe_report = await probes

    gateway = scrape(stack.url + "/metrics")
    calls = {f"{labels['method']}:{labels['code']}": int(v)
             for labels, v in gateway.get("pdserve_gateway_control_calls_total", [])}
    seconds = gateway.get("pdserve_gateway_control_call_seconds_bucket", [])
    after_abort = sum(v for e in engines for _, v in scrape(e["metrics"]).get(
        "pdserve_prompt_tokens_after_abort_total", []))
    return {
        "requests": args.requests, "concurrency": args.concurrency, "wall_s": round(wall, 1),
        "outcomes": dict(outcomes), "storm_prompt_tokens": prompt_tokens,
        "control_calls": calls,
        "failed_control_calls": sum(n for k, n in calls.items() if not k.endswith(":OK")),
        "gateway_abort_latency_bucket_s": {
            "p50_le": bucket_quantile(seconds, "Abort", 0.5),
            "p99_le": bucket_quantile(seconds, "Abort", 0.99)},
        "probes": probe_report,
        "prompt_tokens_after_abort": int(after_abort),
        "prompt_tokens_after_abort_pct": round(100 * after_abort / max(prompt_tokens, 1), 3),
        "engines_after": states, "drain_s": round(drain, 1),
        "no_block_in_use_or_pinned": all(s["used"] == 0 and s["pinned"] == 0 for s in states),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = secrets.token_urlsafe(24)
    os.environ["PDSERVE_INTERNAL_TOKEN"] = token  # handed to the stack's children
    logfile = Path(args.log or tempfile.mkstemp(prefix="abort_storm_", suffix=".log")[1])
    stack = Stack(args.up_flag, args.port, logfile)
    try:
        stack.start(args.startup_timeout_s)
        report = asyncio.run(storm(args, stack, token))
    finally:
        stack.stop()
    report["log"] = str(logfile)
    report["failures_in_log"] = log_failures(logfile.read_text(errors="replace"))
    print(json.dumps(report, indent=2))
    ok = report["failed_control_calls"] == 0 and report["no_block_in_use_or_pinned"] and \
        not any(report["failures_in_log"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
