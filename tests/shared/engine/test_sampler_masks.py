"""Sampler masks of vLLM's request fields: allowed_token_ids and bad_words (batched rows)."""

from __future__ import annotations

import pytest
import torch

from pdserve.shared.engine.sampler import Sampler
from pdserve.shared.engine.sampling_metadata import SamplingMetadata, banned_bad_words_tokens
from pdserve.shared.engine.spec_decode.verification import can_speculate
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.engine.test_sampler import LOGITS, make_request, run

VOCAB = LOGITS.shape[0]


def test_banned_tokens_follow_vllm_prefix_rule():
    words = [[5], [1, 2, 3], [7, 8]]
    assert banned_bad_words_tokens(words, []) == [5]  # multi-token words need their prefix
    assert banned_bad_words_tokens(words, [9, 1]) == [5]
    assert banned_bad_words_tokens(words, [9, 1, 2]) == [3, 5]
    assert banned_bad_words_tokens(words, [1, 2, 7]) == [5, 8]
    assert banned_bad_words_tokens(words, [2, 1]) == [5]  # order matters
    assert banned_bad_words_tokens([[4, 4]], [4]) == [4]
    assert banned_bad_words_tokens([], [1, 2]) == []


def test_allowed_token_ids_restrict_every_row_kind_in_one_batch():
    """Greedy, plain random, top-k and seeded rows beside an unrestricted greedy row."""
    requests = [make_request("greedy", temperature=0.0, allowed_token_ids=[6, 9]),
                make_request("free", temperature=0.0),
                make_request("random", temperature=1.5, allowed_token_ids=[3, 10, 11]),
                make_request("top-k", temperature=1.0, top_k=2, allowed_token_ids=[8, 9, 11]),
                make_request("seeded", temperature=1.0, seed=7, allowed_token_ids=[1, 4])]
    logits = LOGITS.repeat(len(requests), 1)
    sampler = Sampler(seed=0)
    seen: dict[str, set[int]] = {r.request_id: set() for r in requests}
    for _ in range(200):
        out = run(sampler, requests, logits)
        for r, t in zip(requests, out.sampled_token_ids, strict=True):
            seen[r.request_id].add(t)
    assert seen["greedy"] == {6}  # the most likely allowed token
    assert seen["free"] == {0}
    assert seen["random"] == {3, 10, 11}
    assert seen["top-k"] == {8, 9}  # top-k among the allowed ones
    assert seen["seeded"] == {1} or seen["seeded"] == {4}  # one key per output position


def test_bad_words_ban_single_tokens_and_continuations_greedy():
    requests = [make_request("single", temperature=0.0, bad_words_token_ids=[[0], [1]]),
                make_request("after-prefix", temperature=0.0, output_token_ids=[3, 4],
                             bad_words_token_ids=[[4, 0]]),
                make_request("no-prefix", temperature=0.0, output_token_ids=[3, 5],
                             bad_words_token_ids=[[4, 0]]),
                make_request("both", temperature=0.0, allowed_token_ids=[0, 1, 2],
                             bad_words_token_ids=[[0]])]
    out = run(Sampler(seed=0), requests, LOGITS.repeat(len(requests), 1))
    assert out.sampled_token_ids == [2, 1, 0, 1]


def test_logprobs_stay_those_of_the_raw_logits():
    requests = [make_request("a", temperature=0.0, logprobs=0, allowed_token_ids=[5],
                             bad_words_token_ids=[[0]])]
    out = run(Sampler(seed=0), requests, LOGITS.unsqueeze(0))
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 5
    assert lp.logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[5].item(), abs=1e-6)


def test_metadata_masks_are_built_once_per_step():
    requests = [make_request("a", allowed_token_ids=[1, 3, VOCAB + 5]),
                make_request("b"),
                make_request("c", output_token_ids=[2], bad_words_token_ids=[[2, 6], [9]])]
    md = SamplingMetadata.from_requests(requests, VOCAB, "cpu")
    assert md.allowed_rows.tolist() == [0]
    assert md.disallowed_mask.shape == (1, VOCAB)
    assert (~md.disallowed_mask[0]).nonzero().squeeze(1).tolist() == [1, 3]
    assert list(zip(md.bad_words_rows.tolist(), md.bad_words_token_ids.tolist(),
                    strict=True)) == [(2, 6), (2, 9)]
    assert not md.is_plain_greedy
    plain = SamplingMetadata.from_requests([make_request("d", temperature=0.0)], VOCAB, "cpu")
    assert plain.allowed_rows is None and plain.bad_words_rows is None


def test_fields_are_validated_and_bad_words_never_speculate():
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="^allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="^bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])
    assert not can_speculate(make_request("x", bad_words_token_ids=[[1, 2]]))
    assert can_speculate(make_request("y", allowed_token_ids=[1, 2]))


def test_the_engine_refuses_ids_outside_the_vocabulary():
    from pdserve.shared.engine.scheduling_policy import validate_request

    validate_request(make_request("ok", allowed_token_ids=[VOCAB - 1],
                                  bad_words_token_ids=[[1, VOCAB - 1]]), VOCAB, 100, 16, 64)
    with pytest.raises(ValueError, match=rf"^allowed_token_ids: token id {VOCAB} "):
        validate_request(make_request("a", allowed_token_ids=[1, VOCAB]), VOCAB, 100, 16, 64)
    with pytest.raises(ValueError, match=rf"^bad_words_token_ids: token id {VOCAB} "):
        validate_request(make_request("b", bad_words_token_ids=[[1, VOCAB]]), VOCAB, 100, 16,
                         64)
