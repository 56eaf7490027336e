"""Where mixed64 throughput goes: the step's matmuls, the engine, the split stack, in one run.

Parts (all on this machine, same run; quote ratios, the machine is shared and noisy):

  c  the step's weight matmuls alone (every layer's 2-D weights: qkv / o / gate_up / down,
     plus the LM head) on [rows, hidden] inputs, median of repeats: GFLOP/s at 64 rows (a
     batch-64 decode step, the reference), 1 row and 2048 rows (a full prefill step).
  a  mixed64 through the offline engine (`shared.llm.LLM`'s EngineCore) in this process,
     --threads torch threads, all requests at once: wall, output tok/s, TTFT / ITL at step
     granularity, effective GFLOP/s = (prompt + output tokens) x GFLOP/token / wall, its
     ratio to (c), the step's phases (schedule / execute / update), and the KV memory report
     of kv_memory.py (internal fragmentation, contiguous reservation).
  p  prefix32 through the same offline engine: blocks saved by prefix sharing vs a
     contiguous reservation (kv_memory.py).
  b  the full stack: `pdserve up` (--up-flags), ../shared/bench/loadgen.py's mixed64 as a
     subprocess (its JSON), and the split counters from the services' and the gateway's
     Prometheus /metrics (deltas over the workload): requests prefilled by the prefill
     service and handed over, KV blocks / bytes sent and received, requests prefilled
     locally on decode.
  d  the same stack without the split: `pdserve up --no-cpu-split
     --local-prefill-threshold 1000000000`: every request is prefilled and decoded by the
     decode engine (on both cores: with the core share the idle prefill engine takes none;
     without it --no-cpu-split unbinds), through the gateway. (a) -> (d) is the gateway /
     serving loss, (d) -> (b) the split's.

The split counters: a prompt whose uncached part is shorter than the gateway's
--local-prefill-threshold is prefilled on decode by design (`pdserve up` may set a default;
the gateway's logged config says which, reported as gateway_local_prefill_threshold).
"split_is_real" = the prefill service handed requests to decode and their KV arrived there,
block for block; "requests_accounted" = handed over + prefilled locally = requests sent.

So: (c) -> (a) the engine (non-matmul work, scheduling); (a) -> (d) gateway; (d) -> (b) split.

    .venv/bin/python benchmarks/breakdown.py [--parts c,a,p,b,d] [--seed 0]
        [--num-requests 8] [--port 8179] [--up-flags "--kv-cache-memory 2GiB ..."]
        [--json out.json] [--outdir /tmp/pdserve-breakdown]

--num-requests N (< 64) runs only the first N mixed64 / prefix32 requests (a smoke test);
for (b) / (d) it then drives them with loadgen.py's own request code in this process
(loadgen.py has no request-count option). The readable table goes to stderr, the JSON
summary to stdout (and --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_loop import (  # noqa: E402
    DEFAULT_LOADGEN,
    gflop_per_token,
    load_loadgen,
    run_engine,
    weight_matrices,
    workload_requests,
)
from benchmarks.kv_memory import (  # noqa: E402
    KVSampler,
    format_fragmentation,
    format_sharing,
    measure,
)

DEFAULT_UP_FLAGS = "--kv-cache-memory 2GiB --max-model-len 2048"
NO_SPLIT_FLAGS = "--no-cpu-split --local-prefill-threshold 1000000000"


def log(msg: str) -> None:
    print(f"[breakdown {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- (c) matmuls ----------------------------------------------------------------------------

def matmul_rate(model, rows: int, reps: int, warmup: int = 2, packed: bool = False) -> dict:
    """Every layer's weight matmuls + the LM head on [rows, in_features] inputs, with
    F.linear, or (packed) with the oneDNN-prepacked weights the engine runs on CPU
    (kernels/cpu_linear.py)."""
    import torch
    import torch.nn.functional as F

    from pdserve.kernels import cpu_linear

    layer_weights, lm_head = weight_matrices(model)
    weights = [*layer_weights, lm_head]
    if packed:
        packs = {id(w): cpu_linear.pack_weight(w) for w in weights}

        def mm(x, w):
            return cpu_linear.linear(x, packs[id(w)])
    else:
        mm = F.linear
    gen = torch.Generator().manual_seed(0)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen, dtype=w.dtype)
              for w in weights}
    flop = 2.0 * rows * sum(w.numel() for w in weights)
    times = []
    with torch.inference_mode():
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            for w in weights:
                mm(inputs[w.shape[1]], w)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"rows": rows, "reps": reps, "gflop": round(flop / 1e9, 3),
            "median_s": round(med, 5), "min_s": round(min(times), 5),
            "gflop_per_s": round(flop / 1e9 / med, 1),
            "gflop_per_s_best": round(flop / 1e9 / min(times), 1)}


def part_c(model, args) -> dict:
    out = {"weights": "every layer's 2-D weights (qkv, o, gate_up, down) + the LM head",
           "threads": args.threads}
    for rows in sorted({1, 64, *args.matmul_rows}):
        reps = args.prefill_reps if rows >= 1024 else args.matmul_reps
        log(f"(c) matmuls at {rows} rows x {reps}")
        out[f"rows_{rows}"] = matmul_rate(model, rows, reps)
        if cpu_linear_available():
            out[f"packed_rows_{rows}"] = matmul_rate(model, rows, reps, packed=True)
    # NOTE: the reference is the faster of the two GEMMs at 64 rows (stricter for the engine,
    # which runs the packed one).
    out["reference_gflop_per_s"] = max(out["rows_64"]["gflop_per_s"],
                                       out.get("packed_rows_64", {}).get("gflop_per_s", 0.0))
    return out


def cpu_linear_available() -> bool:
    from pdserve.kernels import cpu_linear

    return cpu_linear.is_enabled() and cpu_linear.is_available()


# -- (a) / (p) the offline engine -----------------------------------------------------------

def part_a(llm, args, gpt: float) -> dict:
    reqs = workload_requests("mixed64", args.seed, args.prompts, args.num_requests,
                             args.loadgen)
    log(f"(a) mixed64 in-process: {len(reqs)} requests")
    sampler = KVSampler(args.max_model_len)
    run = run_engine(llm, reqs, sampler, tag="a")
    run["gflop"] = round((run["prompt_tokens"] + run["output_tokens"]) * gpt, 1)
    run["effective_gflop_per_s"] = round(run["gflop"] / run["wall_s"], 1)
    execute = run["phase_s"]["execute"]
    run["gflop_per_s_in_execute"] = round(run["scheduled_tokens"] * gpt / execute, 1) \
        if execute else None
    run["kv_memory"] = sampler.fragmentation()
    return run


def part_p(llm, args) -> dict:
    log("(p) prefix32 in-process (KV sharing)")
    return measure(llm, "prefix32", args.seed, args.prompts, args.num_requests,
                   args.max_model_len, args.loadgen, tag="p")


# -- (b) / (d) the full stack ---------------------------------------------------------------

_BANNER_ROW = re.compile(r"^\s*(prefill|decode)-(\d+)\s+grpc\s+(\S+)\s+metrics\s+(\S+)")
_READY = re.compile(r"pdserve is ready in .*?: (\S+)/v1 serves (\S+)")
_REDIS_ROW = re.compile(r"^\s*redis\s+redis://[^\s:]+:(\d+)")


class Stack:
    """`pdserve up` as a child process (its own session); stop() drains it with SIGTERM."""

    def __init__(self, flags: list[str], port: int, logfile: Path,
                 python: str = sys.executable) -> None:
        """`python`: the interpreter whose pdserve runs (another checkout's venv: A/B of two
        commits, benchmarks/stack_ab.py --a-checkout)."""
        exe = Path(python).with_name("pdserve")
        cmd = [str(exe)] if exe.exists() else [python, "-m", "pdserve.services.cli"]
        self.cmd = [*cmd, "up", "--port", str(port), *flags]
        self.logfile = logfile
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.model = ""
        self.redis_port: int | None = None
        self.engines: dict[str, dict] = {}
        """name -> {"role", "grpc", "metrics"} from the ready banner."""

    def start(self, timeout: float) -> None:
        log("starting: " + shlex.join(self.cmd))
        self._log = open(self.logfile, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.proc.returncode}; see "
                                   f"{self.logfile}")
            text = self.logfile.read_text(errors="replace")
            m = _READY.search(text)
            if m:
                self.url, self.model = m.group(1), m.group(2)
                for line in text.splitlines():
                    if m_redis := _REDIS_ROW.match(line):
                        self.redis_port = int(m_redis[1])
                    row = _BANNER_ROW.match(line)
                    if row:
                        self.engines[f"{row[1]}-{row[2]}"] = {
                            "role": row[1], "grpc": row[3], "metrics": row[4]}
                if self._healthy():
                    log(f"ready: {self.url} serves {self.model}; engines "
                        + ", ".join(f"{k} {v['metrics']}" for k, v in self.engines.items()))
                    return
            time.sleep(1.0)
        raise RuntimeError(f"pdserve up not ready after {timeout:.0f} s; see {self.logfile}")

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        ports = [int(p) for e in self.engines.values()
                 for p in (e["grpc"].rsplit(":", 1)[1], e["metrics"].rsplit(":", 2)[-1]
                           .split("/")[0])]
        if self.proc.poll() is None:
            log("stopping pdserve up (SIGTERM)")
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log("still running: a second signal (the launcher then kills its children)")
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        self._log.close()
        if self.redis_port:
            ports.append(self.redis_port)
        for pid in _pids_listening_on([self.port, *ports]):
            log(f"left behind: pid {pid}; SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None


def _pids_listening_on(ports: list[int]) -> list[int]:
    """Processes whose command line names one of `ports` after --port / --metrics-port
    (the children `pdserve up` started for this run), by /proc."""
    wanted = {str(p) for p in ports}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "pdserve.services.cli" not in args and not any(a.endswith("redis-server") for a in args):
            continue
        for flag, value in zip(args, args[1:]):
            if flag in ("--port", "--metrics-port") and value in wanted:
                pids.append(int(entry.name))
                break
    return pids


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root` (by /proc/PID/task/*/children)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append(int(k))
                todo.append(int(k))
    return out


def process_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of each process under `root`, by its name in the stack
    (prefill / decode / gateway / redis / launcher), summed over processes of one name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in [root, *_descendants(root)]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        args = [a.decode(errors="replace") for a in argv]
        name = "launcher" if pid == root else "other"
        if "serve" in args[:-1]:
            name = args[args.index("serve") + 1]
        if any(a.endswith("redis-server") or a.startswith("redis-server") for a in args):
            name = "redis"
        out[name] = round(out.get(name, 0.0) + cpu, 2)
    return out


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples as {"name{label=value,...}": value}, model_name dropped."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "le"))
            if "le" in s.labels or s.name.endswith("_created"):
                continue
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def scrape_all(stack: Stack) -> dict[str, dict[str, float]]:
    snap = {name: scrape(e["metrics"]) for name, e in stack.engines.items()}
    snap["gateway"] = scrape(stack.url + "/metrics")
    return snap


def _delta(before: dict, after: dict, role: str, key: str) -> float:
    """The sum over `role`'s instances (prefill / decode / gateway) of after - before."""
    return sum(after[n].get(key, 0.0) - before.get(n, {}).get(key, 0.0)
               for n in after if n == role or n.startswith(role + "-"))


