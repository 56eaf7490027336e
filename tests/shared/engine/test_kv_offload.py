"""The disk tier in a real engine (the offline LLM, fp32): prefixes evicted to disk and loaded
back give exactly the tokens an engine without the tier computes afresh (the parity prompts,
one at a time and batched, and a multi-turn chat), and an engine restarted on the same
directory serves a returning prompt from disk."""

from __future__ import annotations

import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.tokenizer import apply_chat_template
from tests.conftest import PARITY_MESSAGES
from tests.kv_tiers import evict_all

pytestmark = pytest.mark.fp32_only

BS = 16
MAX_TOKENS = 24
TIER_ENGINE = dict(num_gpu_blocks_override=45, max_model_len=512, kv_offload_size="1GiB")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
FOLLOW_UPS = ["Now say it again in one sentence.", "And what happens in winter?"]


def num_full_blocks(prompt: list[int]) -> int:
    """The prompt blocks a prefix hit can cover (the last prompt token is always computed)."""
    return (len(prompt) - 1) // BS


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def chat(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """A three-turn chat's prompts and greedy answers, each answer part of the next prompt."""
    messages, prompts, answers = list(PARITY_MESSAGES[2]), [], []
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up is not None:
            messages += [{"role": "user", "content": follow_up}]
        prompts.append(apply_chat_template(llm.tokenizer, messages))
        out = llm.generate({"prompt_token_ids": prompts[-1]}, GREEDY)[0].outputs[0]
        answers.append(list(out.token_ids))
        messages += [{"role": "assistant", "content": out.text}]
    return prompts, answers


@pytest.fixture(scope="module")
def reference(model_path, parity_prompt_ids) -> dict:
    """An engine without the tier (nor prefix caching): every token computed afresh."""
    llm = LLM(model_path, max_model_len=512, kv_cache_memory="64MiB",
              enable_prefix_caching=False)
    prompts, answers = chat(llm)
    ref = {"parity": tokens_of(llm, parity_prompt_ids), "chat": prompts, "chat_tokens": answers}
    llm.engine.shutdown()
    return ref


@pytest.fixture(scope="module")
def tier_llm(model_path, tmp_path_factory):
    llm = LLM(model_path, kv_offload_dir=str(tmp_path_factory.mktemp("tier")), **TIER_ENGINE)
    yield llm
    llm.engine.shutdown()


def test_each_parity_prompt_loaded_from_disk_gives_the_same_tokens(tier_llm, reference,
                                                                 parity_prompt_ids):
    engine, off = tier_llm.engine, tier_llm.engine.kv_offloader
    tier_llm.generate([{"prompt_token_ids": p} for p in parity_prompt_ids],
                      SamplingParams(temperature=0.0, max_tokens=1))
    for prompt, expected in zip(parity_prompt_ids, reference["parity"]):
        evict_all(engine)  # nothing of it in the pool: every prefix block comes from disk
        loads = off.store.stats.loads
        out = tier_llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == expected
        assert off.store.stats.loads - loads == num_full_blocks(prompt) >= 2
        assert out.num_cached_tokens == num_full_blocks(prompt) * BS
    assert off.store.stats.load_failures == off.store.stats.store_failures == 0
    engine.kv_cache_manager.check_invariants()
    off.check_invariants()


def test_batched_requests_sharing_a_disk_prefix(tier_llm, reference, parity_prompt_ids):
    engine, off = tier_llm.engine, tier_llm.engine.kv_offloader
    evict_all(engine)
    # seven of the eight open with the default system turn: one first block among them
    assert len({tuple(p[:BS]) for p in parity_prompt_ids}) == 2
    loads, disk_hits = off.store.stats.loads, off.stats.disk_hits
    outs = tier_llm.generate([{"prompt_token_ids": p} for p in parity_prompt_ids], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference["parity"]
    # all admitted in one step, before any load ended: each loads its own copy of the shared
    # blocks (not cached until loaded), and every prefix block comes from disk
    total = sum(num_full_blocks(p) for p in parity_prompt_ids)
    assert off.stats.disk_hits - disk_hits == total
    assert off.store.stats.loads - loads == total
    assert [o.num_cached_tokens for o in outs] == \
        [num_full_blocks(p) * BS for p in parity_prompt_ids]
    assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == \
        engine.kv_cache_manager.block_pool.num_gpu_blocks - 1
    engine.kv_cache_manager.check_invariants()
    off.check_invariants()


def test_multi_turn_chat_reloads_earlier_turns(tier_llm, reference):
    engine, off = tier_llm.engine, tier_llm.engine.kv_offloader
    for turn, (prompt, expected) in enumerate(zip(reference["chat"],
                                                  reference["chat_tokens"])):
        evict_all(engine)
        loads = off.store.stats.loads
        out = tier_llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == expected, f"turn {turn}"
        if turn:  # the earlier turns (prompt and answer) come back from disk
            previous = reference["chat"][turn - 1]
            assert off.store.stats.loads - loads >= num_full_blocks(previous)
            assert out.num_cached_tokens >= num_full_blocks(previous) * BS
            assert out.num_cached_tokens == (off.store.stats.loads - loads) * BS
    off.check_invariants()


def test_restart_on_the_same_directory_serves_from_disk(model_path, reference,
                                                        parity_prompt_ids, tmp_path):
    prompt, expected = parity_prompt_ids[4], reference["parity"][4]  # the longest (4 blocks)
    first = LLM(model_path, kv_offload_dir=str(tmp_path), **TIER_ENGINE)
    assert tokens_of(first, [prompt]) == [expected]
    evict_all(first.engine)
    on_disk = first.engine.kv_offloader.store.hashes()
    first.engine.shutdown()
    del first

    again = LLM(model_path, kv_offload_dir=str(tmp_path), **TIER_ENGINE)
    try:
        off = again.engine.kv_offloader
        assert sorted(off.store.hashes()) == sorted(on_disk) and off.store.stats.loads == 0
        out = again.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == expected
        assert off.store.stats.loads == num_full_blocks(prompt) == 4
        assert out.num_cached_tokens == 4 * BS
        off.check_invariants()
    finally:
        again.engine.shutdown()
