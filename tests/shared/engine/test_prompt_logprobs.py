"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's meaning) against transformers'
fp32 log-softmax of the full-prompt forward: whole prefill, chunked prefill, and a second
identical request under prefix caching (which must still get every position)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.shared.llm import LLM
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.fp32_only  # the reference is transformers' fp32 model

TOP_K = 3
ATOL = 1e-4
TEXTS = ["The capital of France is Paris, and the capital of Italy is",
         "Once upon a time, in a small village by the sea, there lived an old fisherman "
         "who every morning walked to the harbor before sunrise. He knew every boat, every "
         "rope and every gull by name, and the children of the village followed him around "
         "asking for stories about storms, whales and faraway islands."]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len(ids[0]) >= 10 and len(ids[1]) >= 60
    return ids


@pytest.fixture(scope="module")
def reference(model_path, prompts) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """transformers, fp32, one prompt at a time: per position p >= 1 the logprob of
    prompt[p] and the top-k (values, ids) after prompt[:p]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            chosen = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
            values, top_ids = lp.topk(TOP_K, dim=-1)
            out.append((chosen, values, top_ids))
    del model
    return out


def assert_matches(prompt_logprobs, ids, ref) -> None:
    chosen, values, top_ids = ref
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    entries = prompt_logprobs[1:]
    assert [e.token_id for e in entries] == ids[1:]
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, chosen, atol=ATOL, rtol=0)
    assert all(len(e.top_token_ids) == len(e.top_logprobs) == TOP_K for e in entries)
    torch.testing.assert_close(torch.tensor([e.top_logprobs for e in entries]), values,
                               atol=ATOL, rtol=0)
    # Ids agree wherever the reference's top-k values are not near-ties.
    gaps = (values[:, :-1] - values[:, 1:]).min(dim=1).values
    clear = gaps > 10 * ATOL
    assert torch.equal(torch.tensor([e.top_token_ids for e in entries])[clear], top_ids[clear])


def params(max_tokens: int = 2, prompt_logprobs: int | None = TOP_K) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          prompt_logprobs=prompt_logprobs)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, kv_cache_memory="128MiB", max_model_len=512)


def test_prompt_logprobs_equal_transformers(llm, prompts, reference):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params(4))
    for out, ids, ref in zip(outs, prompts, reference, strict=True):
        assert_matches(out.prompt_logprobs, ids, ref)
    # Asking for them changes nothing else: same greedy tokens as without.
    plain = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params(4, None))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prefix_cached_prompt_still_gets_every_position(llm, prompts, reference):
    ids, ref = prompts[1], reference[1]
    first = llm.generate({"prompt_token_ids": ids}, params())[0]
    second = llm.generate({"prompt_token_ids": ids}, params())[0]
    assert second.num_cached_tokens == 0  # computed in full: cached positions have no logits
    assert_matches(first.prompt_logprobs, ids, ref)
    assert_matches(second.prompt_logprobs, ids, ref)
    # Its blocks were cached all the same: a request without prompt logprobs hits them.
    plain = llm.generate({"prompt_token_ids": ids}, params(2, None))[0]
    assert plain.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    llm.engine.kv_cache_manager.check_invariants()


def test_first_output_carries_them_once_and_one_token_prompt(llm, prompts, reference):
    engine = llm.engine
    request = Request("once", list(prompts[0]), params(max_tokens=4))
    single = Request("single", [prompts[0][0]], params(max_tokens=2))
    engine.add_request(request)
    engine.add_request(single)
    carried: dict[str, list] = {"once": [], "single": []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            carried[delta.request_id].append(delta.prompt_logprobs)
    assert len(carried["once"]) == 4 and carried["once"][1:] == [None] * 3
    assert_matches(carried["once"][0], prompts[0], reference[0])
    assert carried["single"][0] == [None] and carried["single"][1] is None


def test_chunked_prefill_matches(llm, prompts, reference):
    scheduler = llm.engine.scheduler
    config = scheduler.scheduler_config
    # Prefill chunks of at most 16 tokens (vLLM's long_prefill_token_threshold), so the
    # long prompt's logprobs are gathered over several steps.
    runner = llm.engine.model_runner
    chunks: list[int] = []

    def recording(scheduler_output):
        chunks.extend(s.num_scheduled_tokens for s in scheduler_output.scheduled)
        return type(runner).execute_model(runner, scheduler_output)

    scheduler.scheduler_config = dataclasses.replace(config, long_prefill_token_threshold=16)
    runner.execute_model = recording
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params())
    finally:
        scheduler.scheduler_config = config
        del runner.execute_model
    assert max(chunks) == 16 and chunks.count(16) >= len(prompts[1]) // 16
    for out, ids, ref in zip(outs, prompts, reference, strict=True):
        assert_matches(out.prompt_logprobs, ids, ref)
