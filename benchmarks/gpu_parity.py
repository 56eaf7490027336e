"""Greedy agreement of the engine with transformers, per parity prompt: how many new tokens
match before the first divergence, against transformers in the same dtype on the same
device, and against transformers fp32 there.

    python3 benchmarks/gpu_parity.py --device cuda --dtype bfloat16 [--out FILE]

The prompts are the parity suite's (tests/conftest.py PARITY_MESSAGES, NUM_PARITY_TOKENS).
fp32 on a device must agree on every token (the parity suite asserts it); a 16-bit dtype
is reported, not asserted: rounding differs between the engine's kernels and transformers'
eager attention, and one flipped argmax changes the rest of the answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.shared.llm import LLM  # noqa: E402
from pdserve.shared.sampling_params import SamplingParams  # noqa: E402
from pdserve.shared.tokenizer import apply_chat_template  # noqa: E402
from tests.conftest import (  # noqa: E402
    NUM_PARITY_TOKENS,
    PARITY_MESSAGES,
    transformers_greedy,
)


def num_agreeing(a: list[int], b: list[int]) -> int:
    """Tokens before the first divergence (the shorter length when one is a prefix)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--num-prompts", type=int, default=len(PARITY_MESSAGES))
    ap.add_argument("--max-tokens", type=int, default=NUM_PARITY_TOKENS)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=16)
    prompts = [apply_chat_template(llm.tokenizer, m)
               for m in PARITY_MESSAGES[:args.num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    ours = [o.outputs[0].token_ids for o in outs]
    model_path = str(llm.model_config.model_path)
    del llm
    same = transformers_greedy(model_path, prompts, args.device, args.dtype, args.max_tokens)
    fp32 = same if args.dtype == "float32" else transformers_greedy(
        model_path, prompts, args.device, "float32", args.max_tokens)

    rows = [{"prompt": i, "prompt_tokens": len(ids), "engine_tokens": len(o),
             "agree_same_dtype": num_agreeing(o, s), "same_dtype_tokens": len(s),
             "agree_fp32": num_agreeing(o, f), "fp32_tokens": len(f)}
            for i, (ids, o, s, f) in enumerate(zip(prompts, ours, same, fp32))]
    result = {
        "device": args.device, "dtype": args.dtype, "max_tokens": args.max_tokens,
        "num_prompts": len(rows),
        "num_identical_same_dtype": sum(o == s for o, s in zip(ours, same)),
        "num_identical_fp32": sum(o == f for o, f in zip(ours, fp32)),
        "min_agree_same_dtype": min(r["agree_same_dtype"] for r in rows),
        "min_agree_fp32": min(r["agree_fp32"] for r in rows),
        "prompts": rows,
        "wall_s": time.perf_counter() - t0,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