def split_counters(before: dict, after: dict, n_requests: int) -> dict:
    """The counters that show whether the prefill/decode split really happened."""
    def d(role: str, key: str) -> int:
        return int(round(_delta(before, after, role, key)))

    prefill_done = {k.split("finished_reason=")[1].rstrip("}"): d("prefill", k)
                    for k in after.get(next((n for n in after if n.startswith("prefill")),
                                            ""), {})
                    if k.startswith("pdserve_request_success_total{")}
    gateway_routes = {k[len("pdserve_gateway_requests_total"):]: d("gateway", k)
                      for k in after.get("gateway", {})
                      if k.startswith("pdserve_gateway_requests_total{")}
    out = {
        "source": "deltas of the services' /metrics (services/common/metrics.py) and the "
                  "gateway's (services/gateway/metrics.py) over the workload",
        "prefill_requests_prefilled": d("prefill", "pdserve_time_to_first_token_seconds_count"),
        "prefill_requests_handed_to_decode": prefill_done.get("transferred", 0),
        "prefill_requests_by_finish": {k: v for k, v in prefill_done.items() if v},
        "prefill_prompt_tokens": d("prefill", "pdserve_prompt_tokens_total"),
        "prefill_prefix_cache_hit_tokens": d("prefill", "pdserve_prefix_cache_hits_total"),
        "kv_blocks_sent": d("prefill", "pdserve_kv_transfer_blocks_sent_total"),
        "kv_bytes_sent": d("prefill", "pdserve_kv_transfer_bytes_sent_total"),
        "kv_transfers_received": d("decode", "pdserve_kv_transfer_seconds_count"),
        "kv_blocks_received": d("decode", "pdserve_kv_transfer_blocks_received_total"),
        "kv_bytes_received": d("decode", "pdserve_kv_transfer_bytes_received_total"),
        "kv_transfer_seconds_sum": round(_delta(before, after, "decode",
                                                "pdserve_kv_transfer_seconds_sum"), 3),
        # NOTE: the decode service observes TTFT only for a request it prefilled itself
        # (services/decode/worker.py, _decode), and counts prompt tokens only for those.
        "decode_requests_prefilled_locally": d("decode",
                                               "pdserve_time_to_first_token_seconds_count"),
        "decode_local_prompt_tokens": d("decode", "pdserve_prompt_tokens_total"),
        "decode_requests_finished": d("decode", "pdserve_e2e_request_latency_seconds_count"),
        "decode_generation_tokens": d("decode", "pdserve_generation_tokens_total"),
        "decode_preemptions": d("decode", "pdserve_num_preemptions_total"),
        "gateway_requests": {k: v for k, v in gateway_routes.items() if v},
        "gateway_prompt_tokens": d("gateway", "pdserve_gateway_prompt_tokens_total"),
        "gateway_generation_tokens": d("gateway", "pdserve_gateway_generation_tokens_total"),
    }
    # NOTE: prompts shorter than the gateway's --local-prefill-threshold (pdserve up may set
    # one by default) are prefilled on decode by design, so "real" = the prefill service
    # handed requests over and their KV arrived, block for block.
    out["split_is_real"] = (out["prefill_requests_handed_to_decode"] > 0
                            and out["kv_blocks_received"] > 0
                            and out["kv_blocks_received"] == out["kv_blocks_sent"])
    out["requests_accounted"] = (out["prefill_requests_handed_to_decode"]
                                 + out["decode_requests_prefilled_locally"] == n_requests)
    return out


