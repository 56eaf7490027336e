"""benchmarks/goodput.py's statistics on hand-made request records (no server, no timing)."""

from __future__ import annotations

import pytest

from benchmarks.goodput import (
    DEFAULT_SLOS,
    GoodputEstimate,
    RequestRecord,
    Slo,
    allowed_token_ids,
    attainment,
    compute_tpot,
    estimate_goodput,
    goodput_ratios,
    goodput_rps,
    markdown_table,
    meets_slo,
    parse_slo,
    percentile,
    poisson_offsets,
    sample_requests,
    summarize_rate,
    summarize_system,
)

CHAT = Slo("chat", 2000, 100)
RELAXED = Slo("relaxed", 4000, 200)


def rec(ttft: float, tpot: float, *, ok: bool = True, out: int = 128,
        itl: list[float] | None = None) -> RequestRecord:
    if not ok:
        return RequestRecord(ok=False, max_tokens=out, error="HTTP 503: b'busy'")
    return RequestRecord(ok=True, prompt_tokens=512, max_tokens=out, ttft=ttft, tpot=tpot,
                         e2e=ttft + tpot * (out - 1), output_tokens=out, itl=itl or [])


def ten_records() -> list[RequestRecord]:
    """6 meet chat (2 s / 100 ms); 2 miss its TTFT (one meets relaxed), 1 misses its TPOT
    (meets relaxed), 1 failed."""
    return [rec(0.5, 0.05), rec(1.0, 0.075), rec(1.5, 0.0625), rec(2.0, 0.1), rec(0.25, 0.025),
            rec(1.75, 0.09375), rec(2.5, 0.05), rec(5.0, 0.05), rec(1.0, 0.125),
            rec(0, 0, ok=False)]


def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10, 20, 30, 40], 75) == 30.0
    assert percentile([0, 100], 90) == 90.0
    assert percentile([3, 1, 2], 50) == 2.0  # unsorted input
    assert percentile([0, 10, 20, 30, 40], 0) == 0
    assert percentile([0, 10, 20, 30, 40], 100) == 40


def test_tpot_excludes_the_first_token():
    assert compute_tpot(e2e=2.5, ttft=0.5, output_tokens=5) == 0.5
    assert compute_tpot(e2e=1.0, ttft=1.0, output_tokens=1) == 0.0  # vLLM bench counts 0


def test_slo_bounds_are_inclusive_and_failures_never_meet():
    assert meets_slo(rec(2.0, 0.1), CHAT)
    assert not meets_slo(rec(2.001, 0.1), CHAT)
    assert not meets_slo(rec(0.1, 0.101), CHAT)
    assert not meets_slo(rec(0, 0, ok=False), RELAXED)


def test_attainment_counts_failed_requests_as_misses():
    records = ten_records()
    assert attainment(records, CHAT) == 0.6
    assert attainment(records, RELAXED) == 0.8
    assert attainment(records, Slo("tight", 1000, 50)) == 0.2
    assert attainment([], CHAT) == 0.0


def test_goodput_rps_is_good_requests_over_the_duration():
    assert goodput_rps(ten_records(), CHAT, duration=4.0) == 1.5
    assert goodput_rps(ten_records(), RELAXED, duration=16.0) == 0.5
    assert goodput_rps(ten_records(), CHAT, duration=0.0) == 0.0


def test_goodput_is_the_highest_rate_that_passes():
    points = [(0.4, 1.0), (0.6, 0.95), (0.8, 0.75), (1.0, 0.5)]
    est = estimate_goodput(points)
    assert est.rate == 0.6 and est.bracket == "within"
    assert est.interpolated == pytest.approx(0.6 + 0.05 / 0.2 * 0.2)  # 0.65
    assert estimate_goodput(list(reversed(points))) == est  # any order


def test_goodput_crossing_after_a_dip_uses_the_highest_passing_rate():
    est = estimate_goodput([(1, 0.95), (2, 0.8), (3, 0.92), (4, 0.5)])
    assert est.rate == 3
    assert est.interpolated == pytest.approx(3 + 0.02 / 0.42)


def test_goodput_edges():
    assert estimate_goodput([(1, 0.8), (2, 0.5)]) == GoodputEstimate(0.0, 0.0, "below")
    assert estimate_goodput([(1, 1.0), (2, 0.9)]) == GoodputEstimate(2, 2, "above")
    assert estimate_goodput([(1, 0.9), (2, 0.5)]) == GoodputEstimate(1, 1.0, "within")
    assert estimate_goodput([]) == GoodputEstimate(0.0, 0.0, "below")
    assert estimate_goodput([(1, 0.5), (2, 0.8)], threshold=0.75) == GoodputEstimate(
        2, 2, "above")


