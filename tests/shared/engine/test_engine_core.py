"""EngineCore on the real model: prefix reuse, bad input, aborts, and the offline API's
shape (n, seeds, logprobs, stop rules)."""

from __future__ import annotations

import math

import pytest

from pdserve.shared.llm import LLM
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=8)


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    scheduled_tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        for s in out.scheduled:
            scheduled_tokens[s.request.request_id] = (
                scheduled_tokens.get(s.request.request_id, 0) + s.num_scheduled_tokens)
        sampled = engine.model_runner.execute_model(out)
        engine.scheduler.update_from_output(out, sampled)
    return scheduled_tokens


def test_shared_200_token_prefix_is_computed_once(llm):
    tok = llm.tokenizer
    words = " ".join(f"word{i}" for i in range(120))
    prefix = tok.encode(words, add_special_tokens=False)[:200]
    assert len(prefix) == 200
    greedy = SamplingParams(temperature=0, max_tokens=4)
    a = Request("prefix-a", prefix + tok.encode(" first tail", add_special_tokens=False), greedy)
    b = Request("prefix-b", prefix + tok.encode(" second tail here", add_special_tokens=False),
                greedy)
    _run(llm.engine, [a])
    computed = _run(llm.engine, [b])
    assert b.num_cached_tokens >= 192
    # Only the uncached tail and the generated tokens were computed for b.
    assert computed["prefix-b"] == b.num_tokens - b.num_cached_tokens - 1
    llm.engine.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("field, make", [
    ("prompt_token_ids", lambda: Request("bad-len", [1] * 600, SamplingParams())),
    ("prompt_token_ids", lambda: Request("bad-vocab", [1, 49152], SamplingParams())),
    ("prompt_token_ids", lambda: Request("bad-neg", [1, -3], SamplingParams())),
    ("prompt_token_ids", lambda: Request("bad-empty", [], SamplingParams())),
])
def test_bad_prompt_is_a_value_error_naming_the_field(llm, field, make):
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(make())
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"),
])
def test_bad_sampling_params_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_request_does_not_disturb_the_others(llm):
    prompts = ["One two three", "The capital of France is"]
    alone = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8))]
    engine = llm.engine
    good = [Request(f"good-{i}", llm.tokenizer.encode(p, add_special_tokens=False),
                    SamplingParams(temperature=0, max_tokens=8), eos_token_id=2)
            for i, p in enumerate(prompts)]
    engine.add_request(good[0])
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(Request("too-long", [1] * 512, SamplingParams()))
    engine.add_request(good[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in good] == alone


def test_generate_rejects_a_bad_prompt_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok prompt", {"prompt_token_ids": [1] * 600}],
                     SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_gpu_blocks - 1


def test_priority_needs_the_priority_policy(llm, model_path):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate("Hi", SamplingParams(max_tokens=2, priority=3))
    assert not llm.engine.has_unfinished_requests()
    # priority 0 is everyone's default: accepted under any policy
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))[0].outputs
    prioritized = LLM(model_path, kv_cache_memory="64MiB", max_model_len=512,
                      scheduling_policy="priority")
    out = prioritized.generate(["Hi", "Hello there"],
                               [SamplingParams(max_tokens=3, temperature=0, priority=2),
                                SamplingParams(max_tokens=3, temperature=0, priority=-1)])
    alone = [llm.generate(p, SamplingParams(max_tokens=3, temperature=0))[0]
             for p in ("Hi", "Hello there")]
    assert [o.outputs[0].token_ids for o in out] == [a.outputs[0].token_ids for a in alone]


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    r = Request("to-abort", list(range(1, 100)), SamplingParams(max_tokens=50))
    engine.add_request(r)
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.num_gpu_blocks - 1
    engine.abort_requests(["to-abort"])
    assert r.finish_reason.value == "abort"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_gpu_blocks - 1
    engine.kv_cache_manager.check_invariants()


def test_n_seeded_samples_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, logprobs=2)
    out1 = llm.generate("Once upon a time", params)[0]
    out2 = llm.generate("Once upon a time", params)[0]
    assert [c.index for c in out1.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out1.outputs] == [c.token_ids for c in out2.outputs]
    assert len({tuple(c.token_ids) for c in out1.outputs}) > 1
    for c in out1.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and math.isfinite(lp.logprob)
            assert len(lp.top_token_ids) == 2 and lp.top_logprobs[0] >= lp.top_logprobs[1]


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate("Count: one, two, three,", greedy)[0].outputs[0].token_ids
    stop_tok = ref[3]
    out = llm.generate("Count: one, two, three,", SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0].outputs[0]
    first = ref.index(stop_tok)
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    banned = llm.generate("Count: one, two, three,", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok],
        min_tokens=12))[0].outputs[0].token_ids  # the stop token banned at every position
    out = llm.generate("Count: one, two, three,", SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[stop_tok], min_tokens=first + 2)
    )[0].outputs[0]
    # Banned for the first first + 2 outputs, the stop token "," gives way to ")" after
    # " four", and the greedy path never meets it again: max_tokens ends the request.
    assert out.token_ids == banned and len(banned) == 12
    assert out.finish_reason == "length" and out.stop_reason is None


def test_chat_ends_on_eos_with_stop(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=100))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "<|im_end|>" not in out.text and out.text.strip()