def engine_states(stack: Stack) -> dict:
    """GetState of each engine after the run (blocks used / pinned: leak check)."""
    import grpc

    from pdserve.services.proto import engine_pb2 as pb
    from pdserve.services.proto import engine_pb2_grpc as pb_grpc

    out = {}
    for name, e in stack.engines.items():
        stub_cls = (pb_grpc.PrefillServiceStub if e["role"] == "prefill"
                    else pb_grpc.DecodeServiceStub)
        try:
            with grpc.insecure_channel(e["grpc"]) as ch:
                s = stub_cls(ch).GetState(pb.GetStateRequest(check_invariants=True),
                                          timeout=30)
            out[name] = {"num_gpu_blocks": s.num_gpu_blocks, "used": s.num_used_blocks,
                         "pinned": s.num_pinned_blocks, "cached": s.num_cached_blocks,
                         "running": s.num_running, "waiting": s.num_waiting,
                         "invariants_ok": s.invariants_ok}
        except grpc.RpcError as err:
            out[name] = {"error": f"{err.code().name}: {err.details()}"}
    return out


def run_loadgen(args, stack: Stack) -> dict:
    """mixed64 with loadgen.py: a subprocess for the whole workload; for a --num-requests
    subset, loadgen's own request code in this process (it has no request-count flag)."""
    if not args.num_requests or args.num_requests >= 64:
        cmd = [sys.executable, str(args.loadgen or DEFAULT_LOADGEN), "--base-url", stack.url,
               "--model", stack.model, "--workload", "mixed64", "--seed", str(args.seed),
               "--warmup", "0"]
        log("loadgen: " + shlex.join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
        out = json.loads(done.stdout)
        out["harness"] = "loadgen.py subprocess"
        return out
    lg = load_loadgen(args.loadgen)
    reqs = lg.build_workload("mixed64", args.seed, 5)[:args.num_requests]
    ns = SimpleNamespace(base_url=stack.url, model=stack.model, no_ignore_eos=False)
    log(f"loadgen.one_request x {len(reqs)} (subset, in-process)")

    async def go():
        import httpx

        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(lg.one_request(client, ns, r) for r in reqs))
            return res, time.perf_counter() - t0

    results, wall = asyncio.run(go())
    ok = [r for r in results if r["error"] is None]
    n_out = sum(r["output_tokens"] for r in ok)
    prompt = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    return {"harness": "loadgen.one_request in-process (subset)", "workload": "mixed64",
            "seed": args.seed, "n_requests": len(results), "n_errors": len(results) - len(ok),
            "errors": [r["error"] for r in results if r["error"]][:5],
            "wall_s": round(wall, 3), "total_prompt_tokens": sum(prompt) if prompt else None,
            "total_output_tokens": n_out, "output_tok_per_s": round(n_out / wall, 2),
            "ttft_ms": lg.stats([r["ttft_s"] for r in ok]),
            "itl_ms": lg.stats([x for r in ok for x in r["itl_s"]]),
            "tpot_ms": lg.stats([r["tpot_s"] for r in ok]),
            "e2e_ms": lg.stats([r["e2e_s"] for r in ok])}


