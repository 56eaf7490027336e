"""SLO-aware prefill budget: the streams' slack, the cost model, the cap, and the scheduler
honouring it (decodes never capped, prompt chunks capped, nothing lost)."""

from __future__ import annotations

import time

import pytest

from pdserve.shared.engine.slo_budget import (
    LOOKAHEAD_TOKENS,
    MIN_CHUNK_TOKENS,
    MIN_PREFILL_SAMPLE,
    TARGET_FRACTION,
    TTFT_URGENT_FRACTION,
    PrefillBudget,
    TTFTUnreachableError,
    decode_slack,
)
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from tests.shared.engine.test_scheduler import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_all,
    shape,
    step,
)


def decoding(rid: str, num_output: int, first_token_time: float, max_tokens: int | None = 100,
             arrival_time: float = 0.0) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens),
                arrival_time=arrival_time)
    r.num_computed_tokens = 3
    r.output_token_ids = [5] * num_output
    r.first_token_time = first_token_time
    return r


def test_decode_slack_is_the_lookahead_budget_minus_time_used_and_decode_time():
    # 11 tokens since t=10: the target grants 0.1 s x (10 + L) for the next L tokens; 1.5 s
    # used; L decode-only steps of 0.04 s still to run (L = 64: 7.4 - 1.5 - 2.56 = 3.34 s).
    r = decoding("a", 11, first_token_time=10.0)
    assert LOOKAHEAD_TOKENS == 64
    assert decode_slack([r], 0.1, 0.04, now=11.5) == pytest.approx(3.34)
    # the most hurried stream sets it
    late = decoding("b", 2, first_token_time=9.0)
    assert decode_slack([r, late], 0.1, 0.04, now=11.5) == pytest.approx(
        0.1 * (1 + LOOKAHEAD_TOKENS) - 2.5 - LOOKAHEAD_TOKENS * 0.04)


def test_decode_slack_looks_ahead_no_further_than_max_tokens():
    r = decoding("a", 8, first_token_time=0.0, max_tokens=10)  # 2 tokens left
    assert decode_slack([r], 0.1, 0.04, now=0.5) == pytest.approx(0.1 * 9 - 0.5 - 2 * 0.04)


def test_decode_slack_of_a_stream_that_arrived_with_its_first_token_starts_at_arrival():
    r = decoding("a", 1, first_token_time=None, arrival_time=3.0)  # type: ignore[arg-type]
    r.first_token_time = None
    assert decode_slack([r], 0.1, 0.0, now=3.2) == pytest.approx(0.1 * LOOKAHEAD_TOKENS - 0.2)


def test_decode_slack_ignores_prompts_and_is_inf_without_decodes():
    prompt = Request("p", [1] * 40, SamplingParams(max_tokens=4))
    prompt.num_computed_tokens = 16
    assert decode_slack([prompt], 0.1, 0.04, now=5.0) == float("inf")


def test_first_token_time_is_stamped_once_by_the_first_output_token():
    r = Request("a", [1, 2], SamplingParams())
    assert r.first_token_time is None
    r.append_output_token(7)
    first = r.first_token_time
    assert first is not None
    r.append_output_token(8)
    assert r.first_token_time == first


def test_budget_learns_the_cost_and_caps_by_the_smallest_slack():
    budget = PrefillBudget(0.1, max_num_batched_tokens=2048, min_prefill_tokens=16)
    tpot = budget.slo_tpot_s
    assert tpot == pytest.approx(0.1 * TARGET_FRACTION)  # the margin
    r = decoding("a", 11, first_token_time=10.0)
    assert budget.cap([r], now=11.0) is None  # no cost estimate yet
    budget.observe(0.04, num_decode_tokens=8, num_prefill_tokens=0)
    budget.observe(0.04, num_decode_tokens=8, num_prefill_tokens=0)
    assert budget.t_decode_s == pytest.approx(tpot / 4 + (0.04 - tpot / 4) * (1 - 0.8 ** 2))
    budget.t_decode_s = 0.04
    # a 512-token prefill alone took 0.72 s: 1.4 ms per token
    budget.observe(0.72, num_decode_tokens=0, num_prefill_tokens=512)
    assert budget.s_per_token == pytest.approx(0.72 / 512)
    # beside decodes, the decode part is taken off first
    budget.observe(0.04 + 0.72, num_decode_tokens=8, num_prefill_tokens=512)
    assert budget.s_per_token == pytest.approx(0.72 / 512)
    budget.observe(5.0, num_decode_tokens=0, num_prefill_tokens=MIN_PREFILL_SAMPLE - 1)
    assert budget.s_per_token == pytest.approx(0.72 / 512)  # too small a sample
    # the slack over the lookahead, in tokens at the learned cost
    slack = tpot * (10 + LOOKAHEAD_TOKENS) - 3.0 - LOOKAHEAD_TOKENS * 0.04
    assert MIN_CHUNK_TOKENS < slack / (0.72 / 512) < 2048
    assert budget.cap([r], now=13.0) == int(slack / (0.72 / 512))
    # no stream decoding: no cap
    assert budget.cap([], now=11.0) is None
    # a stream behind: no prompt this step (decode-only steps rebuild the slack) ...
    behind = decoding("b", 2, first_token_time=0.0)
    assert budget.cap([r, behind], now=11.0) == 0
    # ... unless the decodes alone miss the target: then the floor, so prompts progress
    budget.t_decode_s = 0.2
    assert budget.cap([r, behind], now=11.0) == 16
    # much slack: the token budget
    fresh = decoding("c", 1, first_token_time=11.0)
    budget.t_decode_s, budget.s_per_token = 0.04, 1e-5
    assert budget.cap([fresh], now=11.0) == 2048


