"""scripts/gpu_check.sh's bookkeeping (standard library only, any python3):

    gpu_check_report.py junit XML --expect passed|skipped --out FILE
        pytest's junit counts into FILE (JSON); exit 1 unless tests were collected, none
        failed or errored, and all of them passed (--expect passed) or skipped (skipped).
    gpu_check_report.py summary --steps TSV --data DIR --out FILE [--table] [--meta k=v ...]
        the steps' results (TSV: name, status, rc, seconds, note) with each step's numbers
        (DIR/<name>.json, when there) into FILE; with --table, a short table on stdout.
    gpu_check_report.py markdown JSON [JSON ...]
        the numbers of one or more gpu_check.json files (stage 1's and stage 2's; a step in
        a later file wins) as a Markdown section for docs/benchmarks.md, on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] \
        - counts["skipped"]
    counts["time_s"] = sum(float(s.get("time", 0)) for s in suites)
    return counts


def cmd_junit(ns: argparse.Namespace) -> int:
    try:
        counts = junit_counts(Path(ns.xml))
    except (OSError, ET.ParseError) as e:
        print(f"gpu_check: no junit report ({e})")
        return 1
    counts["expect"] = ns.expect
    Path(ns.out).write_text(json.dumps(counts) + "\n")
    ok = (counts["tests"] > 0 and counts["failures"] == 0 and counts["errors"] == 0
          and counts[ns.expect] == counts["tests"])
    print(f"gpu_check: junit {json.dumps(counts)} -> {'ok' if ok else 'NOT ok'}")
    return 0 if ok else 1


def detail(name: str, data: dict | None) -> str:
    """One short cell of the table: the step's headline numbers."""
    if not data:
        return ""
    if "tests" in data and "passed" in data:
        return (f"{data['passed']} passed, {data['skipped']} skipped, "
                f"{data['failures']} failed, {data['errors']} errors")
    if name == "agreement":
        return (f"{data['dtype']}: identical {data['num_identical_same_dtype']}/"
                f"{data['num_prompts']} (same dtype), {data['num_identical_fp32']}/"
                f"{data['num_prompts']} (fp32); min agree {data['min_agree_same_dtype']}")
    if name == "engine_bench":
        g, e = data["engine"], data["engine_eager"]
        steps = " ".join(f"b{s['batch']}={s['step_s_median'] * 1e3:.1f}/"
                         f"{t['step_s_median'] * 1e3:.1f}ms"
                         for s, t in zip(g["decode_step"], e["decode_step"]))
        return (f"{g['mixed']['output_tok_per_s']:.0f} tok/s "
                f"(eager {e['mixed']['output_tok_per_s']:.0f}), "
                f"{data['speedup_over_transformers']:.2f}x transformers; "
                f"graphs used={g['cuda_graphs']['graphs_used']}, same tokens as eager "
                f"{data.get('graph_vs_eager_identical_requests', '?')}; "
                f"step graph/eager {steps}")
    if name == "setup":
        return " ".join(f"{k}={v}" for k, v in data.get("versions", {}).items()
                        if k in ("torch", "triton", "transformers"))
    return str(data.get("summary", ""))


