"""The table of benchmarks/vs_vllm.sh: medians over rounds of pdserve and vLLM per workload,
and the ratios the comparison is judged by, from the run's JSON files.

    .venv/bin/python benchmarks/vs_vllm_table.py OUTDIR [--meta key=value ...]
    .venv/bin/python benchmarks/vs_vllm_table.py --line FILE.json   # one run, one line

Reads OUTDIR/r<round>-<system>-<workload>.json (written by loadgen.py or
benchmarks/serving.py: both formats are understood), prints a Markdown table and writes
OUTDIR/summary.json. Ratios are pdserve / vLLM of the medians (and, beside them, the median
of the per-round ratios, each round's pdserve run paired with that round's vLLM run).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

_FILE = re.compile(r"^r(\d+)-([A-Za-z0-9_]+)-(single|mixed64|prefix32)\.json$")
SYSTEMS = ("pdserve", "vllm")
WORKLOADS = ("single", "mixed64", "prefix32")
METRICS = ("output_tok_per_s", "wall_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_ms",
           "tpot_p50_ms", "e2e_p50_s")
# (name, workload, metric, lower is better)
RATIOS = (
    ("mixed64 output tok/s", "mixed64", "output_tok_per_s", False),
    ("mixed64 TTFT p50", "mixed64", "ttft_p50_s", True),
    ("single ITL p50", "single", "itl_p50_ms", True),
    ("prefix32 wall", "prefix32", "wall_s", True),
)


def normalize(d: dict) -> dict:
    """One run's JSON (loadgen.py's or serving.py's) -> the METRICS plus errors."""
    if "ttft_ms" in d:  # loadgen.py: latencies in ms
        ms = {k: d.get(k) or {} for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}

        def s(key: str, p: str) -> float | None:
            v = ms[key].get(p)
            return v / 1000 if v is not None else None

        return {"output_tok_per_s": d.get("output_tok_per_s"), "wall_s": d.get("wall_s"),
                "ttft_p50_s": s("ttft_ms", "p50"), "ttft_p90_s": s("ttft_ms", "p90"),
                "itl_p50_ms": ms["itl_ms"].get("p50"), "tpot_p50_ms": ms["tpot_ms"].get("p50"),
                "e2e_p50_s": s("e2e_ms", "p50"), "errors": d.get("n_errors", 0),
                "requests": d.get("n_requests"), "output_tokens": d.get("total_output_tokens")}
    sec = {k: d.get(k) or {} for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s")}  # serving.py

    def ms_(key: str) -> float | None:
        v = sec[key].get("p50")
        return v * 1000 if v is not None else None

    return {"output_tok_per_s": d.get("output_tok_per_s"), "wall_s": d.get("wall_s"),
            "ttft_p50_s": sec["ttft_s"].get("p50"), "ttft_p90_s": sec["ttft_s"].get("p90"),
            "itl_p50_ms": ms_("itl_s"), "tpot_p50_ms": ms_("tpot_s"),
            "e2e_p50_s": sec["e2e_s"].get("p50"), "errors": d.get("failed", 0),
            "requests": d.get("requests"), "output_tokens": d.get("output_tokens")}


def load_runs(outdir: Path) -> dict:
    """{system: {workload: {round: normalized}}}; unreadable files are reported as errors."""
    runs: dict = {}
    for f in sorted(outdir.iterdir()):
        m = _FILE.match(f.name)
        if not m:
            continue
        rnd, system, workload = int(m[1]), m[2], m[3]
        try:
            row = normalize(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            row = {"unreadable": f"{f.name}: {e}"}
        runs.setdefault(system, {}).setdefault(workload, {})[rnd] = row
    return runs


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: dict, meta: dict) -> dict:
    out: dict = {"meta": meta, "medians": {}, "runs": runs, "ratios": {}}
    for system, by_w in runs.items():
        for workload, by_r in by_w.items():
            ok = [r for r in by_r.values() if "unreadable" not in r]
            med = {k: _median([r.get(k) for r in ok]) for k in METRICS}
            med["rounds"] = len(ok)
            med["errors"] = sum(r.get("errors") or 0 for r in ok)
            out["medians"].setdefault(system, {})[workload] = med
    med = out["medians"]
    for name, workload, metric, lower_better in RATIOS:
        p = med.get("pdserve", {}).get(workload, {}).get(metric)
        v = med.get("vllm", {}).get(workload, {}).get(metric)
        paired = []
        for rnd, row in runs.get("pdserve", {}).get(workload, {}).items():
            other = runs.get("vllm", {}).get(workload, {}).get(rnd, {})
            if row.get(metric) and other.get(metric):
                paired.append(row[metric] / other[metric])
        out["ratios"][name] = {
            "pdserve": p, "vllm": v, "pdserve_over_vllm": round(p / v, 3) if p and v else None,
            "median_of_paired_rounds": round(statistics.median(paired), 3) if paired else None,
            "lower_is_better": lower_better}
    return out


def _f(v, fmt: str) -> str:
    return format(v, fmt) if v is not None else "-"


def render(summary: dict) -> str:
    med = summary["medians"]
    meta = summary["meta"]
    lines = []
    if meta:
        lines += ["  ".join(f"{k}={v}" for k, v in meta.items()), ""]
    lines += ["| workload | system | rounds | output tok/s | wall s | TTFT p50 s | TTFT p90 s "
              "| ITL p50 ms | TPOT p50 ms | errors |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for w in WORKLOADS:
        for s in ("pdserve", "vllm", *sorted(set(med) - set(SYSTEMS))):
            m = med.get(s, {}).get(w)
            if not m:
                continue
            lines.append(f"| `{w}` | {s} | {m['rounds']} | {_f(m['output_tok_per_s'], '.1f')} "
                         f"| {_f(m['wall_s'], '.1f')} | {_f(m['ttft_p50_s'], '.3f')} "
                         f"| {_f(m['ttft_p90_s'], '.3f')} | {_f(m['itl_p50_ms'], '.1f')} "
                         f"| {_f(m['tpot_p50_ms'], '.1f')} | {m['errors']} |")
    lines += ["", "| ratio (medians) | pdserve | vLLM | pdserve / vLLM | median of per-round "
              "ratios |", "| --- | --- | --- | --- | --- |"]
    for name, r in summary["ratios"].items():
        better = "lower is better" if r["lower_is_better"] else "higher is better"
        lines.append(f"| {name} ({better}) | {_f(r['pdserve'], '.3f')} | "
                     f"{_f(r['vllm'], '.3f')} | **{_f(r['pdserve_over_vllm'], '.3f')}** | "
                     f"{_f(r['median_of_paired_rounds'], '.3f')} |")
    return "\n".join(lines)


def one_line(path: Path) -> str:
    try:
        r = normalize(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"
    return (f"{_f(r['output_tok_per_s'], '.1f')} tok/s  wall {_f(r['wall_s'], '.1f')} s  "
            f"TTFT p50 {_f(r['ttft_p50_s'], '.3f')} s  ITL p50 {_f(r['itl_p50_ms'], '.0f')} ms  "
            f"errors {r['errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--line", default=None, help="print one run's summary line and exit")
    ap.add_argument("--meta", action="append", default=[], help="key=value, into the JSON")
    args = ap.parse_args()
    if args.line:
        print(one_line(Path(args.line)))
        return
    if not args.outdir:
        ap.error("OUTDIR is required")
    outdir = Path(args.outdir)
    meta = dict(kv.split("=", 1) for kv in args.meta if "=" in kv)
    summary = summarize(load_runs(outdir), meta)
    if not summary["medians"]:
        sys.exit(f"no r<round>-<system>-<workload>.json files in {outdir}")
    (outdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render(summary))
    print(f"\n(written: {outdir / 'summary.json'})")


if __name__ == "__main__":
    main()
