"""Engine-core throughput: the `mixed64` workload through the offline API beside
transformers `generate` (one request at a time) in the same run, plus the decode-step
time at batch 64 beside the time of that step's matmuls alone.

    .venv/bin/python benchmarks/engine_throughput.py [--hf-requests 4] [--threads 2]

Prints a JSON summary; ratios are what to quote (this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import build_workload  # noqa: E402
from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.request import Request  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402


def run_pdserve(llm: LLM, reqs) -> dict:
    prompts = [r.prompt for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": n_out, "prompt_tokens": n_in,
            "output_tok_per_s": n_out / wall}


def run_transformers(model_path: str, tokenizer, reqs) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    n_out, wall = 0, 0.0
    with torch.inference_mode():
        for r in reqs:
            x = torch.tensor([tokenizer.encode(r.prompt, add_special_tokens=False)])
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=r.max_tokens, min_new_tokens=r.max_tokens,
                               pad_token_id=2)
            wall += time.perf_counter() - t0
            n_out += y.shape[1] - x.shape[1]
    return {"requests": len(reqs), "wall_s": wall, "output_tokens": n_out,
            "output_tok_per_s": n_out / wall}


def decode_step_at_batch(llm: LLM, reqs, batch: int, steps: int) -> dict:
    """Median engine step time with `batch` requests all decoding."""
    engine = llm.engine
    tok = llm.tokenizer
    for i, r in enumerate(reqs[:batch]):
        ids = tok.encode(r.prompt, add_special_tokens=False)
        engine.add_request(Request(f"step-{i}", ids, SamplingParams(
            temperature=0, max_tokens=10_000, ignore_eos=True), eos_token_id=2))
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_requests([f"step-{i}" for i in range(batch)])
    return {"batch": batch, "step_s_median": statistics.median(times),
            "step_s_min": min(times)}


def matmul_time_at_batch(llm: LLM, batch: int, reps: int) -> dict:
    """The step's weight matmuls alone (all layers + LM head, as the model runs them) on
    [batch, hidden]."""
    model = llm.engine.model_runner.model
    x = torch.randn(batch, model.args.hidden_size)
    xi = torch.randn(batch, model.args.intermediate_size)
    xo = torch.randn(batch, model.args.num_heads * model.args.head_dim)
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for layer in model.layers:
                layer.self_attn.qkv_proj(x)
                layer.self_attn.o_proj(xo)
                layer.mlp.gate_up_proj(x)
                layer.mlp.down_proj(xi)
            model.compute_logits(x)  # the LM head (and the final norm)
            times.append(time.perf_counter() - t0)
    return {"batch": batch, "matmul_s_median": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--hf-requests", type=int, default=4,
                    help="transformers runs this many mixed64 requests (tok/s is the rate)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reqs = build_workload("mixed64", args.seed)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate(["warm up"], SamplingParams(max_tokens=4))
    ours = run_pdserve(llm, reqs)
    step = decode_step_at_batch(llm, reqs, 64, 20)
    mm = matmul_time_at_batch(llm, 64, 20)
    hf = run_transformers(llm.model_config.model_path, llm.tokenizer, reqs[:args.hf_requests])
    print(json.dumps({
        "workload": "mixed64", "threads": args.threads,
        "pdserve": ours, "transformers_one_at_a_time": hf,
        "throughput_ratio": ours["output_tok_per_s"] / hf["output_tok_per_s"],
        "decode_step": step, "matmuls": mm,
        "step_over_matmul": step["step_s_median"] / mm["matmul_s_median"],
    }, indent=2))


if __name__ == "__main__":
    main()