def cmd_summary(ns: argparse.Namespace) -> int:
    steps = []
    for line in Path(ns.steps).read_text().splitlines():
        if not line.strip():
            continue
        name, status, rc, seconds, note = (line.split("\t") + [""] * 5)[:5]
        data_file = Path(ns.data) / f"{name}.json"
        data = json.loads(data_file.read_text()) if data_file.is_file() else None
        steps.append({"name": name, "status": status,
                      "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                      "seconds": float(seconds or 0), "note": note, "data": data})
    meta = dict(kv.split("=", 1) for kv in ns.meta)
    result = {**meta, "dry_run": meta.get("dry_run") == "1",
              "ok": all(s["status"] != "failed" for s in steps), "steps": steps}
    tmp = Path(ns.out + ".partial")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(ns.out)
    if ns.table:
        rows = [(s["name"], s["status"], f"{s['seconds']:.1f}",
                 detail(s["name"], s["data"]) or s["note"]) for s in steps]
        widths = [max(len(r[i]) for r in rows + [("step", "status", "s", "")])
                  for i in range(3)]
        print("== gpu_check: " + ("dry run, " if result["dry_run"] else "")
              + f"stage {meta.get('stage', '?')}")
        print(f"{'step':<{widths[0]}}  {'status':<{widths[1]}}  {'s':>{widths[2]}}  detail")
        for r in rows:
            print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
        failed = [s["name"] for s in steps if s["status"] == "failed"]
        print("== gpu_check: " + (f"FAILED: {' '.join(failed)}" if failed else "all ok"))
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _gib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**30:.2f} GiB"


def markdown(results: list[dict]) -> str:
    """The section: what ran where, each step's status, and the measured numbers as tables
    (ratios beside the absolute numbers, all from the same run)."""
    steps = {s["name"]: s for r in results for s in r["steps"]}
    data = {name: s.get("data") or {} for name, s in steps.items()}
    setup = data.get("setup", {})
    versions = setup.get("versions", {})
    device = setup.get("device_name") or results[-1].get("device", "?")
    lines = [f"## On a GPU: {device} ({results[0].get('started', '?')})", "",
             "`scripts/gpu_check.sh` (docs/gpu.md); "
             + ", ".join(f"{k} {versions[k]}" for k in ("python", "torch", "triton",
                                                        "transformers") if k in versions)
             + ("; **dry run (CPU)**" if any(r.get("dry_run") for r in results) else "")
             + ".", "", "| step | status | s | result |", "| --- | --- | --- | --- |"]
    for s in steps.values():
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | "
                     f"{detail(s['name'], s.get('data')) or s.get('note', '')} |")
    agreement = data.get("agreement")
    if agreement and agreement.get("prompts"):
        dtype = agreement["dtype"]
        lines += ["", f"Greedy agreement in {dtype}: new tokens before the first divergence "
                      f"(of {agreement['max_tokens']}), per parity prompt.", "",
                  f"| prompt | against transformers {dtype} | against transformers fp32 |",
                  "| --- | --- | --- |"]
        lines += [f"| {p['prompt']} | {p['agree_same_dtype']} | {p['agree_fp32']} |"
                  for p in agreement["prompts"]]
    bench = data.get("engine_bench")
    if bench and "engine" in bench:
        g, e, hf = bench["engine"], bench["engine_eager"], bench["transformers_batched"]
        lines += ["", f"mixed64 ({g['mixed']['requests']} requests, {bench['dtype']}), "
                      "output tok/s in one run:", "",
                  "| pdserve, CUDA graphs | pdserve, eager | transformers batched "
                  f"({hf['batch_size']} at a time) | graphs / transformers | graphs / eager |",
                  "| --- | --- | --- | --- | --- |",
                  f"| {g['mixed']['output_tok_per_s']:.0f} | "
                  f"{e['mixed']['output_tok_per_s']:.0f} | {hf['output_tok_per_s']:.0f} | "
                  f"{bench['speedup_over_transformers']:.2f}x | "
                  f"{g['mixed']['output_tok_per_s'] / e['mixed']['output_tok_per_s']:.2f}x |",
                  "", "Decode step (median ms, all requests decoding):", "",
                  "| batch | CUDA graphs | eager | eager / graphs | graph replays |",
                  "| --- | --- | --- | --- | --- |"]
        for gs, es in zip(g["decode_step"], e["decode_step"]):
            lines.append(f"| {gs['batch']} | {_ms(gs['step_s_median'])} | "
                         f"{_ms(es['step_s_median'])} | "
                         f"{es['step_s_median'] / gs['step_s_median']:.2f}x | "
                         f"{gs.get('graph_replays', '-')} |")
        mem = g.get("memory", {})
        lines += ["", f"Memory (graphs): KV pool {_gib(mem.get('kv_pool_bytes'))}, peak "
                      f"allocated {_gib(mem.get('max_allocated_bytes'))}, reserved "
                      f"{_gib(mem.get('reserved_bytes'))}; graphs captured for "
                      f"{g['cuda_graphs'].get('capture_sizes')}; greedy tokens equal to "
                      f"eager's for {bench.get('graph_vs_eager_identical_requests', '?')} "
                      "requests."]
    return "\n".join(lines) + "\n"


def cmd_markdown(ns: argparse.Namespace) -> int:
    print(markdown([json.loads(Path(f).read_text()) for f in ns.json]), end="")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("junit")
    j.add_argument("xml")
    j.add_argument("--expect", choices=["passed", "skipped"], required=True)
    j.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--steps", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--table", action="store_true")
    s.add_argument("--meta", nargs="*", default=[])
    m = sub.add_parser("markdown")
    m.add_argument("json", nargs="+")
    ns = ap.parse_args()
    return {"junit": cmd_junit, "summary": cmd_summary, "markdown": cmd_markdown}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
