"""Cache counters, medians, ratios and the tables of benchmarks/kv_tiers.py.

Engine counters come from Prometheus snapshots (benchmarks/breakdown.py `scrape`: keys like
`pdserve_kv_tier_hits_total{tier=disk}`), summed over a stack's engines. A counter that an
engine does not export reads as None ("not reported"), never as 0.
"""

from __future__ import annotations

import statistics

TIERS = ("memory", "disk")
MAIN_METRICS = (("returning_ttft_p50_ms", "returning TTFT p50 ms"),
                ("returning_ttft_p90_ms", "returning TTFT p90 ms"),
                ("first_ttft_p50_ms", "first-turn TTFT p50 ms"),
                ("output_tok_s", "output tok/s"), ("wall_s", "wall s"))
RATE_METRICS = (("pool_hit_rate", "pool prefix hit"), ("memory_tier_hit_rate", "memory tier hit"),
                ("disk_tier_hit_rate", "disk tier hit"),
                ("usage_cached_frac", "cached prompt frac"),
                ("history_cached_frac", "cached history frac"))
"""Returning turns only: the pool's prefix cache (tokens), each tier (blocks), and the
fraction of prompt tokens the server's usage says were cached, of the whole prompt and of
the part after the shared system prompt."""


def metric_sum(snap: dict, name: str, tier: str | None = None) -> float | None:
    """The sum of every series of `name` (with label tier=`tier` if given); None if absent."""
    values = [v for k, v in snap.items()
              if k.split("{", 1)[0] == name
              and (tier is None or f"tier={tier}" in k.partition("{")[2].rstrip("}").split(","))]
    return sum(values) if values else None


def _delta(before: dict, after: dict, name: str, tier: str | None = None) -> float | None:
    a = metric_sum(after, name, tier)
    return None if a is None else a - (metric_sum(before, name, tier) or 0.0)


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def cache_stats(before: dict, after: dict) -> dict:
    """Counter deltas from `before` to `after`: pool prefix cache (tokens; pdserve's or
    vLLM's names), and per tier queries / hits / stores / loads (blocks), the mean load time,
    and the tier's blocks / bytes at `after`."""
    out: dict = {}
    for prefix in ("pdserve_prefix_cache", "vllm:prefix_cache"):
        queries = _delta(before, after, f"{prefix}_queries_total")
        if queries is not None:
            hits = _delta(before, after, f"{prefix}_hits_total")
            out["pool"] = {"queries": queries, "hits": hits, "hit_rate": _ratio(hits, queries)}
    for tier in TIERS:
        t = {k: _delta(before, after, f"pdserve_kv_tier_{k}_total", tier)
             for k in ("queries", "hits", "stores", "loads")}
        t["hit_rate"] = _ratio(t["hits"], t["queries"])
        t["blocks"] = metric_sum(after, "pdserve_kv_tier_blocks", tier)
        t["bytes"] = metric_sum(after, "pdserve_kv_tier_bytes", tier)
        if any(v is not None for v in t.values()):
            out[tier] = t
    for name in ("pdserve_num_preemptions_total", "vllm:num_preemptions_total"):
        if (preemptions := _delta(before, after, name)) is not None:
            out["preemptions"] = preemptions
    count = _delta(before, after, "pdserve_kv_tier_load_seconds_count")
    if count:
        out["load_seconds_mean"] = _ratio(_delta(before, after,
                                                 "pdserve_kv_tier_load_seconds_sum"), count)
    return out


def headline(summary: dict) -> dict[str, float | None]:
    """The scalars of one system's run that are compared and reported."""
    ret = summary.get("cache", {}).get("returning", {})
    return {
        "returning_ttft_p50_ms": summary["returning_ttft_ms"]["p50"],
        "returning_ttft_p90_ms": summary["returning_ttft_ms"]["p90"],
        "first_ttft_p50_ms": summary["first_ttft_ms"]["p50"],
        "output_tok_s": summary["output_tok_s"],
        "wall_s": summary["wall_s"],
        "pool_hit_rate": ret.get("pool", {}).get("hit_rate"),
        "memory_tier_hit_rate": ret.get("memory", {}).get("hit_rate"),
        "disk_tier_hit_rate": ret.get("disk", {}).get("hit_rate"),
        "usage_cached_frac": summary.get("returning_cached_frac"),
        "history_cached_frac": summary.get("returning_history_cached_frac"),
    }


def medians(rounds: list[dict]) -> dict[str, dict[str, float | None]]:
    """system -> metric -> median over the rounds that have it."""
    out: dict[str, dict[str, float | None]] = {}
    for system in dict.fromkeys(s for r in rounds for s in r):
        runs = [headline(r[system]) for r in rounds if "output_tok_s" in r.get(system, {})]
        if not runs:
            continue
        out[system] = {k: (statistics.median(vs) if (vs := [x[k] for x in runs
                                                              if x[k] is not None]) else None)
                       for k in runs[0]}
    return out


def ratios(meds: dict, num: str, den: str) -> dict[str, float | None] | None:
    if num not in meds or den not in meds:
        return None
    return {k: _ratio(meds[num][k], meds[den][k]) for k, _ in MAIN_METRICS}


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(meds: dict, ratio_rows: dict[str, dict | None]) -> str:
    lines = ["| system | " + " | ".join(n for _, n in MAIN_METRICS + RATE_METRICS) + " |",
             "|---" * (1 + len(MAIN_METRICS) + len(RATE_METRICS)) + "|"]
    for system, m in meds.items():
        lines.append(f"| {system} | "
                     + " | ".join(_f(m[k], ".1f" if k == "output_tok_s" else ".0f")
                                  for k, _ in MAIN_METRICS) + " | "
                     + " | ".join(_f(m[k], ".2f") for k, _ in RATE_METRICS) + " |")
    rows = {k: v for k, v in ratio_rows.items() if v}
    if rows:
        lines += ["", "| ratio | " + " | ".join(n for _, n in MAIN_METRICS) + " |",
                  "|---" * (1 + len(MAIN_METRICS)) + "|"]
        for name, r in rows.items():
            lines.append(f"| {name} | " + " | ".join(_f(r[k], ".2f") for k, _ in MAIN_METRICS)
                         + " |")
        lines.append("(issue 30 targets: returning TTFT p50 <= 0.20, output tok/s >= 1.50)")
    return "\n".join(lines)


def restart_table(restarts: list[dict]) -> str:
    lines = ["| round | start | probe TTFT ms | cached / prompt tokens | disk hits / queries | "
             "disk loads | disk blocks before -> after |", "|---" * 7 + "|"]
    for i, r in enumerate(restarts):
        for label in ("tiers", "no_tiers"):
            p = r.get(label)
            if not p:
                continue
            disk = p.get("cache", {}).get("disk", {})
            lines.append(
                f"| {i} | {label} | {_f(p.get('ttft_ms'))} | {_f(p.get('cached_tokens'))} / "
                f"{_f(p.get('prompt_tokens'))} | {_f(disk.get('hits'))} / "
                f"{_f(disk.get('queries'))} | {_f(disk.get('loads'))} | "
                f"{_f(p.get('disk_blocks_before'))} -> {_f(disk.get('blocks'))} |")
        lines.append(f"| {i} | tiers / no tiers | {_f(r.get('ttft_ratio'), '.2f')} | | | | |")
    return "\n".join(lines)
