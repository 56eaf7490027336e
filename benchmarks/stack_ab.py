"""Two `pdserve up` configurations side by side on one workload: alternating rounds, one
stack at a time, every run through the independent harness ../shared/bench/loadgen.py;
medians and B / A ratios.

    .venv/bin/python benchmarks/stack_ab.py --a "--max-decode-stall-ms 0" --b "" \
        [--rounds 2] [--workload mixed64] [--seed 1] [--json out.json]

Two commits: `--a-checkout DIR` / `--b-checkout DIR` run the pdserve of another checkout
(its own `.venv`, installed with `make install`: a `git worktree` of the baseline commit).

Both get `--kv-cache-memory 2GiB --max-model-len 2048` first (as benchmarks/vs_vllm.sh).
The table goes to stderr, the JSON (every run and the medians) to stdout and --json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.breakdown import DEFAULT_UP_FLAGS, Stack, log  # noqa: E402
from benchmarks.engine_loop import DEFAULT_LOADGEN  # noqa: E402

METRICS = (("output_tok_per_s", "output tok/s", None), ("wall_s", "wall s", None),
           ("ttft_ms", "TTFT p50 ms", "p50"), ("ttft_ms", "TTFT p90 ms", "p90"),
           ("itl_ms", "ITL p50 ms", "p50"), ("itl_ms", "ITL p99 ms", "p99"),
           ("tpot_ms", "TPOT p50 ms", "p50"))


def one_run(flags: str, args, label: str, round_: int) -> dict:
    checkout = args.a_checkout if label == "A" else args.b_checkout
    python = str(Path(checkout) / ".venv" / "bin" / "python") if checkout else sys.executable
    stack = Stack(shlex.split(DEFAULT_UP_FLAGS + " " + flags), args.port,
                  Path(args.outdir) / f"r{round_}-{label}.log", python)
    try:
        stack.start(600)
        cmd = [sys.executable, str(args.loadgen), "--base-url", stack.url, "--model",
               stack.model, "--workload", args.workload, "--seed", str(args.seed)]
        log(f"round {round_} {label}: " + shlex.join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)
    finally:
        stack.stop()
        time.sleep(2)


def pick(run: dict, key: str, sub: str | None) -> float | None:
    value = run.get(key)
    if sub is not None:
        value = (value or {}).get(sub)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="", help="`pdserve up` flags of A (the baseline)")
    ap.add_argument("--b", default="", help="`pdserve up` flags of B")
    ap.add_argument("--a-checkout", default=None,
                    help="a checkout with its own .venv whose pdserve A runs (default: this)")
    ap.add_argument("--b-checkout", default=None, help="the same for B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", default="mixed64")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=8179)
    ap.add_argument("--loadgen", default=str(DEFAULT_LOADGEN))
    ap.add_argument("--outdir", default="/tmp/pdserve-stack-ab")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for label, flags in (("A", args.a), ("B", args.b)):
            runs[label].append(one_run(flags, args, label, r))
    medians = {label: {name: statistics.median(v for v in (pick(x, key, sub) for x in rs)
                                               if v is not None)
                       for key, name, sub in METRICS}
               for label, rs in runs.items()}
    lines = [f"{args.workload} seed {args.seed}, {args.rounds} alternating rounds; "
             f"A: {args.a_checkout or '.'} {args.a or '(defaults)'}; "
             f"B: {args.b_checkout or '.'} {args.b or '(defaults)'}",
             f"{'metric':14s} {'A':>10s} {'B':>10s} {'B/A':>7s}"]
    for _, name, _ in METRICS:
        a, b = medians["A"][name], medians["B"][name]
        lines.append(f"{name:14s} {a:10.1f} {b:10.1f} {b / a if a else float('nan'):7.3f}")
    print("\n".join(lines), file=sys.stderr)
    out = {"a_flags": args.a, "b_flags": args.b, "a_checkout": args.a_checkout,
           "b_checkout": args.b_checkout, "workload": args.workload,
           "seed": args.seed, "medians": medians, "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