def test_summarize_rate():
    records = ten_records()
    records[0] = rec(0.5, 0.05, itl=[0.01, 0.02, 0.03])
    records[1] = rec(1.0, 0.075, out=100, itl=[0.05])
    records[1].max_tokens = 128
    records[2].usage_prompt_tokens = 511
    records[3].usage_prompt_tokens = 512
    s = summarize_rate(records, duration=4.0, rate=0.5, slos=(CHAT, RELAXED))
    assert (s["num_requests"], s["completed"], s["failed"], s["short_outputs"]) == (10, 9, 1, 1)
    assert s["prompt_length_mismatches"] == 1
    assert s["ttft_ms"]["p50"] == 1500.0  # median of 9 TTFTs
    assert s["itl_ms"]["p50"] == pytest.approx(25.0)
    assert s["attainment"] == {"chat": 0.6, "relaxed": 0.8}
    assert s["goodput_rps"] == {"chat": 1.5, "relaxed": 2.0}
    assert s["request_throughput"] == 9 / 4.0
    assert s["output_throughput"] == (8 * 128 + 100) / 4.0
    assert s["errors"] == ["HTTP 503: b'busy'"]


def test_system_goodput_and_the_ratio():
    def at(rate: float, chat: float, relaxed: float) -> dict:
        return {"rate": rate, "attainment": {"chat": chat, "relaxed": relaxed}}

    a = summarize_system([at(0.4, 1.0, 1.0), at(0.8, 0.9, 1.0)], (CHAT, RELAXED))
    b = summarize_system([at(0.4, 0.95, 1.0), at(0.8, 0.5, 0.8)], (CHAT, RELAXED))
    assert a["chat"] == {"rate": 0.8, "interpolated": 0.8, "bracket": "above"}
    assert b["chat"]["rate"] == 0.4
    assert b["chat"]["interpolated"] == pytest.approx(0.4 + 0.05 / 0.45 * 0.4)
    ratios = goodput_ratios(a, b)
    assert ratios["chat"]["rate"] == 2.0
    assert ratios["relaxed"]["rate"] == 2.0
    zero = {"chat": {"rate": 0.0, "interpolated": 0.0, "bracket": "below"}}
    assert goodput_ratios(a, zero) == {"chat": {"rate": None, "interpolated": None}}


class FakeTokenizer:
    all_special_ids = [0, 25]
    added_tokens_decoder = {27: "<extra>"}

    def __len__(self) -> int:
        return 30


def test_random_prompts_avoid_special_ids_and_are_seeded():
    ids = allowed_token_ids(FakeTokenizer())
    assert ids == [20, 21, 22, 23, 24, 26, 28, 29]
    reqs = sample_requests(ids, "chat", 20, seed=3)
    assert reqs == sample_requests(ids, "chat", 20, seed=3)
    assert reqs != sample_requests(ids, "chat", 20, seed=4)
    for prompt, max_tokens in reqs:
        assert 256 <= len(prompt) <= 768 and 64 <= max_tokens <= 192
        assert set(prompt) <= set(ids)
    for prompt, max_tokens in sample_requests(ids, "long", 5, seed=0):
        assert 1500 <= len(prompt) <= 3000 and 64 <= max_tokens <= 192


def test_poisson_offsets_start_at_zero_and_are_seeded():
    offsets = poisson_offsets(2000, rate=0.5, seed=1)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets) == poisson_offsets(2000, rate=0.5, seed=1)
    assert offsets != poisson_offsets(2000, rate=0.5, seed=2)
    assert offsets[-1] / 1999 == pytest.approx(2.0, rel=0.1)  # mean gap 1/rate


def test_parse_slo_and_the_default_grid():
    assert parse_slo("strict:500:40") == Slo("strict", 500.0, 40.0)
    assert [s.name for s in DEFAULT_SLOS] == ["tight", "chat", "relaxed"]


def test_markdown_table_shows_rates_goodput_and_the_ratio():
    rates = [summarize_rate(ten_records(), 4.0, 0.4, (CHAT,))]
    pdserve = {"rates": rates, "goodput": summarize_system(rates, (CHAT,))}
    summary = {"slos": [{"name": "chat", "ttft_ms": 2000, "tpot_ms": 100}],
               "systems": {"pdserve": pdserve, "vllm": {"skipped": "vllm not installed"}}}
    table = markdown_table(summary)
    assert "| pdserve | 0.4 | 9/10 | 1500 / " in table
    assert "| chat (2000 / 100) | 0 (0.00) |" in table
    assert "pdserve / vLLM" not in table
