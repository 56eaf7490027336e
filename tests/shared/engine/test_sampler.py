"""Sampler: sampling distributions, seeded reproducibility, penalties, min_tokens, logprobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from pdserve.shared.engine.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_tokens,
    apply_penalties,
    sample_key,
)
from pdserve.shared.engine.sampling_metadata import SamplingMetadata
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams

EOS = 2
# Distinct logits over a small vocabulary: every truncation below has a clear margin.
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5])
NUM_SAMPLES = 20_000


def make_request(request_id: str, prompt_token_ids: list[int] | None = None,
                 output_token_ids: list[int] | None = None, **params: Any) -> Request:
    request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids or [0],
                      sampling_params=SamplingParams(**params), eos_token_id=EOS)
    request.output_token_ids.extend(output_token_ids or [])
    return request


def run(sampler: Sampler, requests: list[Request], logits: torch.Tensor) -> SamplerOutput:
    metadata = SamplingMetadata.from_requests(requests, logits.shape[1], "cpu")
    return sampler(logits, metadata)


def expected_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The exact truncated, renormalized distribution, in float64."""
    x = logits.double().numpy() / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    if top_k > 0:
        probs[order[top_k:]] = 0.0
        probs /= probs.sum()
    if top_p < 1.0:
        before = np.cumsum(probs[order]) - probs[order]  # mass of the more likely tokens
        assert np.min(np.abs(before - top_p)) > 1e-3, "top_p too close to a boundary"
        probs[order[before >= top_p]] = 0.0
        probs /= probs.sum()
    if min_p > 0.0:
        ratio = probs / probs.max()
        assert np.min(np.abs(ratio - min_p)) > 1e-3, "min_p too close to a boundary"
        probs[ratio < min_p] = 0.0
        probs /= probs.sum()
    return probs


def assert_matches(token_ids: list[int], probs: np.ndarray) -> None:
    """Truncated tokens never appear; the rest pass a chi-square goodness-of-fit test."""
    counts = np.bincount(token_ids, minlength=len(probs))
    assert counts[probs == 0.0].sum() == 0
    kept = probs > 0.0
    assert kept.sum() >= 2
    result = stats.chisquare(counts[kept], probs[kept] * len(token_ids))
    assert result.pvalue > 1e-3, (counts, probs)


CASES: dict[str, dict[str, Any]] = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(top_k=4),
    "top_p": dict(top_p=0.65),
    "top_k_top_p": dict(top_k=6, top_p=0.7),
    "min_p": dict(min_p=0.3),
    "all": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.1),
}


@pytest.mark.parametrize(("name", "num_top_p_candidates", "vocab_size"), [
    *[(name, 256, len(LOGITS)) for name in CASES],
    # Nucleus wider than the 3 candidates: the rows are redone over the whole vocabulary.
    ("top_p", 3, len(LOGITS)),
    ("all", 3, len(LOGITS)),
    # 2 candidates, then 32 of 200 (a middle pass), which hold the nucleus.
    ("top_p", 2, 200),
])
def test_frequencies_match_truncated_distribution(name: str, num_top_p_candidates: int,
                                                  vocab_size: int) -> None:
    params = CASES[name]
    sampling_params = SamplingParams(**params)
    requests = [Request(f"r{i}", [0], sampling_params, eos_token_id=EOS)
                for i in range(NUM_SAMPLES)]
    # Extra tokens, if any, far below the others (about 1e-10 of the mass together).
    row = torch.cat([LOGITS, torch.full((vocab_size - len(LOGITS),), -30.0)])
    out = run(Sampler(seed=0, num_top_p_candidates=num_top_p_candidates), requests,
              row.repeat(NUM_SAMPLES, 1))
    assert_matches(out.sampled_token_ids, expected_probs(row, **params))
    assert out.logprobs == [None] * NUM_SAMPLES


def test_seeded_rows_follow_the_distribution() -> None:
    # One seeded request per row, each with its own generator (per-token draws, gathered).
    params: dict[str, Any] = dict(temperature=0.9, top_k=7, top_p=0.85)
    requests = [make_request(f"r{i}", seed=i, **params) for i in range(NUM_SAMPLES)]
    out = run(Sampler(seed=0), requests, LOGITS.repeat(NUM_SAMPLES, 1))
    assert_matches(out.sampled_token_ids, expected_probs(LOGITS, **params))


