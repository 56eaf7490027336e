"""Slow and greedy clients (issue 13 item 8): many streaming clients that read very slowly
beside a few normal ones. Reports the gateway's RSS before, at peak and after, the normal
clients' inter-token latency loaded vs unloaded (p50 ratio; target <= 1.5), what the slow
clients got (statuses, streams the gateway cut), and the engine-side backpressure: the
decode instances' paused / running / waiting requests when the loaded phase starts and the
gateway's pauses (pdserve_num_requests_paused, pdserve_gateway_streams_paused_total, read
from the gateway's federated /metrics).

Against a running stack (raise the open-file limit first: every slow client is a socket):

    ulimit -n 8192; .venv/bin/python -m services.cli up --port 8000 \\
        --max-num-queued-requests 2048 &
    .venv/bin/python benchmarks/slow_clients.py --base-url http://127.0.0.1:8000 --slow 1000

or let it start and stop one: `--launch "--max-num-queued-requests 2048"` (flags for
`python -m services.cli up`; the port comes from --base-url).

Phases: 1 warm-up request; the normal clients alone (unloaded ITL); the slow clients open
their connections (receive buffer 4 KiB), send a streamed completion each and then read
--read-bytes every --read-interval s; after --settle s, and once no decode instance runs or
queues a request any more (every slow request paused, cut, finished or refused; at most
--quiesce-timeout s more: the slow clients' first tokens, until each is --stream-pause-bytes
behind, cost the engine like anyone's), the normal clients run again (loaded ITL) while the
gateway's RSS is sampled; the slow clients hang up; --settle s later the RSS is read again.
Paused requests are cut after the gateway's --max-stream-pause-s (60 s): to measure the
normal clients beside paused (not cut) slow ones, run the gateway with a longer one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import percentiles, stream_completion  # noqa: E402


def gateway_pid(port: int) -> int | None:
    """The pid of the gateway process serving `port` (its command line names both)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "gateway" in words and "--port" in words and \
                words[words.index("--port") + 1:][:1] == [str(port)]:
            return int(entry)
    return None


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


async def normal_clients(base_url: str, args) -> list[float]:
    """The normal clients' ITLs (s): --normal concurrent greedy streams of --max-tokens."""
    body = {"model": args.model, "prompt": "Write a long story about the sea.",
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as client:
        results = await asyncio.gather(*(stream_completion(client, body, {})
                                         for _ in range(args.normal)))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a normal client failed: {errors[0]}")
    return [x for r in results for x in r["itl"]]


async def slow_client(host: str, port: int, args, stop: asyncio.Event) -> bytes:
    """One slow reader: what it received until `stop` (or the end of its response)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    got = []
    try:
        await loop.sock_connect(sock, (host, port))
        body = json.dumps({"model": args.model, "prompt": "Tell me everything about rivers.",
                           "max_tokens": args.slow_max_tokens, "ignore_eos": True,
                           "stream": True, "logprobs": args.slow_logprobs or None})
        await loop.sock_sendall(sock, (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode())
        while not stop.is_set():
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, args.read_bytes),
                                              args.read_interval)
            except TimeoutError:
                continue
            if not data:
                break
            got.append(data)
            await asyncio.sleep(args.read_interval)
    except OSError as e:
        got.append(f"\nOSError {e}".encode())
    finally:
        sock.close()
    return b"".join(got)


def classify(raw: bytes) -> str:
    head = raw.split(b"\r\n", 1)[0].decode(errors="replace")
    if not head.startswith("HTTP/1.1"):
        return "no answer" if not raw else head.strip()[:40]
    status = head.split()[1]
    if status != "200":
        return status
    if b'"slow_client"' in raw:
        return "200 cut (error event read)"
    return "200 [DONE]" if b"data: [DONE]" in raw else "200 still streaming"


async def cluster_counts(base_url: str) -> dict:
    """The gateway's cuts and pauses, and the decode instances' paused / running / waiting
    requests (summed), from its federated /metrics."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        text = (await client.get("/metrics")).text

    def total(name: str, decode_only: bool = False) -> float:
        pattern = rf"^{name}(\{{[^}}]*\}})? (\S+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M)
                   if not decode_only or 'role="decode"' in (m.group(1) or ""))
    return {"streams_cut": total("pdserve_gateway_streams_cut_slow_client_total"),
            "pauses": total("pdserve_gateway_streams_paused_total"),
            "decode_paused": total("pdserve_num_requests_paused", True),
            "decode_running": total("pdserve_num_requests_running", True),
            "decode_waiting": total("pdserve_num_requests_waiting", True)}


