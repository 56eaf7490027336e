"""Speculation on the decode service (n-gram, and a draft model that prefills the prompt
itself on the decode side), across the split: greedy outputs equal the single-process
engine's without speculation (fp32; complete answers in int8), also on a decode instance
that takes over mid-stream (the gateway's failover after a kill -9: prompt + the tokens
already streamed, no KV handle), the decode instance's /metrics registry counts drafts
(pdserve_spec_decode_*), and no block leaks on either side (nor in the draft's pool)."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
from prometheus_client import generate_latest

from pdserve.services.gateway.federation import merge, parse_families, vllm_families
from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS, TEST_QUANTIZATION
from tests.services.helpers import RPC_TIMEOUT, greedy, run_split, start_cluster, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")

def _assert_complete(tokens: list[int], finish_reason: int) -> None:
    """A quantized mode's check of a greedy answer: complete (stopped, or all its tokens).
    Not the engine's tokens: a verification step scores draft positions in one pass, which
    rounds otherwise than one decode step per token (1e-7 in fp32), and int8 activations
    turn that into another token now and then (exactness across paths is fp32-only)."""
    assert tokens and len(tokens) <= NUM_PARITY_TOKENS
    assert finish_reason == pb.FINISH_REASON_STOP or \
        (finish_reason, len(tokens)) == (pb.FINISH_REASON_LENGTH, NUM_PARITY_TOKENS)


NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1, "disable_by_batch_size": 0})


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["ngram", "draft_model"])
async def spec_cluster(model_path, request):
    config = NGRAM if request.param == "ngram" else json.dumps(
        {"model": request.getfixturevalue("draft_model_path"), "num_speculative_tokens": 3,
         "disable_by_batch_size": 0})
    c = await start_cluster(model_path, None, speculative_config=config)
    yield c
    await c.close()


async def test_split_with_speculation_matches_engine(spec_cluster, reference_llm,
                                                     parity_prompt_ids):
    prompts = parity_prompt_ids[:4]
    want = [o.outputs[0].token_ids for o in reference_llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=NUM_PARITY_TOKENS))]
    results = await asyncio.gather(*(run_split(spec_cluster, f"spec-{i}", ids,
                                               greedy(NUM_PARITY_TOKENS))
                                     for i, ids in enumerate(prompts)))
    if TEST_QUANTIZATION == "none":
        assert [r.token_ids for r in results] == want
    else:  # see _assert_complete
        for r in results:
            _assert_complete(r.token_ids, r.finish_reason)
    # Failover: a decode instance continuing from the first k tokens (what the gateway sends
    # after the serving decode died) speculates from there and gives the same tokens.
    registry = spec_cluster.decode.registry
    labels = {"model_name": spec_cluster.decode.worker.model_name}
    drafted = registry.get_sample_value("pdserve_spec_decode_num_draft_tokens_total", labels)
    async def resume(i: int, k: int) -> list[int]:
        req = pb.DecodeRequest(request_id=f"spec-resume-{i}", prompt_token_ids=prompts[i],
                               output_token_ids=want[i][:k],
                               sampling_params=greedy(NUM_PARITY_TOKENS))
        return [t async for c in spec_cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)
                for t in c.token_ids]
    cuts = ((0, 1), (1, 9), (2, 20))
    resumed = await asyncio.gather(*(resume(i, k) for i, k in cuts))
    if TEST_QUANTIZATION == "none":
        assert resumed == [want[i][k:] for i, k in cuts]
    else:
        for tokens, (_, k) in zip(resumed, cuts, strict=True):
            assert tokens and k + len(tokens) <= NUM_PARITY_TOKENS
    assert registry.get_sample_value("pdserve_spec_decode_num_draft_tokens_total",
                                     labels) > drafted
    # Speculation runs on the decode side only.
    assert spec_cluster.prefill.worker.engine.engine_core.speculative_config is None
    drafts = registry.get_sample_value("pdserve_spec_decode_num_draft_tokens_total", labels)
    accepted = registry.get_sample_value("pdserve_spec_decode_num_accepted_tokens_total",
                                         labels)
    first = registry.get_sample_value("pdserve_spec_decode_num_accepted_tokens_per_pos_total",
                                      {**labels, "position": "0"})
    assert drafts > accepted > 0 and accepted >= first > 0
    assert registry.get_sample_value("pdserve_spec_decode_num_drafts_total", labels) > 0
    # The gateway's --metrics-compat vllm copies carry vLLM's names.
    copies = vllm_families(merge(parse_families(generate_latest(registry).decode())), "m")
    per_pos = {s.labels["position"]: s.value for f in copies for s in f.samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos["0"] == first
    prefill_state, decode_state = await wait_leak_free(spec_cluster)
    assert decode_state.num_used_blocks == 0 and decode_state.invariants_ok
    draft_kv = getattr(spec_cluster.decode.worker.engine.engine_core.drafter, "kv", None)
    if draft_kv is not None:  # the draft model's own pool
        assert not draft_kv.seqs
        assert draft_kv.num_free_blocks == draft_kv.block_pool.num_gpu_blocks - 1