@pytest.mark.parametrize("num_top_p_candidates", [256, 3])
def test_mixed_batch_groups_follow_their_distributions(num_top_p_candidates: int) -> None:
    groups: list[dict[str, Any]] = [
        dict(temperature=0.0), dict(temperature=0.8), dict(top_k=3), dict(top_p=0.88),
        dict(top_p=0.3), dict(min_p=0.3, temperature=1.5),
    ]
    per_group = 5000
    requests = [make_request(f"r{i}", **groups[i % len(groups)])
                for i in range(per_group * len(groups))]
    logits = LOGITS.repeat(len(requests), 1)
    # Width 3: the top_p=0.88 rows overflow the candidates and are redone, the 0.3 rows do
    # not. Width 256 (> vocab): all rows take the whole sorted vocabulary, top-k by masking.
    sampler = Sampler(seed=1, num_top_p_candidates=num_top_p_candidates)
    tokens = run(sampler, requests, logits).sampled_token_ids
    assert torch.equal(logits, LOGITS.repeat(len(requests), 1)), "the input must not change"
    assert set(tokens[0::len(groups)]) == {0}
    for g in range(1, len(groups)):
        assert_matches(tokens[g::len(groups)], expected_probs(LOGITS, **groups[g]))


def fixed_logits(request_id: str, vocab_size: int) -> torch.Tensor:
    """Logits that depend on the request only, never on the batch ("d" shares those of "c")."""
    generator = torch.Generator().manual_seed(ord({"d": "c"}.get(request_id, request_id)[-1]))
    return torch.randn(vocab_size, generator=generator) * 2.0


def run_steps(sampler: Sampler, requests: list[Request], num_steps: int,
              vocab_size: int = 500) -> dict[str, list[int]]:
    """Sample `num_steps` tokens per request, appending them as the scheduler would."""
    logits = torch.stack([fixed_logits(r.request_id, vocab_size) for r in requests])
    for _ in range(num_steps):
        out = run(sampler, requests, logits)
        for request, token_id in zip(requests, out.sampled_token_ids, strict=True):
            request.append_output_token(token_id)
    return {r.request_id: list(r.output_token_ids) for r in requests}


SEEDED: dict[str, dict[str, Any]] = {
    "a": dict(seed=1234, top_p=0.9),
    "b": dict(seed=99, top_k=50, temperature=0.8),
    "c": dict(seed=7, min_p=0.05),
    "d": dict(seed=7, min_p=0.05),  # same seed as "c": same tokens (same logits too)
}
OTHERS: dict[str, dict[str, Any]] = {
    "u1": dict(top_k=200),
    "u2": dict(temperature=0.0),
    "u3": dict(temperature=1.1),
    "u4": dict(top_p=0.5, top_k=400),
}


@pytest.mark.parametrize("num_top_p_candidates", [256, 2])
def test_seeded_samples_do_not_depend_on_the_batch(num_top_p_candidates: int) -> None:
    num_steps = 8
    alone = {rid: run_steps(Sampler(seed=0), [make_request(rid, **p)], num_steps)[rid]
             for rid, p in SEEDED.items() if rid != "d"}
    for tokens in alone.values():
        assert len(set(tokens)) > 1, "the generator must advance between steps"
    orders = [["u1", "b", "u2", "a", "u3", "d", "c", "u4"], ["c", "a", "u3", "b", "d"]]
    for seed, order in enumerate(orders):
        params = {**SEEDED, **OTHERS}
        requests = [make_request(rid, **params[rid]) for rid in order]
        sampler = Sampler(seed=seed + 10, num_top_p_candidates=num_top_p_candidates)
        batched = run_steps(sampler, requests, num_steps)
        for rid, tokens in alone.items():
            assert batched[rid] == tokens, (rid, order)
        assert batched["d"] == batched["c"]