def test_a_cap_below_the_smallest_worthwhile_chunk_schedules_no_prompt():
    budget = PrefillBudget(0.1, max_num_batched_tokens=2048, min_prefill_tokens=16)
    budget.t_decode_s, budget.s_per_token = 0.04, 0.001
    # slack worth 100 tokens < MIN_CHUNK_TOKENS
    tpot = budget.slo_tpot_s
    first = 11.0 - (tpot * (10 + LOOKAHEAD_TOKENS) - LOOKAHEAD_TOKENS * 0.04 - 0.1)
    r = decoding("a", 11, first_token_time=first)
    assert budget.cap([r], now=11.0) == 0


def test_budget_refuses_a_negative_target_and_without_tpot_never_caps():
    with pytest.raises(ValueError, match="slo_tpot_s"):
        PrefillBudget(-0.1, 2048, 16)
    with pytest.raises(ValueError, match="slo_ttft_s"):
        PrefillBudget(0.1, 2048, 16, slo_ttft_s=-1.0)
    ttft_only = PrefillBudget(0.0, 2048, 16, slo_ttft_s=2.0)  # learns costs, caps nothing
    ttft_only.observe(0.5, num_decode_tokens=0, num_prefill_tokens=500)
    assert ttft_only.s_per_token == pytest.approx(0.001)
    assert ttft_only.cap([decoding("d", 2, first_token_time=0.0)], now=100.0) is None


def test_scheduler_caps_prompt_chunks_but_never_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=256)
    runner = FakeRunner(scheduler)
    for rid in ("d1", "d2"):
        scheduler.add_request(make_request(rid, prompt_len=20, max_tokens=50))
    step(scheduler, runner)  # both prefilled
    scheduler.add_request(make_request("p", prompt_len=100, max_tokens=4))
    out = scheduler.schedule(max_prefill_tokens=32)
    assert shape(out) == [("d1", 20, 1, True), ("d2", 20, 1, True), ("p", 0, 32, False)]
    scheduler.update_from_output(out, runner.execute(out))
    # a running prompt's next chunk is capped too; a budget of 0 leaves it for later
    out = scheduler.schedule(max_prefill_tokens=0)
    assert shape(out) == [("d1", 21, 1, True), ("d2", 21, 1, True)]
    scheduler.update_from_output(out, runner.execute(out))
    out = scheduler.schedule(max_prefill_tokens=48)
    assert shape(out) == [("d1", 22, 1, True), ("d2", 22, 1, True), ("p", 32, 48, False)]
    scheduler.update_from_output(out, runner.execute(out))
    # without a cap the rest goes at once; everything finishes, no block leaks
    out = scheduler.schedule()
    assert ("p", 80, 20, True) in shape(out)
    scheduler.update_from_output(out, runner.execute(out))
    run_all(scheduler, runner)
    assert scheduler.kv_cache_manager.usage == 0


