"""Structured outputs and tool calling end to end (issue 12): real prefill and decode
services (in-process gRPC, real engines) and the real gateway with the `openai` client.

Across the split: the prefill samples the first token under the grammar, the decode
rebuilds the grammar state from the tokens it is given (the prefill's first token, or every
token so far after a failover), and a local prefill samples the same first token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import jsonschema
import pytest
import pytest_asyncio

from shared.proto import engine_pb2 as pb
from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import RunningGateway, running_gateway
from tests.services.helpers import RPC_TIMEOUT, Cluster, greedy, run_split, start_cluster

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(model_path) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, None, **E2E_ENGINE)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(model_path, cluster) -> AsyncIterator[RunningGateway]:
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(model_path, urls, rpc_timeout=10.0) as gw:  # type: ignore[arg-type]
        gw.client = gw.client.with_options(timeout=120)
        yield gw


def _prompt(tokenizer, text: str) -> list[int]:
    from shared.tokenizer import apply_chat_template

    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def _json_params(max_tokens: int = 48) -> pb.SamplingParams:
    return greedy(max_tokens, structured_outputs=pb.StructuredOutputs(json=json.dumps(PERSON)))


async def _decode_locally(cluster: Cluster, request_id: str, prompt: list[int],
                          output: list[int], params: pb.SamplingParams) -> list[int]:
    """Generate on the decode instance without a KV handle (local prefill, or a failover
    that hands over the tokens so far): the tokens after `output`."""
    req = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                           output_token_ids=output, sampling_params=params)
    tokens = []
    async for chunk in cluster.decode_stub.Generate(req, timeout=RPC_TIMEOUT):
        tokens.extend(chunk.token_ids)
    return tokens


async def test_split_and_local_prefill_agree_under_a_grammar(cluster, tokenizer):
    prompt = _prompt(tokenizer, "Describe a pirate as JSON with a name and an age.")
    split = await run_split(cluster, "so-split", prompt, _json_params())
    local = await _decode_locally(cluster, "so-local", prompt, [], _json_params())
    assert split.token_ids[0] == local[0]  # the first token under the grammar
    assert split.token_ids == local
    assert split.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(tokenizer.decode(split.token_ids,
                                                    skip_special_tokens=True)), PERSON)


async def test_decode_failover_rebuilds_the_grammar_state(cluster, tokenizer):
    prompt = _prompt(tokenizer, "Describe a wizard as JSON with a name and an age.")
    full = (await run_split(cluster, "so-full", prompt, _json_params())).token_ids
    for cut in (1, len(full) // 2):  # as the gateway re-sends the tokens handed out so far
        rest = await _decode_locally(cluster, f"so-cut{cut}", prompt, full[:cut],
                                     _json_params())
        assert full[:cut] + rest == full
    with pytest.raises(grpc.aio.AioRpcError) as info:  # a token outside the grammar
        await _decode_locally(cluster, "so-foreign", prompt, tokenizer.encode("hello"),
                              _json_params())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not match the request's structured output grammar" in info.value.details()


async def test_a_schema_that_does_not_compile_is_invalid_argument(cluster, tokenizer):
    params = greedy(8, structured_outputs=pb.StructuredOutputs(regex="(unclosed"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.prefill_stub.Prefill(pb.PrefillRequest(
            request_id="so-bad", prompt_token_ids=_prompt(tokenizer, "hi"),
            sampling_params=params), timeout=RPC_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("invalid regex:")