def test_a_seeded_token_depends_only_on_seed_and_output_position() -> None:
    """Counter-based: a request that arrives with its first k tokens (a split decode, a
    failover continuation, a recompute after preemption) in a fresh sampler, under another
    id, continues exactly as the uninterrupted run; nothing is kept per request."""
    for rid, params in SEEDED.items():
        whole = run_steps(Sampler(seed=0), [make_request(rid, **params)], 12)[rid]
        for k in (1, 5, 11):
            resumed = make_request(rid + "-again", output_token_ids=whole[:k], **params)
            resumed_logits = fixed_logits(rid, 500).unsqueeze(0)
            tokens = list(whole[:k])
            sampler = Sampler(seed=k)
            for _ in range(12 - k):
                token = run(sampler, [resumed], resumed_logits).sampled_token_ids[0]
                resumed.append_output_token(token)
                tokens.append(token)
            assert tokens == whole, (rid, k)
    assert not hasattr(Sampler(seed=0), "_generators")


def test_sample_keys_are_stable_and_distinct() -> None:
    # Pinned: a change of the key derivation is a deliberate, visible edit (it changes every
    # seeded output).
    assert sample_key(0, 0) == 0xA706DD2F4D197E6F
    assert [sample_key(1234, p) for p in range(3)] == [
        0x9E17E35F6D9238ED, 0x42AB7C5A642DABE7, 0x817D9BCF022AF0FD]
    keys = {sample_key(seed, position) for seed in range(64) for position in range(256)}
    assert len(keys) == 64 * 256
    assert len({k & 0xFFFFFFFF for k in keys}) == 64 * 256  # what a CPU generator keeps
    assert sample_key(-1, 0) == sample_key((1 << 64) - 1, 0)  # seeds are taken mod 2^64


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    logits[3, 10] = logits[3, 700] = 50.0
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(16)]
    metadata = SamplingMetadata.from_requests(requests, 1000, "cpu")
    assert metadata.all_greedy and metadata.is_plain_greedy
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[3] == 10
    assert out.logprobs == [None] * 16
    # Greedy rows among random ones, and greedy rows that need the slow path.
    requests[5] = make_request("r5", temperature=1.0)
    requests[6] = make_request("r6", temperature=0.0, logprobs=2)
    tokens = run(Sampler(seed=0), requests, logits).sampled_token_ids
    for i in set(range(16)) - {5}:
        assert tokens[i] == int(logits[i].argmax())


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -2.0, 3.0],
                           [1.0, 2.0, -1.0, 0.5, -2.0, 3.0],
                           [1.0, 2.0, -1.0, 0.5, -2.0, 3.0]])
    requests = [
        make_request("pen", [1, 2, 5, 1], [3, 3, 5], temperature=0.0, repetition_penalty=2.0,
                     frequency_penalty=0.5, presence_penalty=0.25),
        make_request("none", [1, 2], [3, 3, 5], temperature=0.0),
        make_request("presence", [1], [0, 0], temperature=0.0, presence_penalty=-1.0),
    ]
    metadata = SamplingMetadata.from_requests(requests, 6, "cpu")
    processed = logits.clone()
    apply_penalties(processed, metadata)
    # Row 0. Repetition over prompt+output {1, 2, 3, 5}, once per token even when listed
    # several times: 2.0/2, -1.0*2, 0.5/2, 3.0/2.
    # Then output counts {3: 2, 5: 1}: 3 -> 0.25 - 2*0.5 - 0.25, 5 -> 1.5 - 0.5 - 0.25.
    assert processed[0].tolist() == [1.0, 1.0, -2.0, -1.0, -2.0, 0.75]
    assert processed[1].tolist() == logits[1].tolist()
    # Presence only (no repetition penalty: the prompt is not even gathered); 0 is in the
    # output twice but presence counts once: 1.0 - (-1.0).
    assert processed[2].tolist() == [2.0, 2.0, -1.0, 0.5, -2.0, 3.0]
    original = logits.clone()
    out = Sampler()(logits, metadata)
    assert torch.equal(logits, original), "the sampler must not modify its input"
    # Row 0: 5 wins raw; after penalties 0 and 1 tie at 1.0 and the lowest index wins.
    assert out.sampled_token_ids == [0, 5, 5]


