"""Speculative decoding (n-gram, and a draft model: the default model cut to 2 layers) keeps
greedy outputs token-identical to transformers, the reference of the parity suite
(tests/shared/engine/test_engine_parity.py): alone, batched, with prefix-cache hits and
under preemption; drafts are scored and partly accepted; no block is left in either pool."""

from __future__ import annotations

import os

import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS

# The reference is transformers' fp32 model (as test_engine_parity.py's).
pytestmark = pytest.mark.skipif(os.environ.get("PDSERVE_QUANTIZATION", "none") != "none",
                                reason="fp32 parity with transformers")

NUM_TOKENS = NUM_PARITY_TOKENS // 2  # lean: half of the reference's tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
# prompt_lookup_min 1: drafts on most steps, so rejections and acceptances both happen;
# disable_by_batch_size 0: the batched runs speculate too.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1, "disable_by_batch_size": 0}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_config(request) -> dict:
    if request.param == "ngram":
        return NGRAM
    # vLLM's spelling: a config naming a model needs no method.
    return {"model": request.getfixturevalue("draft_model_path"), "num_speculative_tokens": 3,
            "disable_by_batch_size": 0}


def _prompts(ids_list):
    return [{"prompt_token_ids": ids} for ids in ids_list]


def _assert_drafts_scored(llm: LLM) -> None:
    stats = llm.engine.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.kv_cache_manager.check_invariants()
    assert not llm.engine.kv_cache_manager.req_to_blocks  # every block given back
    draft_kv = getattr(llm.engine.drafter, "kv", None)  # the draft model's own pool
    if draft_kv is not None:
        draft_kv.check_invariants()
        assert not draft_kv.seqs
        assert draft_kv.num_free_blocks == draft_kv.block_pool.num_gpu_blocks - 1


@pytest.fixture(scope="module")
def llm(model_path, spec_config):
    return LLM(model_path, kv_cache_memory="256MiB", max_num_seqs=16,
               speculative_config=spec_config)


def _reference(hf_greedy_reference):
    return [ref[:NUM_TOKENS] for ref in hf_greedy_reference]


def test_alone_matches_transformers(llm, parity_prompt_ids, hf_greedy_reference):
    for ids, ref in list(zip(parity_prompt_ids, _reference(hf_greedy_reference)))[:3]:
        out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
        assert out.token_ids == ref
    _assert_drafts_scored(llm)


def test_batched_and_cached_match_transformers(llm, parity_prompt_ids, hf_greedy_reference):
    # The module's engine already computed these prompts: every full prompt block hits.
    outs = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _reference(hf_greedy_reference)
    assert all(o.num_cached_tokens > 0 for o in outs)
    _assert_drafts_scored(llm)


def test_preemption_matches_transformers(model_path, spec_config, parity_prompt_ids,
                                         hf_greedy_reference):
    llm = LLM(model_path, num_gpu_blocks_override=24, max_num_batched_tokens=256,
              speculative_config=spec_config)
    outs = llm.generate(_prompts(parity_prompt_ids), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == _reference(hf_greedy_reference)
    _assert_drafts_scored(llm)
    assert llm.engine.kv_cache_manager.num_free_blocks == 24 - 1
