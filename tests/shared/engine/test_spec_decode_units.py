"""N-gram proposer, --speculative-config parsing, acceptance and the back-off (no model)."""

from __future__ import annotations

import pytest

from pdserve.shared.engine.spec_decode.config import SpeculativeConfig
from pdserve.shared.engine.spec_decode.ngram_proposer import NgramProposer
from pdserve.shared.engine.spec_decode.scheduling import propose_drafts
from pdserve.shared.engine.spec_decode.verification import (
    SpecDecodingStats,
    max_num_drafts,
    num_accepted_drafts,
)
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams


def ngram(k=3, lo=1, hi=3, backoff=4) -> SpeculativeConfig:
    config = SpeculativeConfig.from_value({
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
        "prompt_lookup_max": hi, "disable_by_batch_size": backoff})
    assert config is not None
    return config


def test_proposer_copies_what_followed_the_latest_longest_match():
    p = NgramProposer(ngram(k=3, lo=1, hi=3))
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3]
    # suffix (2, 3) last occurred at 6-7 (before the end): 7 followed, then 2, 3.
    assert p.propose(tokens) == [7, 2, 3]
    # the 3-gram (7, 2, 3) never occurred before: fall back to shorter n-grams
    assert p.propose(tokens, max_num_drafts=2) == [7, 2]
    assert p.propose([5, 6, 7]) == []  # no earlier occurrence
    assert p.propose(tokens, max_num_drafts=0) == []
    # prompt_lookup_min 2: a single repeated token is not enough
    assert NgramProposer(ngram(lo=2, hi=2)).propose([8, 1, 9, 1]) == []
    assert NgramProposer(ngram(k=2, lo=2, hi=4)).propose([1, 2, 3, 4, 1, 2]) == [3, 4]


def test_config_parsing_follows_vllm_and_names_bad_keys():
    assert SpeculativeConfig.from_value(None) is None
    assert SpeculativeConfig.from_value("") is None
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2}')
    assert c is not None
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, 4)
    c = SpeculativeConfig.from_value({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    for bad, word in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"},
                       "model"),
                      ("{not json", "JSON")):
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.from_value(bad)


def test_acceptance_and_stats():
    assert num_accepted_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted_drafts([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted_drafts([5], [4, 1]) == 0
    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]


def _decoding(request_id, prompt, max_tokens=100, **params) -> Request:
    r = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))
    r.output_token_ids = [prompt[0]]
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_drafts_respect_limits_and_back_off_under_load():
    config = ngram(k=3, lo=1, hi=2, backoff=2)
    proposer = NgramProposer(config)
    a = _decoding("a", [1, 2, 3, 1, 2, 3, 4], max_tokens=3)  # 2 tokens left: 1 draft
    b = _decoding("b", [1, 2, 3, 1, 2, 3, 4], presence_penalty=0.5)  # not speculated
    assert max_num_drafts(a, max_model_len=100) == 1
    propose_drafts(proposer, config, [a, b], max_model_len=100)
    assert a.spec_token_ids == [2] and b.spec_token_ids == []
    c = _decoding("c", [1, 2, 1, 2, 1])
    propose_drafts(proposer, config, [a, b, c], max_model_len=100)  # 3 > 2 running
    assert a.spec_token_ids == [] and c.spec_token_ids == []


def test_flag_round_trips_through_pdserve_up():
    import argparse

    from pdserve.services.launcher.plan import engine_flags
    from pdserve.shared.engine_args import EngineArgs

    value = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    flags = engine_flags(EngineArgs(speculative_config=value))
    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(flags)
    config = EngineArgs.from_cli_args(ns).create_speculative_config()
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=2)
    assert EngineArgs().create_speculative_config() is None  # off by default
