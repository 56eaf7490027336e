"""Prefill service -> KV transfer -> decode service: greedy outputs equal the single-process
engine's, shared prefixes are neither recomputed nor re-sent, local prefill works too."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.sampling_params import SamplingParams
from tests.conftest import NUM_PARITY_TOKENS, TEST_QUANTIZATION
from tests.services.helpers import RPC_TIMEOUT, greedy, run_split, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="session")

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@pytest.fixture(scope="module")
def reference(reference_llm, parity_prompt_ids):
    outs = reference_llm.generate([{"prompt_token_ids": ids} for ids in parity_prompt_ids],
                                  SamplingParams(temperature=0.0, max_tokens=NUM_PARITY_TOKENS))
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


async def test_split_matches_single_process_engine(cluster, parity_prompt_ids, reference):
    results = await asyncio.gather(*(
        run_split(cluster, f"parity-{i}", ids, greedy(NUM_PARITY_TOKENS))
        for i, ids in enumerate(parity_prompt_ids)))
    for result, (ref_tokens, ref_finish) in zip(results, reference):
        assert result.token_ids == ref_tokens
        assert result.finish_reason == FINISH[ref_finish]
        handle = result.prefill.kv_transfer_params
        assert handle.prefill_address == cluster.prefill.identity.address
        assert handle.dtype == "float32" and handle.num_layers == 30
    prefill_state, decode_state = await wait_leak_free(cluster)
    assert prefill_state.num_used_blocks == prefill_state.num_pinned_blocks == 0
    assert decode_state.num_used_blocks == 0
    assert prefill_state.invariants_ok and decode_state.invariants_ok


async def test_local_prefill_matches_single_process_engine(cluster, parity_prompt_ids,
                                                          reference):
    # No kv_transfer_params: the decode instance prefills the prompt itself.
    ids, (ref_tokens, _) = parity_prompt_ids[1], reference[1]
    req = pb.DecodeRequest(request_id="local-0", prompt_token_ids=ids,
                           sampling_params=greedy(NUM_PARITY_TOKENS))
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
    assert [t for c in chunks for t in c.token_ids] == ref_tokens
    # Failover: prompt + the tokens generated so far are recomputed, generation goes on.
    req = pb.DecodeRequest(request_id="local-1", prompt_token_ids=ids,
                           output_token_ids=ref_tokens[:10],
                           sampling_params=greedy(NUM_PARITY_TOKENS))
    chunks = [c async for c in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT)]
    tokens = [t for c in chunks for t in c.token_ids]
    if TEST_QUANTIZATION == "none":
        assert tokens == ref_tokens[10:]
        return
    # Quantized: the recompute (one prefill of prompt + 10 tokens) rounds otherwise than
    # the decode steps it replaces (1e-7 in fp32), which int8 activations turn into
    # another token now and then; the continuation is complete and counts the 10 tokens.
    finish = chunks[-1].finish_reason
    assert tokens and finish in (FINISH["stop"], FINISH["length"])
    assert 10 + len(tokens) <= NUM_PARITY_TOKENS
    assert finish == FINISH["stop"] or 10 + len(tokens) == NUM_PARITY_TOKENS


async def test_shared_prefix_is_neither_recomputed_nor_resent(cluster):
    rng = random.Random(7)
    prefix = [rng.randrange(100, 40000) for _ in range(400)]
    first = prefix + [rng.randrange(100, 40000) for _ in range(37)]
    second = prefix + [rng.randrange(100, 40000) for _ in range(53)]
    decode_metrics = cluster.decode.worker.metrics
    a = await run_split(cluster, "prefix-a", first, greedy(4))
    assert a.prefill.num_cached_tokens == 0
    received = decode_metrics.value("kv_transfer_blocks_received_total")
    b = await run_split(cluster, "prefix-b", second, greedy(4))
    # The prefill instance computed only the new tokens: 400 = 25 full blocks were cached.
    assert b.prefill.num_cached_tokens == 400
    # The decode instance held those 25 blocks and fetched only the rest.
    num_blocks = -(-len(second) // 16)
    assert decode_metrics.value("kv_transfer_blocks_received_total") - received \
        == num_blocks - 25
    assert b.chunks[0].num_cached_tokens == 400
    assert len(b.token_ids) == 4


async def test_first_token_can_finish_the_request(cluster):
    # max_tokens=1: Prefill answers with finish_reason set and no handle; nothing stays pinned.
    result = await run_split(cluster, "one-token", list(range(200, 240)), greedy(1))
    assert result.finish_reason == pb.FINISH_REASON_LENGTH
    assert not result.prefill.HasField("kv_transfer_params")
    prefill_state, _ = await wait_leak_free(cluster)
    assert prefill_state.num_pinned_blocks == 0


async def test_metrics_endpoint(cluster):
    await cluster.prefill.monitor.tick()
    port = cluster.prefill.metrics_port
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        .read().decode())
    for name in ("pdserve_num_requests_running", "pdserve_kv_cache_usage_perc",
                 "pdserve_prefix_cache_queries_total", "pdserve_time_to_first_token_seconds",
                 "pdserve_kv_transfer_bytes_sent_total", 'pdserve_kv_blocks{model_name='):
        assert name in text
    assert cluster.prefill.worker.metrics.value("kv_transfer_blocks_sent_total") > 0


async def test_logprobs_cross_the_split(cluster):
    prompt = list(range(1000, 1030))
    result = await run_split(cluster, "logprobs", prompt, greedy(3, logprobs=2))
    first = result.prefill.first_logprobs
    assert first.token_id == result.token_ids[0] and len(first.top_token_ids) == 2
    assert first.top_token_ids[0] == first.token_id  # greedy: the most likely one
    later = [lp for c in result.chunks for lp in c.logprobs]
    assert [lp.token_id for lp in later] == result.token_ids[1:]
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in later)


async def test_concurrent_transfers_of_one_prefix_fetch_it_once(cluster):
    """A burst on one shared prefix (as a system prompt gets): the prefill has cached it,
    and the decodes arrive together; the decode instance fetches the prefix blocks once,
    the other requests wait for that transfer and reuse them."""
    rng = random.Random(11)
    prefix = [rng.randrange(100, 40000) for _ in range(400)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(20 + 7 * i)]
               for i in range(4)]
    params = greedy(3)
    prefills = []
    for i, prompt in enumerate(prompts):
        prefills.append(await cluster.prefill_stub.Prefill(
            pb.PrefillRequest(request_id=f"burst-{i}", prompt_token_ids=prompt,
                              sampling_params=params),
            timeout=RPC_TIMEOUT, metadata=(("x-request-id", f"burst-{i}"),)))
    decode_metrics = cluster.decode.worker.metrics
    received = decode_metrics.value("kv_transfer_blocks_received_total")

    async def decode(i: int) -> list[int]:
        req = pb.DecodeRequest(request_id=f"burst-{i}", prompt_token_ids=prompts[i],
                               output_token_ids=[prefills[i].first_token_id],
                               sampling_params=params,
                               kv_transfer_params=prefills[i].kv_transfer_params)
        return [t async for c in cluster.decode_stub.Generate(
            req, timeout=RPC_TIMEOUT, metadata=(("x-request-id", f"burst-{i}"),))
            for t in c.token_ids]

    outputs = await asyncio.gather(*(decode(i) for i in range(4)))
    assert all(len(tokens) == 2 for tokens in outputs)
    # 25 prefix blocks once, plus each request's own (partial) tail blocks.
    tails = sum(-(-len(p) // 16) - 25 for p in prompts)
    assert decode_metrics.value("kv_transfer_blocks_received_total") - received \
        == 25 + tails
    await wait_leak_free(cluster)
