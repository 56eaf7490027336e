"""CPU attention cost of one SmolLM2-135M decode step at batch 64, beside its matmuls.

    .venv/bin/python benchmarks/attention_cpu.py [--threads 2] [--repeats 15]

Times, per step of 30 layers (9 heads, 3 kv heads, head_dim 64, fp32, block_size 16; 64
decodes with seq_lens drawn from 20..650; a shuffled block table; one cache per layer so the
step streams ~1 GB of K/V as the real model does):
  - `matmuls`: each layer's projections at batch 64 (q, k, v, o, gate, up, down);
  - `torch_native`: `prepare_torch_metadata` once, then store + attention for every layer,
    decodes on the compiled C kernel (the engine's CPU path);
  - `torch_ops`: the same with `use_native=False` (the fallback without a C compiler);
  - `reference`: `kernels.reference`, per request (fewer repeats: it is slow).
And a chunked-prefill layer (2 requests, 512 new tokens over a 512-token cached prefix)
beside that layer's matmuls at 1024 tokens. Every repeat runs each case once, interleaved;
medians (and minima) are printed as JSON. This machine is shared and noisy: quote ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels import reference, torch_paged
from pdserve.kernels.attn_metadata import AttentionMetadata  # noqa: E402
from pdserve.kernels.ops import prepare_torch_metadata  # noqa: E402

NUM_LAYERS, HIDDEN, INTERMEDIATE = 30, 576, 1536
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def make_step(seq_lens: list[int], query_lens: list[int], num_layers: int, seed: int) -> dict:
    """Block table, lengths and per-layer caches/queries/new K/V for one step."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = sum(query_lens)
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(block_table[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return {
        "attn_metadata": AttentionMetadata(
            torch.cat(slots), block_table, torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc, max(query_lens), max(seq_lens)),
        "layers": [
            {"k_cache": torch.randn(shape, generator=gen),
             "v_cache": torch.randn(shape, generator=gen),
             "query": torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen),
             "key": torch.randn(kv_shape, generator=gen),
             "value": torch.randn(kv_shape, generator=gen)}
            for _ in range(num_layers)
        ],
    }


def run_attention(step: dict, backend: str) -> None:
    """store + attention for every layer of the step, as the model runs them."""
    attn_metadata, metadata = step["attn_metadata"], None
    if backend != "reference":
        metadata = prepare_torch_metadata(attn_metadata, BLOCK_SIZE, NUM_KV_HEADS)
    module = reference if backend == "reference" else torch_paged
    for layer in step["layers"]:
        module.store_kv_cache(layer["key"], layer["value"], layer["k_cache"], layer["v_cache"],
                              attn_metadata.slot_mapping)
        args = (layer["query"], layer["k_cache"], layer["v_cache"], attn_metadata, SCALE)
        if backend == "reference":
            reference.paged_attention(*args)
        else:
            torch_paged.paged_attention(*args, torch_metadata=metadata,
                                        use_native=backend == "torch_native")


def make_matmuls(num_tokens: int, num_layers: int) -> Callable[[], None]:
    """The layers' projections, nn.Linear style ([out, in] weights), at num_tokens rows."""
    kv_size = NUM_KV_HEADS * HEAD_DIM
    shapes = [(HIDDEN, HIDDEN), (kv_size, HIDDEN), (kv_size, HIDDEN), (HIDDEN, HIDDEN),
              (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN)]
    layers = [([torch.randn(s) for s in shapes], torch.randn(HIDDEN, INTERMEDIATE))
              for _ in range(num_layers)]
    x, h = torch.randn(num_tokens, HIDDEN), torch.randn(num_tokens, INTERMEDIATE)

    def run() -> None:
        for weights, down in layers:
            for w in weights:
                F.linear(x, w)
            F.linear(h, down)

    return run


def time_cases(cases: dict[str, Callable[[], None]], repeats: dict[str, int]) -> dict:
    for run in cases.values():  # warm-up (and the C kernel's one-time compile)
        run()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(max(repeats.values())):
        for name, run in cases.items():
            if r < repeats[name]:
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2)}
            for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with torch.inference_mode():
        seq_lens = torch.randint(20, 651, (64,)).tolist()
        decode = make_step(seq_lens, [1] * 64, NUM_LAYERS, args.seed)
        prefill = make_step([1024, 1024], [512, 512], 1, args.seed)
        decode_cases = {
            "matmuls": make_matmuls(64, NUM_LAYERS),
            "torch_native": lambda: run_attention(decode, "torch_native"),
            "torch_ops": lambda: run_attention(decode, "torch_ops"),
            "reference": lambda: run_attention(decode, "reference"),
            "prepare_metadata": lambda: prepare_torch_metadata(
                decode["attn_metadata"], BLOCK_SIZE, NUM_KV_HEADS),
        }
        repeats = {name: args.repeats for name in decode_cases}
        repeats["reference"] = args.reference_repeats
        decode_times = time_cases(decode_cases, repeats)
        prefill_cases = {
            "matmuls": make_matmuls(1024, 1),
            "torch": lambda: run_attention(prefill, "torch_native"),
            "reference": lambda: run_attention(prefill, "reference"),
        }
        prefill_times = time_cases(prefill_cases, {name: args.repeats for name in prefill_cases})
    summary = {
        "threads": args.threads,
        "decode_step_64x30_layers": decode_times,
        # Minima approximate a quiet machine; medians include other tenants' load.
        "decode_attention_over_matmuls": {
            stat: {name: round(decode_times[name][stat] / decode_times["matmuls"][stat], 3)
                   for name in ("torch_native", "torch_ops", "reference")}
            for stat in ("median_ms", "min_ms")},
        "decode_kv_mib_per_layer": round(sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 8 / 2**20, 1),
        "prefill_layer_2x512_over_512_prefix": prefill_times,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
