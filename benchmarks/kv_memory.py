"""KV memory of the paged cache, beside what a contiguous (static) cache would reserve.

Over an in-process run of a workload through the offline engine (`shared.llm.LLM`, every
request added at once, greedy, ignore_eos), the KV cache manager is sampled after every
engine step:

- allocated slots: blocks held by the unfinished requests (`req_to_blocks`) x block_size,
  counted per request (logical); the unique block ids among them (physical) and the pool's
  blocks with ref_cnt > 0;
- tokens held: sum of the requests' `num_computed_tokens` (tokens whose KV is written);
- internal fragmentation = (allocated slots - tokens held) / allocated slots: the empty
  tail of each request's last block (the PagedAttention paper reports under 4%), as a
  mean over steps, weighted by step time, and at the step of peak allocation;
- a contiguous reservation for the same concurrently running requests: `max_model_len`
  tokens each (a static cache sized for the longest sequence), and prompt + max_tokens
  each (the best a static cache can do knowing every request's length), as a ratio to the
  paged allocation;
- prefix sharing (prefix32): logical blocks referenced by the requests vs unique physical
  blocks, at the step with the most logical blocks: blocks saved by sharing.

    .venv/bin/python benchmarks/kv_memory.py [--workloads mixed64,prefix32] [--seed 0]
        [--num-requests 8] [--max-model-len 2048] [--json out.json]

Prints a readable table and one JSON summary (stdout, last). breakdown.py reports the same
for its mixed64 run (part a) and prefix32 (part p).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_loop import run_engine, workload_requests  # noqa: E402


class KVSampler:
    """Samples one engine's KV cache manager after every step (see the module docstring).

    Cost: one pass over the requests holding blocks per step (microseconds); run_engine
    takes the sampler's time out of its wall time and token stamps.
    """

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.rows: list[tuple] = []
        """Per step: (step_s, n, logical_blocks, physical_blocks, pool_used_blocks,
        tokens_held, static_max_len_tokens, static_exact_tokens)."""
        self.block_size = 0
        self.num_blocks = 0

    def sample(self, engine, step_s: float) -> None:
        kv = engine.kv_cache_manager
        requests = engine.scheduler.requests
        self.block_size = kv.block_size
        self.num_blocks = kv.block_pool.num_gpu_blocks - 1
        n = logical = tokens = static_exact = 0
        physical: set[int] = set()
        for request_id, blocks in kv.req_to_blocks.items():
            request = requests.get(request_id)
            if request is None or not blocks:
                continue  # finished but held (prefill role): not in an offline engine
            n += 1
            logical += len(blocks)
            physical.update(b.block_id for b in blocks)
            tokens += request.num_computed_tokens
            max_tokens = request.sampling_params.max_tokens or self.max_model_len
            static_exact += min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        used = self.num_blocks - kv.num_free_blocks
        self.rows.append((step_s, n, logical, len(physical), used, tokens,
                          n * self.max_model_len, static_exact))

    # -- reports ----------------------------------------------------------------------------

    def _busy(self) -> list[tuple]:
        return [r for r in self.rows if r[2] > 0]

    def fragmentation(self) -> dict:
        """Internal fragmentation and the contiguous reservation, over the run."""
        rows = self._busy()
        if not rows:
            return {"steps_sampled": 0}
        bs = self.block_size
        shares = [(r[2] * bs - r[5]) / (r[2] * bs) for r in rows]
        weights = [r[0] for r in rows]
        total_w = sum(weights) or 1.0
        peak = max(rows, key=lambda r: r[2])
        i_peak = rows.index(peak)
        step_s, n, logical, physical, used, tokens, static_max, static_exact = peak
        slots = logical * bs

        def ratio_avg(col: int) -> float:
            return round(sum(r[col] / (r[2] * bs) * r[0] for r in rows) / total_w, 2)

        return {
            "block_size": bs,
            "pool_blocks": self.num_blocks,
            "max_model_len": self.max_model_len,
            "steps_sampled": len(rows),
            "internal_fragmentation": {
                "mean_over_steps": round(sum(shares) / len(shares), 4),
                "step_time_weighted": round(sum(s * w for s, w in zip(shares, weights))
                                            / total_w, 4),
                "slot_weighted": round(sum(r[2] * bs - r[5] for r in rows)
                                       / sum(r[2] * bs for r in rows), 4),
                "at_peak_allocation": round(shares[i_peak], 4),
                "max": round(max(shares), 4),
            },
            "peak": {
                "running_requests": n,
                "allocated_blocks": logical,
                "allocated_slots": slots,
                "unique_physical_blocks": physical,
                "pool_used_blocks": used,
                "pool_usage": round(used / self.num_blocks, 4),
                "tokens_held": tokens,
                "empty_slots": slots - tokens,
            },
            "contiguous_reservation": {
                "at_peak_max_model_len_tokens": static_max,
                "at_peak_max_model_len_over_paged": round(static_max / slots, 2),
                "at_peak_max_model_len_unused_share": round(1 - tokens / static_max, 4),
                "at_peak_prompt_plus_max_tokens": static_exact,
                "at_peak_prompt_plus_max_tokens_over_paged": round(static_exact / slots, 2),
                "at_peak_prompt_plus_max_tokens_unused_share":
                    round(1 - tokens / static_exact, 4),
                "step_time_weighted_max_model_len_over_paged": ratio_avg(6),
                "step_time_weighted_prompt_plus_max_tokens_over_paged": ratio_avg(7),
                "pool_could_hold_requests_at_max_model_len":
                    self.num_blocks * bs // self.max_model_len,
            },
        }

    def sharing(self) -> dict:
        """Prefix sharing at the step with the most logical blocks (all requests admitted)."""
        rows = self._busy()
        if not rows:
            return {"steps_sampled": 0}
        bs = self.block_size
        step_s, n, logical, physical, used, tokens, static_max, static_exact = \
            max(rows, key=lambda r: (r[2], -r[3]))
        return {
            "block_size": bs,
            "max_model_len": self.max_model_len,
            "steps_sampled": len(rows),
            "running_requests": n,
            "logical_blocks": logical,
            "unique_physical_blocks": physical,
            "blocks_saved_by_sharing": logical - physical,
            "saved_share": round((logical - physical) / logical, 4),
            "pool_used_blocks": used,
            "tokens_held": tokens,
            "contiguous_max_model_len_blocks": -(-static_max // bs),
            "contiguous_max_model_len_over_paged": round(static_max / (physical * bs), 2),
            "contiguous_prompt_plus_max_tokens_blocks": -(-static_exact // bs),
            "contiguous_prompt_plus_max_tokens_over_paged":
                round(static_exact / (physical * bs), 2),
        }


def measure(llm, workload: str, seed: int, source: str, num_requests: int | None,
            max_model_len: int, loadgen: str | None = None, tag: str = "kv") -> dict:
    """One in-process run of `workload` with the sampler: the run's stats + the KV report."""
    reqs = workload_requests(workload, seed, source, num_requests, loadgen)
    sampler = KVSampler(max_model_len)
    run = run_engine(llm, reqs, sampler, tag=tag)
    report = sampler.sharing() if workload == "prefix32" else sampler.fragmentation()
    if workload == "prefix32":
        report["prefix_cache_hit_tokens"] = run["prefix_cache_hit_tokens"]
        report["prompt_tokens"] = run["prompt_tokens"]
    return {"workload": workload, "requests": len(reqs), "run": run, "kv": report}


