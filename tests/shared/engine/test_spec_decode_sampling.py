"""Speculative decoding under temperature sampling keeps the output distribution: seeded
requests give the same tokens with and without n-gram speculation, and a chi-square test
on a fixed prompt finds the first, second and third tokens' distributions unchanged
(engine seed fixed: the test is deterministic, it cannot flake)."""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": 0}
PROMPT = ("Random words: apple, river, cloud, apple, stone, river, music, cloud, apple, "
          "stone, music, river, cloud, stone, apple, music, river, stone, cloud, music")
NUM_SAMPLES = 240


@pytest.fixture(scope="module")
def prompt(tokenizer):
    # 2 blocks + 1 token: every sample after the first hits both blocks in the prefix cache.
    return {"prompt_token_ids": tokenizer.encode(PROMPT, add_special_tokens=False)[:33]}


@pytest.fixture(scope="module")
def llms(model_path):
    off = LLM(model_path, kv_cache_memory="256MiB", max_num_seqs=NUM_SAMPLES, seed=0)
    on = LLM(model_path, kv_cache_memory="256MiB", max_num_seqs=NUM_SAMPLES, seed=0,
             speculative_config=NGRAM)
    return off, on


def test_seeded_requests_are_unchanged_by_speculation(llms, prompt):
    off, on = llms
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, n=8)
    want = [c.token_ids for c in off.generate(prompt, params)[0].outputs]
    got = [c.token_ids for c in on.generate(prompt, params)[0].outputs]
    assert got == want
    stats = on.engine.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square homogeneity test; tokens seen < 10 times pooled in one bin."""
    common = sorted(t for t in set(a) | set(b) if a[t] + b[t] >= 10)
    rows = [[a[t] for t in common], [b[t] for t in common]]
    rest = [sum(a.values()) - sum(rows[0]), sum(b.values()) - sum(rows[1])]
    if sum(rest):
        rows[0].append(rest[0])
        rows[1].append(rest[1])
    assert len(rows[0]) >= 2, "a single token: nothing to compare"
    return float(chi2_contingency(rows).pvalue)


def test_token_distributions_match_without_speculation(llms, prompt):
    off, on = llms
    params = SamplingParams(temperature=1.0, max_tokens=3, n=NUM_SAMPLES, ignore_eos=True)
    before = on.engine.scheduler.spec_decoding_stats.num_drafts
    samples = [[c.token_ids for c in llm.generate(prompt, params)[0].outputs]
               for llm in (off, on)]
    assert on.engine.scheduler.spec_decoding_stats.num_drafts - before >= NUM_SAMPLES // 4
    for position in range(3):
        counts = [Counter(ids[position] for ids in s) for s in samples]
        assert _chi_square_p(*counts) > 0.01, (position, counts)
    # Not a tautology: speculation drew its own samples.
    assert samples[0] != samples[1]