def test_repetition_penalty_counts_output_tokens_and_negative_logits() -> None:
    logits = torch.tensor([[-3.0, 0.0, 4.0, 1.0]])
    requests = [make_request("r", [3], [0, 2], temperature=0.0, repetition_penalty=4.0)]
    processed = logits.clone()
    apply_penalties(processed, SamplingMetadata.from_requests(requests, 4, "cpu"))
    assert processed[0].tolist() == [-12.0, 0.0, 1.0, 0.25]


@pytest.mark.parametrize("with_repetition", [True, False])
def test_penalties_match_a_per_token_reference(with_repetition: bool) -> None:
    # Without any repetition penalty in the batch, the prompt is not even gathered.
    vocab_size = 40
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab_size, generator=gen) * 3.0
    requests = []
    for i in range(6):
        prompt = torch.randint(0, vocab_size, (int(torch.randint(1, 30, (1,), generator=gen)),),
                               generator=gen).tolist()
        output = torch.randint(0, 10, (i * 7,), generator=gen).tolist()  # many repeats
        params: dict[str, Any] = dict(
            repetition_penalty=[1.0, 1.7, 0.6][i % 3] if with_repetition else 1.0,
            frequency_penalty=[0.0, 0.3, -0.4][i % 3 - 1],
            presence_penalty=[0.8, 0.0, -1.5][i % 2])
        requests.append(make_request(f"r{i}", prompt, output, temperature=0.0, **params))
    expected = logits.clone()
    for row, request in enumerate(requests):
        sp = request.sampling_params
        for token in range(vocab_size):
            value = expected[row, token].item()
            if token in request.prompt_token_ids or token in request.output_token_ids:
                rp = sp.repetition_penalty
                value = value / rp if value > 0 else value * rp
            count = request.output_token_ids.count(token)
            value -= sp.frequency_penalty * count + sp.presence_penalty * (count > 0)
            expected[row, token] = value
    processed = logits.clone()
    apply_penalties(processed, SamplingMetadata.from_requests(requests, vocab_size, "cpu"))
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-5)
    assert not torch.equal(processed, logits)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.tensor([0.0, 0.0, 10.0, 0.0, 0.0, 9.0, 0.0, 8.0]).repeat(5, 1)
    requests = [
        make_request("early", output_token_ids=[4], temperature=0.0, min_tokens=3,
                     stop_token_ids=[5, 100]),
        make_request("done", output_token_ids=[4, 4, 4], temperature=0.0, min_tokens=3,
                     stop_token_ids=[5]),
        make_request("ignore_eos", temperature=0.0, min_tokens=3, stop_token_ids=[5],
                     ignore_eos=True),
        make_request("random", temperature=1.0, min_tokens=1, stop_token_ids=[5]),
        make_request("no_min", temperature=0.0, stop_token_ids=[5]),
    ]
    metadata = SamplingMetadata.from_requests(requests, 8, "cpu")
    assert metadata.min_tokens_rows is not None and metadata.min_tokens_token_ids is not None
    rows, token_ids = metadata.min_tokens_rows.tolist(), metadata.min_tokens_token_ids.tolist()
    pairs = list(zip(rows, token_ids, strict=True))
    assert pairs == [(0, 2), (0, 5), (2, 5), (3, 2), (3, 5)]  # stop id 100 >= vocab: ignored
    processed = logits.clone()
    apply_min_tokens(processed, metadata)
    inf = float("inf")
    assert processed[0].tolist() == [0.0, 0.0, -inf, 0.0, 0.0, -inf, 0.0, 8.0]
    assert processed[2].tolist() == [0.0, 0.0, 10.0, 0.0, 0.0, -inf, 0.0, 8.0]
    assert torch.equal(processed[1], logits[1])
    assert run(Sampler(), requests, logits).sampled_token_ids[:3] == [7, 2, 2]
    assert run(Sampler(), requests, logits).sampled_token_ids[4] == 2
    # Random rows never draw a suppressed token, though 2 and 5 hold almost all the mass.
    many = [make_request(f"r{i}", min_tokens=1, stop_token_ids=[5]) for i in range(2000)]
    tokens = run(Sampler(seed=0), many, logits[:1].repeat(2000, 1)).sampled_token_ids
    assert {2, 5}.isdisjoint(tokens) and 7 in tokens


