"""N-gram speculative decoding beside plain decoding, in-process engines, one run:

- repetitive: one stream, prompts asking to repeat / correct / reformat a ~300-token
  passage, 128 output tokens each (greedy, ignore_eos): per-token ITL p50 and mean (each
  step's time spread over the tokens it emitted), the gap between emissions (chunks),
  tokens per step and the acceptance rate, with `--speculative-config` on and off;
- mixed64 (benchmarks/workloads.py), all at once: output tok/s on and off (with the
  default back-off `disable_by_batch_size`, speculation stays out of a busy batch).

    .venv/bin/python benchmarks/spec_decode.py [--k 4] [--rounds 2] [--mixed-requests 64]

Prints a JSON summary. The machine is shared and noisy: run it alone, quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workloads import build_workload  # noqa: E402
from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.request import Request  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402

TEXT = ROOT / "tests" / "data" / "declaration_gettysburg.txt"
INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word:",
    "Correct any spelling mistakes in the following passage and write it out again in full:",
    "Reformat the following passage with one sentence per line, keeping every word:",
)


def passage(llm: LLM, num_tokens: int = 300) -> str:
    """About `num_tokens` tokens of the Declaration (whole sentences)."""
    text = TEXT.read_text().split("\n\n", 3)[3]
    ids = llm.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    cut = llm.tokenizer.decode(ids)
    return cut[:cut.rfind(".") + 1]


def repetitive_prompts(llm: LLM) -> list[list[int]]:
    from pdserve.shared.tokenizer import apply_chat_template

    body = passage(llm)
    return [apply_chat_template(llm.tokenizer, [{"role": "user",
                                                 "content": f"{inst}\n\n{body}"}])
            for inst in INSTRUCTIONS]


def one_stream(llm: LLM, prompt_ids: list[int], max_tokens: int) -> dict:
    """Step the engine for one request; per-token ITLs after the first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(f"bench-{time.monotonic_ns()}", prompt_ids, params,
                      eos_token_id=llm.eos_token_id)
    engine.add_request(request)
    itl: list[float] = []
    gaps: list[float] = []
    steps_after_first = 0
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        n = sum(len(d.new_token_ids) for d in deltas)
        if n and first:
            first = False
            n -= 1  # the first token closes the prefill (TTFT, not ITL)
            if n == 0:
                continue
        if n:
            steps_after_first += 1
            itl.extend([dt / n] * n)
            gaps.append(dt)
    return {"itl": itl, "gaps": gaps, "tokens": request.num_output_tokens,
            "steps": steps_after_first}


def repetitive(llms: dict[str, LLM], rounds: int, max_tokens: int = 128) -> dict:
    out: dict[str, dict] = {}
    prompts = repetitive_prompts(llms["off"])
    for llm in llms.values():
        one_stream(llm, prompts[0], 8)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in llms}
    gaps: dict[str, list[float]] = {name: [] for name in llms}
    steps = {name: 0 for name in llms}
    tokens = {name: 0 for name in llms}
    for r in range(rounds):
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            for ids in prompts:
                llm = llms[name]
                llm.engine.kv_cache_manager.reset_prefix_cache()
                res = one_stream(llm, ids, max_tokens)
                samples[name] += res["itl"]
                gaps[name] += res["gaps"]
                steps[name] += res["steps"]
                tokens[name] += res["tokens"] - 1
    for name, llm in llms.items():
        stats = llm.engine.scheduler.spec_decoding_stats
        out[name] = {"itl_p50_s": statistics.median(samples[name]),
                     "itl_mean_s": statistics.fmean(samples[name]),
                     "chunk_gap_p50_s": statistics.median(gaps[name]),
                     "tokens_per_step": tokens[name] / max(1, steps[name])}
        if stats.num_draft_tokens:
            out[name]["acceptance_rate"] = stats.num_accepted_tokens / stats.num_draft_tokens
            out[name]["accepted_per_pos"] = [a / stats.num_drafts
                                             for a in stats.num_accepted_tokens_per_pos]
    out["itl_p50_ratio_on_over_off"] = out["on"]["itl_p50_s"] / out["off"]["itl_p50_s"]
    # NOTE: a step with drafts emits several tokens at once; the per-token p50 counts each
    # of them, so it leans on the fast multi-token steps. The mean (= TPOT) is the steadier
    # figure; chunk_gap is the time between a client's SSE chunks.
    out["itl_mean_ratio_on_over_off"] = out["on"]["itl_mean_s"] / out["off"]["itl_mean_s"]
    return out


def mixed(llms: dict[str, LLM], rounds: int, num_requests: int) -> dict:
    reqs = build_workload("mixed64")[:num_requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            llm = llms[name]
            llm.engine.kv_cache_manager.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate([x.prompt for x in reqs], params)
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(n_out / (time.perf_counter() - t0))
    med = {name: statistics.median(v) for name, v in rates.items()}
    return {"output_tok_per_s": med, "ratio_on_over_off": med["on"] / med["off"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="back-off threshold (default: the config's default)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mixed-requests", type=int, default=64, help="0 skips mixed64")
    ap.add_argument("--skip-repetitive", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=128, help="repetitive: per stream")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    kwargs = {"model": args.model} if args.model else {}
    llms = {"off": LLM(**kwargs), "on": LLM(**kwargs, speculative_config=spec)}
    summary: dict = {"speculative_config": spec}
    if not args.skip_repetitive:
        summary["repetitive"] = repetitive(llms, args.rounds, args.max_tokens)
    if args.mixed_requests:
        summary["mixed64"] = mixed(llms, args.rounds, args.mixed_requests)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
