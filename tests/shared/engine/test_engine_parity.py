"""fp32 greedy token ids of the paged engine equal transformers `generate`, token for token:
one request at a time, all in one batch, with and without prefix caching, and under
preemption by recompute."""

from __future__ import annotations

import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_PARITY_TOKENS)


def _prompts(ids_list):
    return [{"prompt_token_ids": ids} for ids in ids_list]


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="256MiB", max_num_seqs=16)


def test_reference_is_long_enough(hf_greedy_reference):
    # The comparison means something only if most answers run the full 64 tokens.
    assert sum(len(r) == NUM_PARITY_TOKENS for r in hf_greedy_reference) >= 6


def test_one_at_a_time_matches_transformers(llm, parity_prompt_ids, hf_greedy_reference):
    for ids, ref in zip(parity_prompt_ids, hf_greedy_reference):
        out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
        assert out.token_ids == ref
        assert out.finish_reason == ("length" if len(ref) == NUM_PARITY_TOKENS
                                     and ref[-1] != 2 else "stop")


def test_batched_matches_transformers(llm, parity_prompt_ids, hf_greedy_reference):
    outs = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_reference


def test_prefix_cache_hit_matches_transformers(model_path, parity_prompt_ids,
                                               hf_greedy_reference):
    llm = LLM(model_path, kv_cache_memory="256MiB", enable_prefix_caching=True)
    first = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    second = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert [o.outputs[0].token_ids for o in first] == hf_greedy_reference
    assert [o.outputs[0].token_ids for o in second] == hf_greedy_reference
    # The second pass hit the cache: every full block of each prompt was reused.
    for o, ids in zip(second, parity_prompt_ids):
        assert o.num_cached_tokens >= (len(ids) - 1) // 16 * 16 > 0
    # In the first pass only the shared system-prompt blocks can hit: the request admitted
    # first (the shortest prompt, shortest-job-first) computes everything.
    shortest = min(range(len(parity_prompt_ids)), key=lambda i: len(parity_prompt_ids[i]))
    assert first[shortest].num_cached_tokens == 0


def test_prefix_caching_off_matches_transformers(model_path, parity_prompt_ids,
                                                 hf_greedy_reference):
    llm = LLM(model_path, kv_cache_memory="256MiB", enable_prefix_caching=False)
    llm.generate(_prompts(parity_prompt_ids), GREEDY)
    second = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert [o.outputs[0].token_ids for o in second] == hf_greedy_reference
    assert all(o.num_cached_tokens == 0 for o in second)


def test_preemption_by_recompute_matches_transformers(model_path, parity_prompt_ids,
                                                      hf_greedy_reference):
    # 8 requests of ~100-140 tokens need ~60 blocks of 16; 24 blocks force preemption.
    llm = LLM(model_path, num_gpu_blocks_override=24, max_num_batched_tokens=256)
    outs = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_reference
    llm.engine.kv_cache_manager.check_invariants()
    assert llm.engine.kv_cache_manager.num_free_blocks == 24 - 1


def test_chunked_prefill_matches_transformers(model_path, parity_prompt_ids,
                                              hf_greedy_reference):
    # A 32-token budget splits every prompt into several chunks, mixed with decodes.
    llm = LLM(model_path, kv_cache_memory="256MiB", max_num_batched_tokens=32)
    outs = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert max(len(ids) for ids in parity_prompt_ids) > 32
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_reference
