"""scripts/gpu_check.sh's bookkeeping (standard library only, any python3):

    gpu_check_report.py junit XML --expect passed|skipped --out FILE
        pytest's junit counts into FILE (JSON); exit 1 unless tests were collected, none
        failed or errored, and all of them passed (--expect passed) or skipped (skipped).
    gpu_check_report.py summary --steps TSV --data DIR --out FILE [--table] [--meta k=v ...]
        the steps' results (TSV: name, status, rc, seconds, note) with each step's numbers
        (DIR/<name>.json, when there) into FILE; with --table, a short table on stdout.
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
    ns = ap.parse_args()
    return cmd_junit(ns) if ns.cmd == "junit" else cmd_summary(ns)


if __name__ == "__main__":
    sys.exit(main())