def test_scheduler_cap_stops_admissions_in_order():
    scheduler = make_scheduler(max_num_batched_tokens=256)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", prompt_len=40, max_tokens=2))
    scheduler.add_request(make_request("b", prompt_len=10, max_tokens=2))
    out = scheduler.schedule(max_prefill_tokens=40)
    # "a" takes the whole budget; "b" does not overtake (nor get a 0-token chunk)
    assert shape(out) == [("a", 0, 40, True)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    scheduler.update_from_output(out, runner.execute(out))
    run_all(scheduler, runner)
    assert scheduler.kv_cache_manager.usage == 0


def test_a_prompt_about_to_miss_its_ttft_goes_whole_but_a_lost_one_does_not():
    budget = PrefillBudget(0.1, max_num_batched_tokens=2048, min_prefill_tokens=16,
                           slo_ttft_s=2.0)
    budget.t_decode_s, budget.s_per_token = 0.04, 0.001
    behind = decoding("d", 2, first_token_time=0.0)  # no slack at all
    now = 100.0
    # 500 tokens = 0.5 s of prefill; waited 0.6 s: done at 1.1 s < 0.6 x 2 s: not urgent
    calm = Request("calm", [1] * 500, SamplingParams(max_tokens=8), arrival_time=now - 0.6)
    assert budget.cap([behind], now, [calm]) == 0
    # waited 1.0 s: done at 1.5 s, past 0.6 x 2 s and still within 2 s: urgent, whole
    urgent = Request("urgent", [1] * 500, SamplingParams(max_tokens=8), arrival_time=now - 1.0)
    assert TTFT_URGENT_FRACTION * 2.0 <= 1.5 <= 2.0
    assert budget.cap([behind], now, [calm, urgent]) == 500
    # waited 1.8 s: done at 2.3 s, it cannot keep its target any more: no favour
    lost = Request("lost", [1] * 500, SamplingParams(max_tokens=8), arrival_time=now - 1.8)
    assert budget.cap([behind], now, [calm, lost]) == 0
    # without a TTFT target nobody is urgent
    plain = PrefillBudget(0.1, max_num_batched_tokens=2048, min_prefill_tokens=16)
    plain.t_decode_s, plain.s_per_token = 0.04, 0.001
    assert plain.cap([behind], now, [urgent]) == 0


def test_predicted_ttft_counts_the_prompts_admitted_before_it_and_its_uncached_tokens():
    budget = PrefillBudget(0.0, 2048, 16, slo_ttft_s=2.0)
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=512)
    config = scheduler.scheduler_config
    new = make_request("new", prompt_len=100)
    new.arrival_time = 50.0
    # no cost learned yet: no prediction (the first prompts are never refused)
    assert budget.predict_ttft_s(new, 0, [], [], config, now=50.0) is None
    # the engine's first prompt step (one-time costs) does not count; then the fastest of
    # the recent steps does
    budget.observe(2.0, num_decode_tokens=0, num_prefill_tokens=100)
    assert budget.predict_ttft_s(new, 0, [], [], config, now=50.0) is None
    budget.observe(1.5, num_decode_tokens=0, num_prefill_tokens=100)
    budget.observe(1.0, num_decode_tokens=0, num_prefill_tokens=100)
    budget.observe(1.2, num_decode_tokens=0, num_prefill_tokens=100)
    alone = budget.predict_ttft_s(new, 0, [], [], config, now=50.5)
    assert alone == pytest.approx(0.5 + 100 * 0.01)  # waited 0.5 s + its 100 tokens
    # a cached prefix of 64 tokens is not computed again
    assert budget.predict_ttft_s(new, 64, [], [], config, now=50.5) == pytest.approx(0.5 + 0.36)
    # FCFS: every waiting prompt is ahead; a running prefill's tokens left too; a stream
    # (KV from a prefill instance, output tokens) and a decoding request are not prefill work
    ahead = make_request("ahead", prompt_len=200)
    ahead.arrival_time = 10.0
    chunked = make_request("chunked", prompt_len=300)
    chunked.num_computed_tokens = 100
    stream = make_request("stream", prompt_len=400)
    stream.output_token_ids = [5]
    decoding_req = decoding("dec", 3, first_token_time=0.0)
    predicted = budget.predict_ttft_s(new, 0, [ahead, stream], [chunked, decoding_req], config,
                                      now=50.0)
    assert predicted == pytest.approx((100 + 200 + 200) * 0.01)
    # shortest job first (the default policy; its aging bound reads the real clock): a
    # longer prompt waiting is not ahead of it, a shorter one is
    sjf = make_scheduler(max_num_batched_tokens=64, max_model_len=512,
                         scheduling_policy="sjf").scheduler_config
    now = time.monotonic()
    new.arrival_time = now
    longer = make_request("longer", prompt_len=300)
    shorter = make_request("shorter", prompt_len=40)
    longer.arrival_time = shorter.arrival_time = now - 0.1
    assert budget.predict_ttft_s(new, 0, [longer, shorter], [], sjf, now=now) == \
        pytest.approx((100 + 40) * 0.01)


def test_ttft_unreachable_error_names_the_prediction_and_the_target():
    err = TTFTUnreachableError("r1", 3.456, 2.0)
    assert "r1" in str(err) and "3.46 s" in str(err) and "2.00 s" in str(err)
    assert (err.predicted_s, err.slo_ttft_s) == (3.456, 2.0)
