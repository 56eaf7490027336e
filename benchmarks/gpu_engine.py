"""The engine on one device beside transformers on the same device: mixed64 through the
offline `LLM` (output tok/s, with and without CUDA graphs), transformers `generate` batched
(left-padded), the decode-step time at several batch sizes, and the device memory.

    python3 benchmarks/gpu_engine.py --device cuda [--dtype float32] [--out FILE]

The tiny sizes of scripts/gpu_check.sh's dry run are flags, not a mode:
    --device cpu --num-requests 4 --max-tokens 8 --batches 1,4 --steps 3 --hf-requests 2

transformers runs batches of --hf-batch-size prompts, each batch to its longest request's
max_tokens (min_new_tokens too, so no row stops early); its tok/s counts every generated
token (`output_tok_per_s`, the ratio's denominator: the comparison in its favour) and,
beside it, only the tokens the requests asked for (`requested_tok_per_s`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import BenchRequest, build_workload  # noqa: E402
from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.request import Request  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def graph_info(llm: LLM) -> dict:
    """The CUDA-graph runner's state (None when eager or on the CPU)."""
    runner = llm.engine.model_runner.cuda_graph_runner
    sizes = list(runner.capture_sizes) if runner else []
    replays = runner.num_replays if runner else 0
    return {"runner": runner is not None, "capture_sizes": sizes, "num_replays": replays,
            "graphs_used": replays > 0}


def kv_pool_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size()
               for layer in llm.engine.model_runner.kv_caches for t in layer)


def run_mixed(llm: LLM, reqs: list[BenchRequest], device: str) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    sync(device)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(reqs), "wall_s": wall, "output_tokens": n_out,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "output_tok_per_s": n_out / wall,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def decode_step_at_batch(llm: LLM, reqs: list[BenchRequest], batch: int, steps: int,
                         device: str) -> dict:
    """Median engine step time with `batch` requests all decoding (prompts cycled from
    `reqs`); the device is synchronized around each timed step."""
    engine, tok = llm.engine, llm.tokenizer
    ids = [f"step-{batch}-{i}" for i in range(batch)]
    # NOTE: max_tokens only just covers the timed steps: the pool must admit every request.
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for rid, r in zip(ids, itertools.cycle(reqs)):
        engine.add_request(Request(rid, tok.encode(r.prompt, add_special_tokens=False),
                                   params, eos_token_id=2))
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    num_running = len(engine.scheduler.running)
    replays = graph_info(llm)["num_replays"]
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    engine.abort_requests(ids)
    return {"batch": batch, "num_running": num_running, "steps": steps,
            "step_s_median": statistics.median(times), "step_s_min": min(times),
            "graph_replays": graph_info(llm)["num_replays"] - replays}


def memory(llm: LLM, device: str) -> dict:
    out = {"kv_pool_bytes": kv_pool_bytes(llm), "max_allocated_bytes": None,
           "reserved_bytes": None}
    if device == "cuda":
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["reserved_bytes"] = torch.cuda.memory_reserved()
    return out


def run_engine(args, reqs: list[BenchRequest], enforce_eager: bool) -> dict:
    """One engine (graphs captured at start-up unless `enforce_eager`): mixed64, then the
    decode step at each batch size, then its memory; the engine is freed after."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batches),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=enforce_eager)
    start_s = time.perf_counter() - t0
    llm.generate(["warm up"] * 2, SamplingParams(max_tokens=4))
    result = {"enforce_eager": enforce_eager, "start_s": start_s,
              "mixed": run_mixed(llm, reqs, args.device),
              "decode_step": [decode_step_at_batch(llm, reqs, b, args.steps, args.device)
                              for b in args.batches]}
    result["cuda_graphs"] = graph_info(llm)
    result["memory"] = memory(llm, args.device)
    result["model_path"] = str(llm.model_config.model_path)
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def run_transformers(model_path: str, reqs: list[BenchRequest], args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token_id = 2
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    generated = requested = 0
    wall = 0.0
    with torch.inference_mode():
        for i in range(0, len(reqs), args.hf_batch_size):
            batch = reqs[i:i + args.hf_batch_size]
            new = max(r.max_tokens for r in batch)
            enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True,
                      add_special_tokens=False).to(args.device)
            sync(args.device)
            t0 = time.perf_counter()
            y = model.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                               pad_token_id=tok.pad_token_id)
            sync(args.device)
            wall += time.perf_counter() - t0
            generated += (y.shape[1] - enc["input_ids"].shape[1]) * len(batch)
            requested += sum(r.max_tokens for r in batch)
    mem = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"requests": len(reqs), "batch_size": args.hf_batch_size, "wall_s": wall,
            "output_tokens": generated, "requested_tokens": requested,
            "output_tok_per_s": generated / wall, "requested_tok_per_s": requested / wall,
            "max_allocated_bytes": mem}


def workload(args) -> list[BenchRequest]:
    reqs = build_workload("mixed64", args.seed)[:args.num_requests]
    if args.max_tokens:
        reqs = [BenchRequest(r.prompt, min(r.max_tokens, args.max_tokens)) for r in reqs]
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--num-requests", type=int, default=64, help="the first N of mixed64")
    ap.add_argument("--max-tokens", type=int, default=0, help="cap each request's (0: none)")
    ap.add_argument("--batches", default="1,64,256", help="decode-step batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    reqs = workload(args)
    graphs = run_engine(args, reqs, enforce_eager=False)
    eager = run_engine(args, reqs, enforce_eager=True)
    # Greedy: graphs and eager steps should give the same tokens (padding rows may pick other
    # GEMM kernels, so a rare late divergence is rounding, not a bug; count them).
    graph_ids, eager_ids = (r["mixed"].pop("token_ids") for r in (graphs, eager))
    same = sum(a == b for a, b in zip(graph_ids, eager_ids))
    hf = run_transformers(graphs["model_path"], reqs[:args.hf_requests], args)
    result = {
        "workload": "mixed64", "device": args.device, "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "engine": graphs, "engine_eager": eager, "transformers_batched": hf,
        "graph_vs_eager_identical_requests": f"{same}/{len(graph_ids)}",
        "speedup_over_transformers": graphs["mixed"]["output_tok_per_s"]
        / hf["output_tok_per_s"],
        "graph_speedup_per_batch": {
            str(g["batch"]): e["step_s_median"] / g["step_s_median"]
            for g, e in zip(graphs["decode_step"], eager["decode_step"])},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
