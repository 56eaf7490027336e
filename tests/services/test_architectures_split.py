"""The architectures of tests/shared/models/test_architectures.py over the split (issue 34):
real prefill and decode services over gRPC, the KV crossing between them, three prompts at
once; greedy tokens equal transformers fp32 on the same random checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.services.helpers import greedy, run_split, start_cluster, wait_leak_free
from tests.shared.models.test_architectures import FAMILIES, PROMPT_LENS, build_checkpoint

pytestmark = [pytest.mark.fp32_only, pytest.mark.slow]

MAX_TOKENS = 12


def _record_held_block_ids(connector) -> dict[str, list[int]]:
    """request_id -> the block ids the prefill's connector was handed when it finished (the
    prefill's own: they never cross the wire)."""
    held: dict[str, list[int]] = {}
    request_finished = connector.request_finished

    def recording(request, block_ids):
        held[request.request_id] = list(block_ids)
        return request_finished(request, block_ids)

    connector.request_finished = recording
    return held


@pytest.mark.parametrize("name", ["qwen3", "llama3-rope", "mistral-window", "qwen2-window"])
async def test_split_equals_transformers(name, tmp_path):
    config_class, extra = FAMILIES[name]
    model = build_checkpoint(tmp_path, config_class, **extra)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.inference_mode():
        want = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    # NOTE: chunks of 64 tokens: a windowed prefill frees its first blocks before the
    # transfer, whose held list then has the null block for them; the decode must free those
    # blocks unread and uncached.
    cluster = await start_cluster(str(tmp_path), None, kv_cache_memory="64MiB",
                                  max_model_len=512, max_num_batched_tokens=64)
    try:
        held = _record_held_block_ids(cluster.prefill.worker.kv_connector)
        results = await asyncio.gather(*(
            run_split(cluster, f"{name}-{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
            for i, p in enumerate(prompts)))
        assert [r.token_ids for r in results] == want
        assert all(r.prefill.HasField("kv_transfer_params") for r in results)  # KV crossed
        prefill, decode = await wait_leak_free(cluster)
        assert prefill.num_used_blocks == decode.num_used_blocks == 0
        if name == "mistral-window":  # the 200-token prompt's first blocks left the window
            assert 0 in held[f"{name}-2"]
    finally:
        await cluster.close()


async def test_split_longrope_past_its_original_length(tmp_path):
    """Phi-3 longrope (test_rope_scaling.py's checkpoint, original length 64) over the split:
    a prompt that stays short, one that crosses 64 on the decode instance (its short KV
    recomputed there with the long factors), one of exactly 64 (crossing at the decode's
    first step: the received KV dropped) and one long from the start (its KV computed and
    hashed long by the prefill, taken as such by the decode)."""
    from tests.shared.models.test_rope_scaling import FAMILIES as ROPE_FAMILIES
    from tests.shared.models.test_rope_scaling import MAX_POS, hf_generate

    config_class, extra, _ = ROPE_FAMILIES["longrope"]
    model = build_checkpoint(tmp_path, config_class, **extra)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 60, 64, 200)]
    want = [hf_generate(model, [p], MAX_TOKENS)[0] for p in prompts]
    cluster = await start_cluster(str(tmp_path), None, kv_cache_memory="64MiB",
                                  max_model_len=MAX_POS, max_num_batched_tokens=64)
    try:
        results = await asyncio.gather(*(
            run_split(cluster, f"longrope-{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
            for i, p in enumerate(prompts)))
        assert [r.token_ids for r in results] == want
        assert all(r.prefill.HasField("kv_transfer_params") for r in results)  # KV crossed
        prefill, decode = await wait_leak_free(cluster)
        assert prefill.num_used_blocks == decode.num_used_blocks == 0
    finally:
        await cluster.close()


async def test_a_windowed_prompt_longer_than_the_decode_pool(tmp_path):
    """Mistral windows every layer: a decode whose pool cannot hold the whole prompt
    allocates and fetches only the window's blocks (the rest lead its list as the null
    block), and the tokens stay transformers'."""
    config_class, extra = FAMILIES["mistral-window"]
    model = build_checkpoint(tmp_path, config_class, **extra)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49152, (300,), generator=g).tolist()
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    cluster = await start_cluster(str(tmp_path), None, num_gpu_blocks_override=12,
                                  max_model_len=512)
    try:
        result = await run_split(cluster, "long-window", prompt,
                                 greedy(MAX_TOKENS, ignore_eos=True))
        assert result.token_ids == want
        prefill, decode = await wait_leak_free(cluster)
        assert prefill.num_used_blocks == decode.num_used_blocks == 0
    finally:
        await cluster.close()
