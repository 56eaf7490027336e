"""Gemma 2 and Gemma 3 (tests/shared/models/test_gemma.py) over the split (issue 34): real
prefill and decode services over gRPC, the KV of local and global layers crossing between
them, three prompts at once (5, 37 and 200 tokens against a 32-token window); greedy tokens
equal transformers fp32 on the same random checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.services.helpers import greedy, run_split, start_cluster, wait_leak_free
from tests.shared.models.test_architectures import PROMPT_LENS
from tests.shared.models.test_gemma import FAMILIES, build_gemma_checkpoint

pytestmark = [pytest.mark.fp32_only, pytest.mark.slow]

MAX_TOKENS = 12


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_split_equals_transformers(name, tmp_path):
    config_class, extra = FAMILIES[name]
    model = build_gemma_checkpoint(tmp_path, config_class, **extra)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.inference_mode():
        want = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    # chunks of 64 tokens: the 200-token prompt's prefill crosses the window in chunks
    cluster = await start_cluster(str(tmp_path), None, kv_cache_memory="64MiB",
                                  max_model_len=512, max_num_batched_tokens=64)
    try:
        results = await asyncio.gather(*(
            run_split(cluster, f"{name}-{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
            for i, p in enumerate(prompts)))
        assert [r.token_ids for r in results] == want
        assert all(r.prefill.HasField("kv_transfer_params") for r in results)  # KV crossed
        prefill, decode = await wait_leak_free(cluster)
        assert prefill.num_used_blocks == decode.num_used_blocks == 0
    finally:
        await cluster.close()