async def quiesce(base_url: str, timeout: float) -> tuple[float, dict]:
    """Wait until no decode instance runs or queues a request; (seconds waited, counts)."""
    t0 = time.perf_counter()
    while True:
        counts = await cluster_counts(base_url)
        if counts["decode_running"] + counts["decode_waiting"] == 0 or \
                time.perf_counter() - t0 > timeout:
            return time.perf_counter() - t0, counts
        await asyncio.sleep(1.0)


async def run(args) -> dict:
    host, port = args.base_url.removeprefix("http://").rstrip("/").split(":")
    pid = args.gateway_pid or gateway_pid(int(port))
    if pid is None:
        raise SystemExit(f"no gateway process with --port {port} (give --gateway-pid)")
    await normal_clients(args.base_url, argparse.Namespace(**{**vars(args), "normal": 1}))
    unloaded = percentiles(await normal_clients(args.base_url, args))
    rss_before = rss_mib(pid)
    stop = asyncio.Event()
    slow = [asyncio.ensure_future(slow_client(host, int(port), args, stop))
            for _ in range(args.slow)]
    peak = rss_before

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mib(pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.ensure_future(sample())
    await asyncio.sleep(args.settle)
    quiesce_s, at_loaded = await quiesce(args.base_url, args.quiesce_timeout)
    t0 = time.perf_counter()
    loaded = percentiles(await normal_clients(args.base_url, args))
    loaded_s = time.perf_counter() - t0
    rss_loaded = rss_mib(pid)
    after_loaded = await cluster_counts(args.base_url)
    stop.set()
    outcomes = Counter(classify(r) for r in await asyncio.gather(*slow))
    await sampler
    await asyncio.sleep(args.settle)
    return {
        "slow_clients": args.slow, "normal_clients": args.normal,
        "gateway_rss_mib": {"before": round(rss_before, 1), "loaded": round(rss_loaded, 1),
                            "peak": round(peak, 1), "after": round(rss_mib(pid), 1)},
        "itl_p50_s": {"unloaded": unloaded.get("p50"), "loaded": loaded.get("p50")},
        "itl_p50_ratio": (loaded["p50"] / unloaded["p50"]) if unloaded and loaded else None,
        "itl_p90_s": {"unloaded": unloaded.get("p90"), "loaded": loaded.get("p90")},
        "normal_loaded_run_s": round(loaded_s, 2),
        "quiesce_s": round(quiesce_s, 1),
        "at_loaded_start": at_loaded, "at_loaded_end": after_loaded,
        "slow_outcomes": dict(outcomes),
    }


def launch(args) -> subprocess.Popen:
    port = args.base_url.rstrip("/").rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--port", port,
           *shlex.split(args.launch)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{args.base_url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"`{shlex.join(cmd)}` exited with {proc.returncode}")
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    raise SystemExit("the stack did not become healthy in 900 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--slow", type=int, default=1000, help="slow clients")
    ap.add_argument("--normal", type=int, default=4, help="normal clients (concurrent)")
    ap.add_argument("--max-tokens", type=int, default=64, help="per normal request")
    ap.add_argument("--slow-max-tokens", type=int, default=1024, help="per slow request")
    ap.add_argument("--slow-logprobs", type=int, default=0,
                    help="logprobs of the slow requests (larger events: cut sooner)")
    ap.add_argument("--read-bytes", type=int, default=16, help="a slow client's read size")
    ap.add_argument("--read-interval", type=float, default=1.0, help="s between its reads")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="s the slow clients run before the loaded phase, and after they hang up")
    ap.add_argument("--quiesce-timeout", type=float, default=300.0,
                    help="s to wait, after --settle, for the decode instances to run and "
                         "queue nothing (slow requests paused or cut) before the loaded phase")
    ap.add_argument("--gateway-pid", type=int, default=None, help="default: found by port")
    ap.add_argument("--launch", default=None, metavar="UP_FLAGS",
                    help="start `python -m services.cli up` with these flags, stop it after")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.slow + 1024)), hard))
    proc = launch(args) if args.launch is not None else None
    try:
        print(json.dumps(asyncio.run(run(args)), indent=2))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(120)


if __name__ == "__main__":
    main()