def part_stack(args, label: str, flags: list[str], gpt: float) -> dict:
    stack = Stack(flags, args.port, Path(args.outdir) / f"pdserve-up-{label}.log")
    try:
        stack.start(args.startup_timeout)
        import httpx

        r = httpx.post(stack.url + "/v1/completions", timeout=120, json={
            "model": stack.model, "prompt": "Warm up request. Hello", "max_tokens": 8,
            "temperature": 0})
        r.raise_for_status()
        before = scrape_all(stack)
        import resource

        cpu_before = process_cpu_seconds(stack.proc.pid)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        lg_before = ru.ru_utime + ru.ru_stime
        load = run_loadgen(args, stack)
        cpu_after = process_cpu_seconds(stack.proc.pid)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_after["loadgen (client)"] = ru.ru_utime + ru.ru_stime - lg_before
        cpu_used = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in cpu_after.items()}
        time.sleep(1.5)  # the engines publish their polled gauges every interval
        after = scrape_all(stack)
        n = load.get("n_requests", 0)
        m = re.search(r"local_prefill_threshold=(\d+)", stack.logfile.read_text())
        out = {"up_flags": shlex.join(flags), "log": str(stack.logfile),
               "gateway_local_prefill_threshold": int(m[1]) if m else None,
               "engines": stack.engines, "loadgen": load,
               "cpu_seconds": cpu_used,
               "split": split_counters(before, after, n), "engine_state_after":
               engine_states(stack)}
        tokens = (load.get("total_prompt_tokens") or 0) + load.get("total_output_tokens", 0)
        out["gflop"] = round(tokens * gpt, 1)
        out["effective_gflop_per_s"] = round(out["gflop"] / load["wall_s"], 1) \
            if load.get("wall_s") else None
        return out
    finally:
        stack.stop()


