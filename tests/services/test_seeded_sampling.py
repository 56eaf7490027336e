"""Seeded sampling that cannot depend on where or with whom a request runs (issue 13, item 1).

8 seeds x 64 tokens at temperature 1, top_p 0.9 (ignore_eos): the tokens of each seeded
request alone in the in-process engine are the tokens it gets in a batch of 32, with
preemption forced (a tiny KV pool), and split over the real prefill and decode services
(the first token sampled by the prefill engine, the rest by the decode engine), and from a
decode instance that continues from the first k tokens (a failover). The kill -9 of a decode
mid-stream is in tests/e2e/test_failover.py.

NOTE: the prompts start with a token of their own (no prefix-cache hit from other tests) and
the in-process engines here run without prefix caching: a cached prefix changes how the rest
of the prompt is computed (other matmul shapes), so its logits may differ in the last bits,
which a seeded sample near a tie would show. That is numerics, not the sampler.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.llm import LLM
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import TEST_QUANTIZATION
from tests.services.helpers import RPC_TIMEOUT, run_split, wait_leak_free

NUM_TOKENS = 64
SEEDS = list(range(1000, 1008))
NUM_BATCH = 32


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=NUM_TOKENS,
                          ignore_eos=True)


def seeded_pb(seed: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=NUM_TOKENS,
                             ignore_eos=True)


def _others(prompt_ids: list[list[int]], n: int) -> tuple[list[dict], list]:
    """`n` unseeded companions of varied lengths and parameters (they shift the rows)."""
    prompts, params = [], []
    for i in range(n):
        ids = prompt_ids[i % len(prompt_ids)]
        prompts.append({"prompt_token_ids": [200 + i] + ids[1: 4 + i]})
        params.append(SamplingParams(temperature=0.7 + 0.05 * (i % 5), top_p=0.95,
                                     max_tokens=4 + i % 12, ignore_eos=True))
    return prompts, params


def _seeded_tokens(llm: LLM, prompt_ids, others: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = [seeded(s) for s in SEEDS]
    more_prompts, more_params = _others(prompt_ids, others)
    outs = llm.generate(prompts + more_prompts, params + more_params)
    return [list(o.outputs[0].token_ids) for o in outs[:len(SEEDS)]]


@pytest.fixture(scope="module")
def prompts(parity_prompt_ids) -> list[list[int]]:
    """The parity prompts, each behind a first token of its own."""
    assert len(parity_prompt_ids) == len(SEEDS)
    return [[9000 + 37 * i, *ids] for i, ids in enumerate(parity_prompt_ids)]


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, kv_cache_memory="256MiB", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(llm, prompts) -> list[list[int]]:
    """Each seeded request alone in the in-process engine."""
    out = []
    for ids, seed in zip(prompts, SEEDS, strict=True):
        [result] = llm.generate({"prompt_token_ids": ids}, seeded(seed))
        out.append(list(result.outputs[0].token_ids))
    assert all(len(tokens) == NUM_TOKENS for tokens in out)
    assert len({tuple(t) for t in out}) == len(out)
    return out


def test_a_batch_of_32_gives_the_same_tokens(llm, prompts, alone):
    assert _seeded_tokens(llm, prompts, NUM_BATCH - len(SEEDS)) == alone
    assert llm.engine.scheduler.num_preemptions == 0


def test_n_children_derive_their_seeds_from_the_index(llm, prompts, alone):
    """As vLLM: child i of an n > 1 request samples as a request of seed + i. (16 tokens: a
    seeded request's first k tokens do not depend on its max_tokens.)"""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=SEEDS[0], max_tokens=16,
                            ignore_eos=True, n=2)
    [out] = llm.generate({"prompt_token_ids": prompts[0]}, params)
    first, second = (list(c.token_ids) for c in out.outputs)
    assert first == alone[0][:16] and second != first
    [again] = llm.generate({"prompt_token_ids": prompts[0]},
                           dataclasses.replace(params, n=1, seed=SEEDS[0] + 1))
    assert list(again.outputs[0].token_ids) == second


def test_forced_preemption_gives_the_same_tokens(model_path, prompts, alone):
    # 8 seeded requests of ~110 tokens (7-8 blocks) and 8 small ones in 32 blocks: the
    # newest are preempted (recomputed later) again and again.
    small = LLM(model_path, num_gpu_blocks_override=32, max_num_seqs=16,
                enable_prefix_caching=False)
    scheduler = small.engine.scheduler
    index_of = {ids[0]: i for i, ids in enumerate(prompts)}
    preempted_at: dict[int, int] = {}  # a seeded request's index -> its outputs then
    preempt = scheduler._preempt

    def recording_preempt(request) -> None:
        i = index_of.get(request.prompt_token_ids[0])
        if i is not None:
            preempted_at.setdefault(i, len(request.output_token_ids))
        preempt(request)

    scheduler._preempt = recording_preempt
    try:
        tokens = _seeded_tokens(small, prompts, 8)
        preemptions = scheduler.num_preemptions
    finally:
        del small, scheduler
    assert preemptions > 0
    if TEST_QUANTIZATION == "none":
        assert tokens == alone
        return
    # Quantized: a recompute (one prefill of prompt + outputs) rounds otherwise than the
    # decode steps it replaces (1e-7 in fp32), which int8 activations turn into another
    # token now and then: alone's tokens up to a request's first preemption (all of them
    # if never preempted), then a complete answer.
    for i, (got, want) in enumerate(zip(tokens, alone, strict=True)):
        n = preempted_at.get(i, NUM_TOKENS)
        assert len(got) == NUM_TOKENS and got[:n] == want[:n], (i, n)


@pytest.mark.asyncio(loop_scope="session")
async def test_split_and_failover_give_the_same_tokens(cluster, prompts, alone):
    """Prefill samples position 0, decode 1..63; and a decode that continues from the first
    k tokens (the gateway's failover) samples k..63."""
    results = await asyncio.gather(*(
        run_split(cluster, f"seeded-{i}", ids, seeded_pb(seed))
        for i, (ids, seed) in enumerate(zip(prompts, SEEDS, strict=True))))
    assert [r.token_ids for r in results] == alone
    for i, k in ((0, 1), (3, 17), (7, 40)):
        req = pb.DecodeRequest(request_id=f"seeded-resume-{i}", prompt_token_ids=prompts[i],
                               output_token_ids=alone[i][:k],
                               sampling_params=seeded_pb(SEEDS[i]))
        chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
        tokens = [t for c in chunks for t in c.token_ids]
        if TEST_QUANTIZATION == "none":
            assert tokens == alone[i][k:], (i, k)
        else:  # the recompute of prompt + k tokens: see the preemption test
            assert len(tokens) == NUM_TOKENS - k, (i, k)
    prefill_state, decode_state = await wait_leak_free(cluster)
    assert prefill_state.num_used_blocks == decode_state.num_used_blocks == 0
