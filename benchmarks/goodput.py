"""Goodput under latency SLOs (DistServe, OSDI '24) against OpenAI-compatible servers.

Sends a seeded Poisson arrival process of random-token prompts (token-id lists, so the prompt
length is exact, as `vllm bench serve --dataset-name random` makes them) to the streaming
`/v1/completions` at each swept rate, and measures per request TTFT, TPOT = (e2e - TTFT) /
(output tokens - 1), ITLs and e2e. For each SLO (TTFT <= X ms and TPOT <= Y ms) it reports the
attainment (the fraction of sent requests meeting both; failures count as misses) and vLLM
bench's goodput (requests meeting both / duration) per rate; a system's goodput is the highest
swept rate with attainment >= 0.9 (0 if none), with the rate where the attainment curve
crosses 0.9 interpolated linearly beside it.

    # one running server
    .venv/bin/python benchmarks/goodput.py --base-url http://127.0.0.1:8000 \
        --model SmolLM2-135M-Instruct --name pdserve
    # start each server in turn (never both at once): pdserve up, then vLLM from /tmp/vllmenv
    .venv/bin/python benchmarks/goodput.py --systems pdserve,vllm --workload chat

Workloads: `chat` 256-768 prompt tokens, 64-192 output; `long` 1500-3000 in, 64-192 out
(uniform; greedy, ignore_eos). Writes OUT/goodput-<workload>.json, prints a markdown table
and draws OUT/attainment-<workload>.png when matplotlib imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import httpx

MODEL_DIR = Path.home() / ".cache/pdserve/models/SmolLM2-135M-Instruct"
WORKLOADS = {"chat": ((256, 768), (64, 192)), "long": ((1500, 3000), (64, 192))}
"""name -> ((min, max) prompt tokens, (min, max) output tokens), both uniform inclusive."""
MIN_TOKEN_ID = 20
"""Random prompts skip the lowest ids (control tokens) and the tokenizer's special ids."""
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


@dataclass(frozen=True, slots=True)
class Slo:
    name: str
    ttft_ms: float
    tpot_ms: float


DEFAULT_SLOS = (Slo("tight", 1000, 50), Slo("chat", 2000, 100), Slo("relaxed", 4000, 200))


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; times in seconds from its send."""

    ok: bool
    prompt_tokens: int = 0
    max_tokens: int = 0
    usage_prompt_tokens: int | None = None
    """The server's count of prompt tokens (usage); it must equal prompt_tokens."""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


class GoodputEstimate(NamedTuple):
    rate: float
    """The highest swept rate with attainment >= the threshold; 0.0 if none."""
    interpolated: float
    """Where the attainment curve crosses the threshold, linear between the two rates around
    `rate`; `rate` itself when no swept rate passes or the highest one does."""
    bracket: Literal["within", "below", "above"]
    """`below`: even the lowest rate fails; `above`: the highest swept rate still passes."""


