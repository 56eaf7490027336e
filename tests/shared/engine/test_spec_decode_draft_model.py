"""The draft-model proposer: --speculative-config parsing, the vocabulary check, the draft's
own KV bookkeeping (sync / rollback / free), and the default model as its own draft
(acceptance ~1 under greedy: the draft really proposes; seeded sampling unchanged; no
block left in either pool after finishing or aborting).

The parity suite with a truncated draft is tests/shared/engine/test_spec_decode_parity.py.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.draft_kv import DraftKVCache
from pdserve.shared.engine.spec_decode.draft_model import DraftModelProposer
from pdserve.shared.llm import LLM
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS

NUM_TOKENS = NUM_PARITY_TOKENS // 2


def test_config_names_a_draft_model_as_vllm_does():
    c = SpeculativeConfig.from_value('{"model": "/m", "num_speculative_tokens": 2}')
    assert (c.method, c.model, c.draft_kv_cache_memory) == ("draft_model", "/m", None)
    c = SpeculativeConfig.from_value({"method": "draft_model", "model": "/m",
                                      "num_speculative_tokens": 4,
                                      "draft_kv_cache_memory": "64MiB"})
    assert (c.method, c.num_speculative_tokens, c.draft_kv_cache_memory) == \
        ("draft_model", 4, 64 << 20)
    for bad, word in (({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                      ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2},
                       "model"),
                      ({"model": "/m", "num_speculative_tokens": 2,
                        "draft_kv_cache_memory": "lots"}, "draft_kv_cache_memory")):
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_value(bad)


def test_a_draft_with_another_vocabulary_is_refused(model_path, tmp_path):
    config = json.loads(open(os.path.join(model_path, "config.json")).read())
    config["vocab_size"] = 32000
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = SpeculativeConfig.from_value({"model": str(tmp_path), "num_speculative_tokens": 2})
    runner = SimpleNamespace(args=SimpleNamespace(vocab_size=49152))
    with pytest.raises(ValueError, match="vocabulary of 32000 tokens, the target 49152"):
        DraftModelProposer(spec, SimpleNamespace(max_model_len=2048), runner)


def _request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens[:3], SamplingParams(max_tokens=100),
                   output_token_ids=tokens[3:])


def test_draft_kv_syncs_rolls_back_and_frees():
    kv = DraftKVCache(num_gpu_blocks=8, block_size=4)
    req = _request([1, 2, 3, 4, 5])
    assert kv.sync(req) == 0
    assert len(kv.allocate("r", 5 + 2)) == 2  # 5 known tokens + 2 fed drafts
    kv.append_tokens("r", [1, 2, 3, 4, 5], confirmed=True)
    kv.append_tokens("r", [6], confirmed=False)
    kv.append_tokens("r", [9], confirmed=False)
    kv.check_invariants()
    # The target accepted draft 6, rejected 9, and sampled 7 instead.
    req.output_token_ids += [6, 7]
    assert kv.sync(req) == 6
    assert kv.seqs["r"].token_ids == [1, 2, 3, 4, 5, 6] and kv.seqs["r"].num_confirmed == 6
    kv.truncate("r", 3)  # rollback frees the blocks past the kept positions
    assert len(kv.seqs["r"].blocks) == 1  # (block ids are read off the blocks)
    assert kv.num_free_blocks == 6
    kv.check_invariants()
    assert kv.allocate("r", 40) is None  # more than the pool: nothing changes
    kv.free("r")
    kv.free("r")  # twice is a no-op
    assert kv.num_free_blocks == 7 and not kv.seqs
    kv.check_invariants()


@pytest.fixture(scope="module")
def self_draft_llm(model_path):
    """The default model drafting for itself: greedy drafts equal the target's tokens."""
    return LLM(model_path, kv_cache_memory="64MiB", seed=0, speculative_config={
        "method": "draft_model", "model": model_path, "num_speculative_tokens": 3,
        "disable_by_batch_size": 0})


def _assert_no_blocks_held(llm: LLM) -> None:
    llm.engine.kv_cache_manager.check_invariants()
    assert not llm.engine.kv_cache_manager.req_to_blocks
    draft_kv = llm.engine.drafter.kv
    draft_kv.check_invariants()
    assert not draft_kv.seqs
    assert draft_kv.num_free_blocks == draft_kv.block_pool.num_gpu_blocks - 1


@pytest.mark.fp32_only
def test_self_draft_accepts_nearly_everything(self_draft_llm, parity_prompt_ids,
                                              hf_greedy_reference):
    out = self_draft_llm.generate({"prompt_token_ids": parity_prompt_ids[0]},
                                  SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))
    assert out[0].outputs[0].token_ids == hf_greedy_reference[0][:NUM_TOKENS]
    stats = self_draft_llm.engine.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens / stats.num_drafts > 1  # accepted drafts per step
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[0] >= 0.9 * stats.num_drafts
    _assert_no_blocks_held(self_draft_llm)


def test_seeded_sampling_is_unchanged_by_the_draft(self_draft_llm, model_path,
                                                   parity_prompt_ids):
    off = LLM(model_path, kv_cache_memory="64MiB", seed=0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=77, n=3)
    prompt = {"prompt_token_ids": parity_prompt_ids[1]}
    want = [c.token_ids for c in off.generate(prompt, params)[0].outputs]
    assert [c.token_ids for c in self_draft_llm.generate(prompt, params)[0].outputs] == want
    _assert_no_blocks_held(self_draft_llm)


def test_abort_and_preemption_free_the_draft_blocks(self_draft_llm, parity_prompt_ids):
    engine = self_draft_llm.engine
    for i, ids in enumerate(parity_prompt_ids[:2]):
        engine.add_request(Request(f"abort-{i}", list(ids),
                                   SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)))
    for _ in range(3):
        engine.step()
    assert set(engine.drafter.kv.seqs) == {"abort-0", "abort-1"}
    engine.abort_requests(["abort-0"])
    assert set(engine.drafter.kv.seqs) == {"abort-1"}
    engine.drafter.remove_requests(["abort-1"])  # as a preemption does: it catches up again
    engine.step()
    assert engine.drafter.kv.num_computed_tokens("abort-1") == \
        engine.scheduler.requests["abort-1"].num_tokens + 2  # known tokens + k - 1 drafts
    engine.abort_requests(["abort-1"])
    _assert_no_blocks_held(self_draft_llm)
