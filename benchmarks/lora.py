"""Multi-LoRA serving speed (issue 31) on the default model, one engine, one run:

- mixed batch: 32 streams over 4 adapters (rank 16 on all seven modules, the worst case)
  against the same 32 prompts on the base model alone: output tok/s ratio (target >= 0.8x);
- single stream: inter-token latency (median decode step) with an adapter against the base
  model (target <= 1.2x);
- cpu kernels: the segment loop (`kernels.lora_cpu.add_lora_segments`), the padded bmm
  (`add_lora_bmm`) and the C kernel (`add_lora_bgmv`, what the engine runs for decode-sized
  steps) at 32 decode tokens over 4 adapters, SmolLM2's four fused layers (ms per decoder
  layer).

    .venv/bin/python benchmarks/lora.py [--rounds 2] [--batch 32] [--max-tokens 64]

Adapters are written here (random A and B, PEFT's file layout). Prints a JSON summary. The
machine is shared and noisy: rounds alternate base and LoRA, and medians are quoted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.kernels.lora_cpu import (  # noqa: E402
    add_lora_bgmv,
    add_lora_bmm,
    add_lora_segments,
    load_kernel,
    lora_parts,
)
from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.lora.peft_loader import PEFT_MODULES  # noqa: E402
from pdserve.shared.lora.request import LoRARequest  # noqa: E402
from pdserve.shared.request import Request  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402

RANK = 16
# SmolLM2-135M: (in, out) of each PEFT module, and the fused layers' (in, out, parts)
MODULE_SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192),
                 "o_proj": (576, 576), "gate_proj": (576, 1536), "up_proj": (576, 1536),
                 "down_proj": (1536, 576)}
FUSED_SHAPES = ((576, 960, 3), (576, 576, 1), (576, 3072, 2), (1536, 576, 1))


def write_adapter(directory: Path, num_layers: int, seed: int) -> Path:
    """A PEFT-layout adapter of rank RANK on all seven modules, random A and B."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for name, (n_in, n_out) in MODULE_SHAPES.items():
            key = f"base_model.model.model.layers.{i}.{PEFT_MODULES[name][0]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, n_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, RANK, generator=g) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
        "target_modules": list(MODULE_SHAPES)}))
    return directory


def batch_tok_s(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def single_itl_ms(llm: LLM, prompt: list[int], lora, max_tokens: int, rid: str) -> float:
    """Median decode step (ms) of one stream: the inter-token latency."""
    engine = llm.engine
    engine.add_request(Request(rid, prompt, SamplingParams(temperature=0.0,
                                                           max_tokens=max_tokens,
                                                           ignore_eos=True), lora_request=lora))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps) * 1e3


def kernel_ms(num_tokens: int, num_adapters: int, repeats: int = 200) -> dict[str, float]:
    """One decode step's LoRA work over the four fused layers of one decoder layer."""
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(num_tokens) % num_adapters
    order = torch.argsort(slots, stable=True)
    bounds = [(s, int((slots[order] < s).sum()), int((slots[order] <= s).sum()))
              for s in range(num_adapters)]
    per = num_tokens // num_adapters
    padded = order.view(num_adapters, per)
    source_rows = torch.empty(num_tokens, dtype=torch.int64)
    source_rows[padded.reshape(-1)] = torch.arange(num_tokens)
    cases = []
    for n_in, n_out, parts in FUSED_SHAPES:
        a = torch.randn(num_adapters, parts * RANK, n_in, generator=g)
        # B block-diagonal as peft_loader stacks a fused layer's parts
        b = torch.zeros(num_adapters, n_out, parts * RANK)
        for p, rows in enumerate(torch.arange(n_out).chunk(parts)):
            b[:, rows, p * RANK:(p + 1) * RANK] = torch.randn(num_adapters, len(rows), RANK,
                                                              generator=g)
        blocks = [lora_parts(b[s]) for s in range(num_adapters)]
        bgmv = (b.transpose(1, 2).contiguous(),
                torch.full((num_adapters,), parts * RANK, dtype=torch.int64),
                torch.tensor([list(p) for p in blocks], dtype=torch.int64),
                torch.tensor([len(p) for p in blocks], dtype=torch.int64))
        cases.append((torch.randn(num_tokens, n_in), torch.zeros(num_tokens, n_out), a, b,
                      [a[s].t() for s in range(num_adapters)],
                      [b[s].t() for s in range(num_adapters)], bgmv))
    result = {}
    names = ("segments", "bmm") + (("bgmv",) if load_kernel() is not None else ())
    for name in names:
        t0 = time.perf_counter()
        for _ in range(repeats):
            for x, y, a, b, a_t, b_t, bgmv in cases:
                if name == "segments":
                    add_lora_segments(y, x, a_t, b_t, bounds, order)
                elif name == "bmm":
                    add_lora_bmm(y, x, a, b, padded, source_rows)
                else:
                    add_lora_bgmv(y, x, a, bgmv[0], slots, *bgmv[1:])
        result[name] = (time.perf_counter() - t0) / repeats * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    summary: dict = {"cpu_kernels_ms_per_layer": kernel_ms(args.batch, args.adapters)}
    llm = LLM(enable_lora=True, max_loras=args.adapters, max_lora_rank=RANK,
              enable_prefix_caching=False, max_num_seqs=max(args.batch, 32))
    num_layers = llm.engine.model_runner.args.num_hidden_layers
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    loras = [LoRARequest(f"bench{i}", i + 1, str(write_adapter(tmp / f"a{i}", num_layers, i)))
             for i in range(args.adapters)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]
    mixed = [loras[i % len(loras)] for i in range(args.batch)]
    batch_tok_s(llm, prompts[:4], mixed[:4], 4)  # warm-up: loads, slots, first calls
    samples: dict[str, list[float]] = {"base": [], "lora": [], "itl_base": [], "itl_lora": []}
    for r in range(args.rounds):
        for mode in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
            which = [None] * args.batch if mode == "base" else mixed
            samples[mode].append(batch_tok_s(llm, prompts, which, args.max_tokens))
            samples["itl_" + mode].append(single_itl_ms(
                llm, prompts[0], None if mode == "base" else loras[0], args.max_tokens,
                f"itl-{mode}-{r}"))
    med = {k: statistics.median(v) for k, v in samples.items()}
    summary.update({
        "batch": args.batch, "adapters": args.adapters, "rank": RANK,
        "threads": torch.get_num_threads(), "samples": samples,
        "base_tok_s": round(med["base"], 1), "lora_tok_s": round(med["lora"], 1),
        "tok_s_ratio": round(med["lora"] / med["base"], 3),
        "itl_base_ms": round(med["itl_base"], 2), "itl_lora_ms": round(med["itl_lora"], 2),
        "itl_ratio": round(med["itl_lora"] / med["itl_base"], 3),
    })
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