# ---- statistics: pure functions of the records -------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def compute_tpot(e2e: float, ttft: float, output_tokens: int) -> float:
    """(e2e - TTFT) / (output tokens - 1); 0.0 for a single token, as vLLM bench counts it."""
    return (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    return (record.ok and record.ttft is not None and record.tpot is not None
            and record.ttft * 1000 <= slo.ttft_ms and record.tpot * 1000 <= slo.tpot_ms)


def attainment(records: list[RequestRecord], slo: Slo) -> float:
    """The fraction of all sent requests (failed ones included) meeting both bounds."""
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else 0.0


def goodput_rps(records: list[RequestRecord], slo: Slo, duration: float) -> float:
    """vLLM bench's goodput: requests meeting both bounds per second of the run."""
    return sum(meets_slo(r, slo) for r in records) / duration if duration > 0 else 0.0


def estimate_goodput(points: list[tuple[float, float]], threshold: float = 0.9
                     ) -> GoodputEstimate:
    """The system's goodput from (rate, attainment) points of one SLO (any order)."""
    pts = sorted(points)
    passing = [i for i, (_, a) in enumerate(pts) if a >= threshold]
    if not passing:
        return GoodputEstimate(0.0, 0.0, "below")
    k = passing[-1]
    r0, a0 = pts[k]
    if k == len(pts) - 1:
        return GoodputEstimate(r0, r0, "above")
    r1, a1 = pts[k + 1]
    return GoodputEstimate(r0, r0 + (a0 - threshold) / (a0 - a1) * (r1 - r0), "within")


def _ms(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q}": (None if (p := percentile(values, q)) is None else p * 1000) for q in qs}


def summarize_rate(records: list[RequestRecord], duration: float, rate: float,
                   slos: tuple[Slo, ...]) -> dict:
    """One rate's summary (latencies in ms over the successful requests)."""
    ok = [r for r in records if r.ok]
    return {
        "rate": rate, "num_requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok),
        "short_outputs": sum(r.output_tokens != r.max_tokens for r in ok),
        "prompt_length_mismatches": sum(r.usage_prompt_tokens not in (None, r.prompt_tokens)
                                        for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _ms([x for r in ok for x in r.itl], (50, 99)),
        "e2e_ms": _ms([r.e2e for r in ok if r.e2e is not None], (50, 99)),
        "attainment": {s.name: attainment(records, s) for s in slos},
        "goodput_rps": {s.name: goodput_rps(records, s, duration) for s in slos},
        "errors": sorted({r.error for r in records if r.error})[:3],
    }


def summarize_system(rate_summaries: list[dict], slos: tuple[Slo, ...],
                     threshold: float = 0.9) -> dict:
    """SLO name -> the system's goodput estimate over its swept rates."""
    return {s.name: estimate_goodput([(r["rate"], r["attainment"][s.name])
                                      for r in rate_summaries], threshold)._asdict()
            for s in slos}


def goodput_ratios(a: dict, b: dict) -> dict:
    """SLO name -> a / b of the goodput estimates (None where b's is 0)."""
    def div(x: float, y: float) -> float | None:
        return x / y if y else None
    return {name: {"rate": div(a[name]["rate"], b[name]["rate"]),
                   "interpolated": div(a[name]["interpolated"], b[name]["interpolated"])}
            for name in a if name in b}


# ---- workload ----------------------------------------------------------------------------

def allowed_token_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in range(MIN_TOKEN_ID, len(tokenizer)) if i not in special]


def sample_requests(token_ids: list[int], workload: str, n: int, seed: int
                    ) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs, reproducible for a seed."""
    (in_lo, in_hi), (out_lo, out_hi) = WORKLOADS[workload]
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        reqs.append((rng.choices(token_ids, k=n_in), n_out))
    return reqs


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of n Poisson arrivals: the first at 0, then exponential
    gaps of mean 1/rate (vLLM bench's order: send, then wait)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- client ------------------------------------------------------------------------------

async def stream_one(client: httpx.AsyncClient, model: str, prompt: list[int],
                     max_tokens: int) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec = RequestRecord(ok=False, prompt_tokens=len(prompt), max_tokens=max_tokens)
    t0 = time.perf_counter()
    last, usage, chunks = t0, None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    return rec
                usage = chunk.get("usage") or usage
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec.e2e = time.perf_counter() - t0
    rec.output_tokens = (usage or {}).get("completion_tokens", chunks)
    rec.usage_prompt_tokens = (usage or {}).get("prompt_tokens")
    if rec.ttft is None:
        rec.error = "no token streamed"
        return rec
    rec.tpot = compute_tpot(rec.e2e, rec.ttft, rec.output_tokens)
    rec.ok = True
    return rec


async def run_rate(client: httpx.AsyncClient, model: str, reqs: list[tuple[list[int], int]],
                   offsets: list[float]) -> tuple[list[RequestRecord], float]:
    """Send reqs at offsets; (records in send order, seconds from the first send to the last
    answer)."""
    start = time.perf_counter()
    tasks = []
    for (prompt, max_tokens), at in zip(reqs, offsets):
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(stream_one(client, model, prompt, max_tokens)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def sweep(base_url: str, model: str, token_ids: list[int], args,
                slos: tuple[Slo, ...]) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        warm = sample_requests(token_ids, args.workload, 3, args.seed - 1)
        for rec in [await stream_one(client, model, p, 16) for p, _ in warm]:
            if not rec.ok:
                print(f"  warm-up failed: {rec.error}", flush=True)
        for i, rate in enumerate(args.rates):
            seed = args.seed + i
            reqs = sample_requests(token_ids, args.workload, args.num_prompts, seed)
            records, duration = await run_rate(client, model, reqs,
                                               poisson_offsets(len(reqs), rate, seed))
            s = summarize_rate(records, duration, rate, slos)
            s["seed"] = seed
            s["requests"] = [{k: v for k, v in asdict(r).items() if k != "itl"}
                             for r in records]
            print(f"  rate {rate:g}: {s['completed']}/{s['num_requests']} done in "
                  f"{duration:.1f} s; TTFT p50 {_fmt(s['ttft_ms']['p50'])} ms, TPOT p50 "
                  f"{_fmt(s['tpot_ms']['p50'])} ms; attainment "
                  + ", ".join(f"{k} {v:.2f}" for k, v in s["attainment"].items()), flush=True)
            out.append(s)
    return out


# ---- servers -----------------------------------------------------------------------------

class Server:
    """`pdserve up` or `vllm serve` as a child in its own process group."""

    def __init__(self, system: str, args, log_path: Path) -> None:
        self.system, self.port, self.log_path = system, args.port, log_path
        self.url = f"http://127.0.0.1:{args.port}"
        name = args.model or args.model_dir.name
        if system == "pdserve":
            self.cmd = [str(args.pdserve_bin), "up", "--model", str(args.model_dir), "--port",
                        str(args.port), "--max-model-len", "4096", "--dtype", args.dtype,
                        *shlex.split(args.pdserve_flags)]
            self.env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            self.stop_signal = signal.SIGTERM
        else:
            self.cmd = [str(args.vllm_venv / "bin/vllm"), "serve", str(args.model_dir),
                        "--dtype", args.dtype, "--max-model-len", "4096",
                        "--served-model-name", name, "--host", "127.0.0.1",
                        "--port", str(args.port), *shlex.split(args.vllm_flags)]
            self.env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1"}
            self.stop_signal = signal.SIGINT
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> str:
        """Start the server and wait until it serves; returns the served model name."""
        print(f"[{self.system}] {shlex.join(self.cmd)} (log {self.log_path})", flush=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        t0, deadline = time.monotonic(), time.monotonic() + timeout
        paths = ["/health", "/v1/models"] if self.system == "pdserve" else ["/v1/models"]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                rs = [httpx.get(self.url + p, timeout=5) for p in paths]
                if all(r.status_code == 200 for r in rs):
                    model = rs[-1].json()["data"][0]["id"]
                    print(f"[{self.system}] ready in {time.monotonic() - t0:.0f} s, serves "
                          f"{model}", flush=True)
                    return model
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.system} not ready after {timeout:.0f} s; see {self.log_path}")

    def stop(self, timeout: float = 60.0) -> None:
        """pdserve up: SIGTERM (it drains its children); vLLM: SIGINT to its group; SIGKILL
        to the group after `timeout` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        print(f"[{self.system}] stopping ({self.stop_signal.name})", flush=True)
        if self.system == "pdserve":
            self.proc.send_signal(self.stop_signal)
        else:
            os.killpg(self.proc.pid, self.stop_signal)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"[{self.system}] still running after {timeout:.0f} s: SIGKILL", flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for _ in range(30):  # the port is free before the next server starts
            try:
                httpx.get(self.url + "/v1/models", timeout=2)
            except httpx.HTTPError:
                break
            time.sleep(1.0)


# ---- output ------------------------------------------------------------------------------

def _fmt(x: float | None, f: str = ".0f") -> str:
    return "-" if x is None else format(x, f)


def markdown_table(summary: dict) -> str:
    names = [s["name"] for s in summary["slos"]]
    lines = ["| system | rate | done | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms | "
             + " | ".join(f"attain {n}" for n in names) + " |",
             "|---" * (6 + len(names)) + "|"]
    for system, res in summary["systems"].items():
        for r in res.get("rates", []):
            lines.append(
                f"| {system} | {r['rate']:g} | {r['completed']}/{r['num_requests']} | "
                f"{_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'])} | "
                f"{_fmt(r['tpot_ms']['p50'])} / {_fmt(r['tpot_ms']['p99'])} | "
                f"{_fmt(r['itl_ms']['p99'])} | "
                + " | ".join(f"{r['attainment'][n]:.2f}" for n in names) + " |")
    systems = [s for s, res in summary["systems"].items() if "goodput" in res]
    lines += ["", "| SLO (TTFT / TPOT ms) | " + " | ".join(
        f"{s} goodput (interp.) req/s" for s in systems)
        + (" | pdserve / vLLM |" if summary.get("ratios") else " |"),
        "|---" * (1 + len(systems) + bool(summary.get("ratios"))) + "|"]
    for slo in summary["slos"]:
        n = slo["name"]
        cells = [f"{summary['systems'][s]['goodput'][n]['rate']:g} "
                 f"({summary['systems'][s]['goodput'][n]['interpolated']:.2f}"
                 f"{'+' if summary['systems'][s]['goodput'][n]['bracket'] == 'above' else ''})"
                 for s in systems]
        if summary.get("ratios"):
            ratio = summary["ratios"][n]
            cells.append(f"{_fmt(ratio['rate'], '.2f')} ({_fmt(ratio['interpolated'], '.2f')})")
        lines.append(f"| {n} ({slo['ttft_ms']:g} / {slo['tpot_ms']:g}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_attainment(summary: dict, path: Path) -> None:
    """Attainment vs rate, one panel per SLO, one line per system (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = summary["slos"]
    fig, axes = plt.subplots(1, len(slos), figsize=(4.2 * len(slos), 3.6), squeeze=False)
    for ax, slo in zip(axes[0], slos):
        for system, res in summary["systems"].items():
            rates = res.get("rates", [])
            if rates:
                ax.plot([r["rate"] for r in rates],
                        [r["attainment"][slo["name"]] for r in rates], marker="o", label=system)
        ax.axhline(summary["threshold"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{slo['name']}: TTFT<={slo['ttft_ms']:g} ms, TPOT<={slo['tpot_ms']:g} ms",
                     fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"workload {summary['workload']}, {summary['num_prompts']} requests per rate",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------

def parse_slo(text: str) -> Slo:
    name, ttft, tpot = text.split(":")
    return Slo(name, float(ttft), float(tpot))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="measure this running server")
    ap.add_argument("--model", help="served model name (default: the model dir's name)")
    ap.add_argument("--name", default="server", help="the system's name with --base-url")
    ap.add_argument("--systems", help="start and measure these in turn: pdserve,vllm")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--rates", default="0.4,0.6,0.8,1.0",
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", type=parse_slo, action="append",
                    help="NAME:TTFT_MS:TPOT_MS, repeatable (replaces the default grid)")
    ap.add_argument("--threshold", type=float, default=0.9, help="attainment that counts")
    ap.add_argument("--out", type=Path, default=Path("/tmp/pdserve-goodput"))
    ap.add_argument("--port", type=int, default=8231, help="port of the servers it starts")
    ap.add_argument("--pdserve-flags", default="", help="extra `pdserve up` flags")
    ap.add_argument("--pdserve-bin", type=Path,
                    default=Path(__file__).resolve().parents[1] / ".venv" / "bin" / "pdserve")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllmenv"))
    ap.add_argument("--vllm-flags", default="", help="extra `vllm serve` flags")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both servers' --dtype (bfloat16: vLLM's default on CPU)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    args = ap.parse_args()
    if bool(args.base_url) == bool(args.systems):
        ap.error("give exactly one of --base-url or --systems")
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so the server this started is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    slos = tuple(args.slo or DEFAULT_SLOS)
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    token_ids = allowed_token_ids(AutoTokenizer.from_pretrained(args.model_dir))
    summary: dict = {"workload": args.workload, "num_prompts": args.num_prompts,
                     "rates": args.rates, "seed": args.seed, "threshold": args.threshold,
                     "slos": [asdict(s) for s in slos], "systems": {}}
    systems = [args.name] if args.base_url else args.systems.split(",")
    for system in systems:
        print(f"== {system}: workload {args.workload}, rates {args.rates}", flush=True)
        server = None
        try:
            if args.base_url:
                url, model = args.base_url, args.model or args.model_dir.name
            elif system == "vllm" and not (args.vllm_venv / "bin/vllm").exists():
                print(f"[vllm] skipped: no {args.vllm_venv}/bin/vllm", flush=True)
                summary["systems"][system] = {"skipped": "vllm not installed"}
                continue
            elif system not in ("pdserve", "vllm"):
                raise SystemExit(f"unknown system {system!r}: pdserve or vllm")
            else:
                server = Server(system, args, args.out / f"{system}-{args.workload}.log")
                url, model = server.url, server.start(args.startup_timeout)
            rates = asyncio.run(sweep(url, model, token_ids, args, slos))
            summary["systems"][system] = {
                "base_url": url, "model": model, "rates": rates,
                "goodput": summarize_system(rates, slos, args.threshold)}
        except RuntimeError as e:
            print(f"[{system}] failed: {e}", flush=True)
            summary["systems"][system] = {"error": str(e)}
        finally:
            if server is not None:
                server.stop()
    res = summary["systems"]
    if "goodput" in res.get("pdserve", {}) and "goodput" in res.get("vllm", {}):
        summary["ratios"] = goodput_ratios(res["pdserve"]["goodput"], res["vllm"]["goodput"])
    json_path = args.out / f"goodput-{args.workload}.json"
    json_path.write_text(json.dumps(summary, indent=1))
    print("\n" + markdown_table(summary) + "\n")
    print(f"JSON: {json_path}")
    try:
        plot_attainment(summary, args.out / f"attainment-{args.workload}.png")
        print(f"plot: {args.out / f'attainment-{args.workload}.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed here")


if __name__ == "__main__":
    main()
