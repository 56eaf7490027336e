"""Runs the Triton SGMV LoRA kernels under TRITON_INTERPRET=1 against the reference; prints
JSON {"check name": relative error}. Run in a subprocess by `test_lora_kernels.py` (the flag
is read when triton is imported); fp32, tiny shapes."""

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdserve.kernels.lora_cpu import lora_reference  # noqa: E402
from pdserve.kernels.triton_lora import add_lora_sgmv  # noqa: E402


def check(seed: int, request_slots: list[int], q_lens: list[int], num_slots: int, rank: int,
          in_features: int, out_features: int) -> float:
    g = torch.Generator().manual_seed(seed)
    token_slots = torch.from_numpy(np.repeat(np.asarray(request_slots), q_lens))
    num_tokens = int(token_slots.shape[0])
    x = torch.randn(num_tokens, in_features, generator=g)
    y = torch.randn(num_tokens, out_features, generator=g)
    lora_a = torch.randn(num_slots, rank, in_features, generator=g)
    lora_b = torch.randn(num_slots, out_features, rank, generator=g)
    lora_a[0, rank // 2:] = 0  # a slot of a smaller rank, zero-padded
    lora_b[0, :, rank // 2:] = 0
    expected = y + lora_reference(x, lora_a, lora_b, token_slots)
    lora_rows = torch.nonzero(token_slots >= 0).flatten()
    order = torch.argsort(token_slots[lora_rows], stable=True)
    token_indices = lora_rows[order]
    sorted_slots = token_slots[token_indices]
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    add_lora_sgmv(y, x, lora_a, lora_b, token_indices, starts.int(), counts.int(), slots.int(),
                  int(counts.max()))
    return float((y - expected).norm() / expected.norm())


def main() -> None:
    results = {
        # decodes of 3 adapters interleaved with base-model rows
        "decode_mixed": check(0, [1, -1, 0, 2, 1, 0, -1, 2, 1], [1] * 9, 3, 16, 40, 72),
        # prefill chunks longer than BLOCK_M beside decodes; a fused layer's rank 48
        "prefill_mixed": check(1, [0, 1, -1, 1, 0], [1, 37, 5, 1, 20], 2, 48, 33, 50),
        "one_adapter": check(2, [0, 0, 0], [3, 1, 18], 1, 8, 64, 64),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