def test_logprobs_come_from_raw_logits() -> None:
    vocab_size = 50
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(3)) * 3.0
    raw_argmax = logits.argmax(dim=-1).tolist()
    requests = [
        make_request("greedy5", temperature=0.0, logprobs=5),
        make_request("random2", top_k=3, logprobs=2),
        make_request("none", temperature=0.0),
        make_request("greedy0", temperature=0.0, logprobs=0),
        # The raw argmax is in the prompt: the penalty moves the choice, not the logprobs.
        make_request("penalized", [raw_argmax[4]], temperature=0.0, logprobs=3,
                     repetition_penalty=100.0),
    ]
    expected = torch.log_softmax(logits, dim=-1)
    out = run(Sampler(seed=0), requests, logits.clone())
    tokens = out.sampled_token_ids
    assert out.logprobs[2] is None
    for row, n in [(0, 5), (1, 2), (3, 0), (4, 3)]:
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(expected[row, tokens[row]].item(), abs=1e-6)
        top_values, top_ids = expected[row].topk(n)
        assert lp.top_token_ids == top_ids.tolist()
        assert lp.top_logprobs == pytest.approx(top_values.tolist(), abs=1e-6)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    greedy, penalized = out.logprobs[0], out.logprobs[4]
    assert greedy is not None and penalized is not None
    assert greedy.top_token_ids[0] == tokens[0] == raw_argmax[0]
    assert tokens[1] in logits[1].topk(3).indices.tolist()
    assert tokens[4] != raw_argmax[4]
    assert penalized.top_token_ids[0] == raw_argmax[4]


def test_metadata_from_requests() -> None:
    requests = [
        make_request("g", temperature=0.0, seed=5, top_k=3),
        make_request("plain", top_k=100, seed=11, logprobs=4),
        make_request("disabled_k", top_k=-1, min_p=0.2),
        make_request("k", top_k=7, frequency_penalty=1.0, logprobs=0),
        make_request("p", top_p=0.5, seed=-1),
    ]
    md = SamplingMetadata.from_requests(requests, 50, "cpu")
    assert md.request_ids == ["g", "plain", "disabled_k", "k", "p"]
    assert md.top_k.tolist() == [3, 50, 50, 7, 50]
    assert md.top_p.tolist() == [1.0, 1.0, 1.0, 1.0, 0.5]
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.2, 0.0, 0.0])
    assert md.temperature.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert (md.greedy_rows, md.plain_rows, md.truncated_rows) == ([0], [1, 2], [3, 4])
    assert md.max_top_k == 7 and md.has_top_p and md.has_top_p_without_top_k and md.has_min_p
    assert md.seeds == {1: 11, 4: (1 << 64) - 1}  # greedy rows need no generator
    assert md.num_logprobs == [None, 4, None, 0, None] and md.max_num_logprobs == 4
    assert not md.all_greedy and not md.all_random and not md.is_plain_greedy
    assert md.penalties is not None and md.penalties.rows == [3]
    assert md.penalties.prompt_token_ids is None  # no repetition penalty in the batch
    assert md.penalties.output_token_ids.tolist() == [[50]]  # no outputs yet: padding only
    assert md.min_tokens_rows is None


# ---- logit_bias


def test_logit_bias_forces_and_bans_tokens_in_one_batch():
    """Rows with and without logit_bias in one batch: +100 forces a token (greedy and
    random), -100 bans the argmax, rows without a bias are untouched; logprobs stay those
    of the raw logits (as vLLM's)."""
    sampler = Sampler(seed=0)
    logits = LOGITS.repeat(4, 1)
    requests = [make_request("force-greedy", temperature=0.0, logit_bias={9: 100.0}),
                make_request("ban-greedy", temperature=0.0, logit_bias={0: -100.0},
                             logprobs=1),
                make_request("plain-greedy", temperature=0.0),
                make_request("force-random", temperature=1.0, seed=3,
                             logit_bias={7: 100.0, 11: -5.0})]
    out = run(sampler, requests, logits)
    assert out.sampled_token_ids == [9, 1, 0, 7]
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs[1].token_id == 1
    assert out.logprobs[1].logprob == pytest.approx(raw[1].item(), abs=1e-5)
    assert torch.equal(logits, LOGITS.repeat(4, 1))  # the input is not modified


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