# -- the report -----------------------------------------------------------------------------

def _r(x, y) -> float | None:
    return round(x / y, 3) if x and y else None


def table(summary: dict) -> str:
    c, a, b, d = (summary.get(k) for k in ("c_matmul", "a_engine", "b_stack", "d_stack_nosplit"))
    ref = c["reference_gflop_per_s"] if c else None
    lines = [f"breakdown, mixed64 seed {summary['seed']} ({summary['gflop_per_token']:.4f} "
             f"GFLOP/token, {summary['threads']} threads)", ""]
    head = f"{'part':<34} {'wall s':>8} {'out tok/s':>10} {'TTFT p50':>10} {'ITL p50':>9} " \
           f"{'GFLOP/s':>8} {'/ (c)':>6}"
    lines += [head, "-" * len(head)]
    if c:
        for key in sorted((k for k in c if "rows_" in k),
                          key=lambda k: (int(k.split("_")[-1]), k)):
            m = c[key]
            kind = "packed" if key.startswith("packed") else "F.linear"
            lines.append(f"{'(c) matmuls ' + kind + ', ' + str(m['rows']) + ' rows':<34} "
                         f"{m['median_s']:>8.4f} {'':>10} {'':>10} {'':>9} "
                         f"{m['gflop_per_s']:>8.1f} {_r(m['gflop_per_s'], ref) or '':>6}")

    def row(name: str, wall, tps, ttft_ms, itl_ms, gf) -> None:
        def fmt(v, f):
            return format(v, f) if v is not None else "-"
        lines.append(f"{name:<34} {fmt(wall, '8.1f')} {fmt(tps, '10.1f')} "
                     f"{fmt(ttft_ms and ttft_ms / 1000, '9.2f')}s "
                     f"{fmt(itl_ms, '7.0f')}ms {fmt(gf, '8.1f')} {_r(gf, ref) or '-':>6}")

    if a:
        row("(a) engine in-process", a["wall_s"], a["output_tok_per_s"],
            a["ttft_ms"].get("p50"), a["itl_ms"].get("p50"), a["effective_gflop_per_s"])
    for key, name in (("d_stack_nosplit", "(d) pdserve up, no split"),
                      ("b_stack", "(b) pdserve up (split)")):
        s = summary.get(key)
        if s and "loadgen" in s:
            lg = s["loadgen"]
            row(name, lg["wall_s"], lg["output_tok_per_s"], lg["ttft_ms"].get("p50"),
                lg["itl_ms"].get("p50"), s["effective_gflop_per_s"])
        elif s:
            lines.append(f"{name:<34} failed: {s.get('error')}")
    if a:
        p = a["phase_s"]
        lines += ["", f"(a) {a['steps']} steps ({a['steps_decode_only']} decode-only), "
                  f"{a['mean_tokens_per_step']} tokens / {a['mean_decodes_per_step']} decodes "
                  f"per step, {a['preemptions']} preemptions; time: execute {p['execute']} s, "
                  f"schedule {p['schedule']} s, update {p['update']} s, rest of step "
                  f"{p['other']} s, between steps {p['between_steps']} s; GFLOP/s inside "
                  f"execute {a['gflop_per_s_in_execute']}"]
        lines += ["(a) KV memory over the run:", *format_fragmentation(a["kv_memory"])]
    pp = summary.get("p_prefix32")
    if pp:
        lines += [f"(p) prefix32 in-process ({pp['requests']} requests, "
                  f"{pp['run']['wall_s']:.1f} s, {pp['kv']['prefix_cache_hit_tokens']} of "
                  f"{pp['kv']['prompt_tokens']} prompt tokens from the prefix cache):",
                  *format_sharing(pp["kv"])]
    for key, name in (("b_stack", "(b)"), ("d_stack_nosplit", "(d)")):
        s = summary.get(key)
        if s and "split" in s:
            x = s["split"]
            lines += [f"{name} split counters: prefill prefilled "
                      f"{x['prefill_requests_prefilled']} requests "
                      f"({x['prefill_prompt_tokens']} prompt tokens), handed "
                      f"{x['prefill_requests_handed_to_decode']} to decode; KV sent "
                      f"{x['kv_blocks_sent']} blocks / {x['kv_bytes_sent'] / 2**20:.1f} MiB, "
                      f"received {x['kv_blocks_received']} blocks / "
                      f"{x['kv_bytes_received'] / 2**20:.1f} MiB in "
                      f"{x['kv_transfers_received']} transfers; decode prefilled "
                      f"{x['decode_requests_prefilled_locally']} locally (gateway "
                      f"--local-prefill-threshold {s.get('gateway_local_prefill_threshold')}"
                      f"); split is real: {x['split_is_real']}"]
        if s and s.get("cpu_seconds"):
            lines += [f"{name} CPU seconds over the workload: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(s["cpu_seconds"].items()))]
    ratios = summary.get("ratios", {})
    if ratios:
        lines += ["", "ratios: " + ", ".join(f"{k} {v}" for k, v in ratios.items())]
    return "\n".join(lines)


def parse_engine_args(text: str) -> dict:
    """'a=1,b=x,c=true' -> {"a": 1, "b": "x", "c": True}."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="c,a,p,b,d",
                    help="comma-separated subset of c,a,p,b,d (see the module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=None,
                    help="smoke test: only the first N requests of mixed64 / prefix32")
    ap.add_argument("--prompts", choices=["loadgen", "workloads"], default="loadgen",
                    help="in-process prompts: loadgen.py's (what (b) sends) or "
                         "benchmarks/workloads.py's")
    ap.add_argument("--loadgen", default=None, help=f"path of loadgen.py ({DEFAULT_LOADGEN})")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for (a), (c), (p)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--engine-args", default="",
                    help="more EngineArgs for the in-process engine, e.g. "
                         "'scheduling_policy=fcfs,block_size=32'")
    ap.add_argument("--matmul-reps", type=int, default=20)
    ap.add_argument("--prefill-reps", type=int, default=3, help="repeats at >= 1024 rows")
    ap.add_argument("--matmul-rows", default="2048",
                    help="row counts to time besides 1 and 64 (comma-separated; '' for none)")
    ap.add_argument("--port", type=int, default=8179, help="gateway port for (b) / (d)")
    ap.add_argument("--up-flags", default=DEFAULT_UP_FLAGS,
                    help=f"flags for `pdserve up` in (b) and (d) (default: {DEFAULT_UP_FLAGS})")
    ap.add_argument("--nosplit-flags", default=NO_SPLIT_FLAGS,
                    help=f"added to --up-flags for (d) (default: {NO_SPLIT_FLAGS})")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--outdir", default="/tmp/pdserve-breakdown", help="pdserve up logs")
    ap.add_argument("--json", default=None, help="also write the JSON summary here")
    args = ap.parse_args()
    args.matmul_rows = [int(x) for x in args.matmul_rows.split(",") if x.strip()]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if bad := set(parts) - set("capbd"):
        ap.error(f"unknown parts {sorted(bad)} (c, a, p, b, d)")
    Path(args.outdir).mkdir(parents=True, exist_ok=True)

    import torch

    from pdserve.shared.llm import LLM
    from pdserve.shared.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    summary: dict = {"seed": args.seed, "threads": args.threads, "parts": parts,
                     "engine_args": parse_engine_args(args.engine_args),
                     "num_requests": args.num_requests or "all", "prompts": args.prompts,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    llm = LLM(args.model, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
              **parse_engine_args(args.engine_args))
    gpt = gflop_per_token(llm.engine.model_runner.model)
    summary["gflop_per_token"] = round(gpt, 5)
    if "a" in parts or "p" in parts:
        llm.generate(["warm up"], SamplingParams(max_tokens=4))
    for part in parts:
        if part == "c":
            summary["c_matmul"] = part_c(llm.engine.model_runner.model, args)
        elif part == "a":
            summary["a_engine"] = part_a(llm, args, gpt)
        elif part == "p":
            summary["p_prefix32"] = part_p(llm, args)
    if "b" in parts or "d" in parts:
        del llm  # free this process's weights and KV pool before the servers start
        import gc

        gc.collect()
    for part in parts:
        if part not in "bd":
            continue
        flags = shlex.split(args.up_flags)
        if part == "d":
            flags += shlex.split(args.nosplit_flags)
        key = "b_stack" if part == "b" else "d_stack_nosplit"
        try:
            summary[key] = part_stack(args, part, flags, gpt)
        except Exception as e:  # noqa: BLE001 - report it, keep the other parts
            log(f"({part}) failed: {e!r}")
            summary[key] = {"error": repr(e), "up_flags": shlex.join(flags)}

    ref = summary.get("c_matmul", {}).get("reference_gflop_per_s")
    gf = {k: summary.get(k, {}).get("effective_gflop_per_s")
          for k in ("a_engine", "b_stack", "d_stack_nosplit")}
    summary["ratios"] = {k: v for k, v in {
        "engine_over_matmul64": _r(gf["a_engine"], ref),
        "stack_over_matmul64": _r(gf["b_stack"], ref),
        "nosplit_over_engine": _r(gf["d_stack_nosplit"], gf["a_engine"]),
        "stack_over_nosplit": _r(gf["b_stack"], gf["d_stack_nosplit"]),
        "stack_over_engine": _r(gf["b_stack"], gf["a_engine"]),
    }.items() if v is not None}
    if "engine_over_matmul64" in summary["ratios"]:
        summary["engine_reaches_0.75_of_matmul64"] = \
            summary["ratios"]["engine_over_matmul64"] >= 0.75
    print(table(summary), file=sys.stderr)
    text = json.dumps(summary, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