def format_fragmentation(kv: dict) -> list[str]:
    if not kv.get("steps_sampled"):
        return ["  (no step held blocks)"]
    f, p, c = kv["internal_fragmentation"], kv["peak"], kv["contiguous_reservation"]
    return [
        f"  internal fragmentation (empty share of allocated slots): mean over "
        f"{kv['steps_sampled']} steps {f['mean_over_steps']:.2%}, step-time weighted "
        f"{f['step_time_weighted']:.2%}, at peak {f['at_peak_allocation']:.2%}",
        f"  peak: {p['running_requests']} requests hold {p['allocated_blocks']} blocks = "
        f"{p['allocated_slots']} slots for {p['tokens_held']} tokens "
        f"({p['pool_usage']:.1%} of {kv['pool_blocks']} blocks)",
        f"  contiguous reservation at that step: max_model_len ({kv['max_model_len']}) each "
        f"{c['at_peak_max_model_len_tokens']} slots = {c['at_peak_max_model_len_over_paged']}x "
        f"paged ({c['at_peak_max_model_len_unused_share']:.1%} unused); prompt+max_tokens "
        f"each {c['at_peak_prompt_plus_max_tokens']} = "
        f"{c['at_peak_prompt_plus_max_tokens_over_paged']}x "
        f"({c['at_peak_prompt_plus_max_tokens_unused_share']:.1%} unused)",
    ]


def format_sharing(kv: dict) -> list[str]:
    if not kv.get("steps_sampled"):
        return ["  (no step held blocks)"]
    return [
        f"  {kv['running_requests']} requests reference {kv['logical_blocks']} blocks, "
        f"{kv['unique_physical_blocks']} unique: {kv['blocks_saved_by_sharing']} saved by "
        f"prefix sharing ({kv['saved_share']:.1%})",
        f"  contiguous reservation: max_model_len each {kv['contiguous_max_model_len_blocks']} "
        f"blocks = {kv['contiguous_max_model_len_over_paged']}x; prompt+max_tokens each "
        f"{kv['contiguous_prompt_plus_max_tokens_blocks']} blocks = "
        f"{kv['contiguous_prompt_plus_max_tokens_over_paged']}x",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mixed64,prefix32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=None,
                    help="only the first N requests of each workload (smoke test)")
    ap.add_argument("--prompts", choices=["loadgen", "workloads"], default="loadgen",
                    help="prompt source: ../shared/bench/loadgen.py or benchmarks/workloads.py")
    ap.add_argument("--loadgen", default=None, help="path of loadgen.py")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--json", default=None, help="also write the JSON summary here")
    args = ap.parse_args()

    import torch

    from pdserve.shared.llm import LLM
    from pdserve.shared.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, num_threads=args.threads)
    llm.generate(["warm up"], SamplingParams(max_tokens=4))
    out = {"seed": args.seed, "prompts": args.prompts, "threads": args.threads}
    for i, w in enumerate(filter(None, args.workloads.split(","))):
        res = measure(llm, w, args.seed, args.prompts, args.num_requests, args.max_model_len,
                      args.loadgen, tag=f"kv{i}")
        out[w] = res
        print(f"{w} ({res['requests']} requests, {res['run']['wall_s']:.1f} s):",
              file=sys.stderr)
        lines = format_sharing(res["kv"]) if w == "prefix32" else \
            format_fragmentation(res["kv"])
        print("\n".join(lines), file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
