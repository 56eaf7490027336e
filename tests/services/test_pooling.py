"""Pooling models (issue 32): `--runner pooling` on a tiny random Llama checkpoint, real
prefill services over gRPC and a real gateway (uvicorn) in front of them, no decode.

Embeddings equal transformers' fp32 `last_hidden_state` of the same checkpoint pooled the
same way (LAST, MEAN, CLS; L2-normalised) within 1e-5, over chunked prefill; a request
batched with 31 others equals it alone; a prefix-cache hit (LAST) changes nothing, and MEAN
and CLS take no hit but fill the cache. Through the gateway: the `openai` client's
embeddings (float and base64), /pooling, /score and /rerank ordered as transformers'
cosine similarities, and vLLM's errors.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
import torch.nn.functional as F

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from tests.services.gateway.conftest import running_gateway
from tests.services.helpers import (
    cached_hashes,
    channel,
    engine_args,
    service_config,
    start_runtime,
)
from tests.shared.models.test_architectures import build_checkpoint

pytestmark = [pytest.mark.fp32_only, pytest.mark.asyncio(loop_scope="module")]

MAX_MODEL_LEN = 256
BUDGET = 128
"""Tokens per step: a 200-token prompt is prefilled in two chunks (MEAN sums across them),
and a burst of prompts shares steps."""
TOL = 1e-5


class Checkpoint:
    def __init__(self, directory: Path) -> None:
        self.path = str(directory)
        self.model = build_checkpoint(directory, "LlamaConfig", tie_word_embeddings=True)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path)

    def embed(self, ids: list[int], kind: str = "LAST") -> torch.Tensor:
        """transformers' base model, pooled as pdserve's pooler and L2-normalised."""
        with torch.inference_mode():
            h = self.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return F.normalize({"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind], dim=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp("pooling-llama"))


def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


async def start_pooler(path: str, kind: str, **overrides):
    runtime = await start_runtime(service_config("prefill", None), engine_args(
        path, runner="pooling", override_pooler_config=f'{{"pooling_type": "{kind}"}}',
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=BUDGET, **overrides))
    await runtime.wait_ready(120)
    return runtime


async def pool(stub, request_id: str, ids: list[int]) -> pb.PoolResponse:
    return await stub.Pool(pb.PoolRequest(request_id=request_id, prompt_token_ids=ids),
                           timeout=120)


def vec(resp: pb.PoolResponse) -> torch.Tensor:
    return torch.tensor(list(resp.data))


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
async def test_pool_equals_transformers(ckpt, kind):
    runtime = await start_pooler(ckpt.path, kind)
    ch = channel(runtime.identity.address)
    stub = engine_pb2_grpc.PrefillServiceStub(ch)
    try:
        prompts = random_prompts((5, 37, 200), seed=3)
        got = await asyncio.gather(*(pool(stub, f"p{i}", p) for i, p in enumerate(prompts)))
        for p, r in zip(prompts, got):
            assert r.pooling_type == kind and r.num_prompt_tokens == len(p)
            assert (vec(r) - ckpt.embed(p, kind)).abs().max() <= TOL
            assert abs(vec(r).norm() - 1) < 1e-5

        # one request alone, then batched with 31 others (20-200 tokens, shared steps)
        others = random_prompts(torch.randint(20, 201, (31,), generator=torch.Generator()
                                              .manual_seed(5)).tolist(), seed=6)
        target = random_prompts((150,), seed=7)[0]
        alone = vec(await pool(stub, "alone", target))
        batch = await asyncio.gather(*(pool(stub, f"b{i}", p)
                                       for i, p in enumerate([*others[:16], target,
                                                              *others[16:]])))
        assert (vec(batch[16]) - alone).abs().max() <= TOL
        assert (alone - ckpt.embed(target, kind)).abs().max() <= TOL

        # the same prompt again: LAST takes the prefix-cache hit, MEAN and CLS skip it
        again = await pool(stub, "again", target)
        assert (again.num_cached_tokens > 0) == (kind == "LAST")
        assert (vec(again) - alone).abs().max() <= TOL
        assert await cached_hashes(runtime)  # every kind fills the cache

        # a pooling prompt may fill the context; one token more is refused
        full = random_prompts((MAX_MODEL_LEN,), seed=8)[0]
        assert len((await pool(stub, "full", full)).data) == 64
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pool(stub, "over", full + [5])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if kind == "LAST":  # no generation on a pooling instance
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(pb.PrefillRequest(
                    request_id="gen", prompt_token_ids=[5, 6],
                    sampling_params=pb.SamplingParams(max_tokens=2)), timeout=60)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "does not support generation" in e.value.details()
    finally:
        await ch.close()
        await runtime.stop(0.5)


async def test_pool_on_a_generate_instance_is_refused(ckpt):
    runtime = await start_runtime(service_config("prefill", None),
                                  engine_args(ckpt.path, max_model_len=MAX_MODEL_LEN))
    await runtime.wait_ready(120)
    ch = channel(runtime.identity.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pool(engine_pb2_grpc.PrefillServiceStub(ch), "p", [5, 6, 7])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not support pooling" in e.value.details()
    finally:
        await ch.close()
        await runtime.stop(0.5)


# -- through the gateway ---------------------------------------------------------------------

class _Urls:
    def __init__(self, prefill: tuple[str, ...]) -> None:
        self.prefill_urls, self.decode_urls = prefill, ()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(ckpt):
    runtime = await start_pooler(ckpt.path, "LAST")
    try:
        async with running_gateway(ckpt.path, _Urls((runtime.identity.address,)),
                                   runner="pooling") as gw:
            yield gw
    finally:
        await runtime.stop(0.5)


TEXTS = ["The capital of France is Paris.", "Paris is the capital of France.",
         "Bananas are yellow.", "A completely unrelated sentence about compilers."]


def ids_of(ckpt: Checkpoint, text: str) -> list[int]:
    return ckpt.tokenizer(text, add_special_tokens=True)["input_ids"]


async def test_openai_client_embeddings(gateway, ckpt):
    model = gateway.config.served_model_name
    floats = await gateway.client.embeddings.create(model=model, input=TEXTS[:2],
                                                    encoding_format="float")
    b64 = await gateway.client.embeddings.create(model=model, input=TEXTS[:2])  # base64
    assert [d.index for d in floats.data] == [0, 1]
    want = [ckpt.embed(ids_of(ckpt, t)) for t in TEXTS[:2]]
    for res in (floats, b64):
        for d, w in zip(res.data, want):
            assert (torch.tensor(d.embedding) - w).abs().max() <= TOL
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == \
        sum(len(ids_of(ckpt, t)) for t in TEXTS[:2])
    # every input form: a string, token ids, lists of them; base64 as raw float32
    ids = ids_of(ckpt, TEXTS[0])
    for value in (TEXTS[0], [TEXTS[0]], ids, [ids]):
        r = await gateway.http.post("/v1/embeddings", json={
            "input": value, "encoding_format": "base64", "user": "u1"})
        assert r.status_code == 200, r.text
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert (got - want[0]).abs().max() <= TOL
    # vLLM's use_activation (normalize): False answers the raw pooled hidden state
    r = await gateway.http.post("/v1/embeddings", json={"input": ids, "use_activation": False})
    with torch.inference_mode():
        raw_last = ckpt.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    assert (torch.tensor(r.json()["data"][0]["embedding"]) - raw_last).abs().max() <= TOL
    r = await gateway.http.post("/pooling", json={"input": TEXTS[0]})
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "pooling"
    assert (torch.tensor(r.json()["data"][0]["data"]) - want[0]).abs().max() <= TOL


async def test_score_and_rerank_order_as_transformers(gateway, ckpt):
    query, docs = TEXTS[0], TEXTS[1:]
    q = ckpt.embed(ids_of(ckpt, query))
    want = [float(q @ ckpt.embed(ids_of(ckpt, d))) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for path in ("/score", "/v1/score"):
        r = await gateway.http.post(path, json={"text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        assert max(abs(a - b) for a, b in zip(scores, want)) <= TOL
    r = await gateway.http.post("/score", json={"queries": [query] * 3, "documents": docs})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(scores, abs=TOL)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = await gateway.http.post(path, json={"query": query, "documents": docs})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert results[0]["document"] == {"text": docs[order[0]]}
    r = await gateway.http.post("/rerank", json={"query": query, "documents": docs, "top_n": 2,
                                                 "return_documents": False})
    assert [x["index"] for x in r.json()["results"]] == order[:2]
    assert "document" not in r.json()["results"][0]
    assert r.json()["usage"]["prompt_tokens"] == sum(
        len(ids_of(ckpt, query)) + len(ids_of(ckpt, d)) for d in docs)


async def test_errors(gateway, make_generate_gateway):
    http = gateway.http
    r = await http.post("/v1/embeddings", json={"input": "hi", "dimensions": 8})
    assert r.status_code == 400 and "Matryoshka" in r.json()["error"]["message"]
    long_ids = [5] * (MAX_MODEL_LEN + 1)
    r = await http.post("/v1/embeddings", json={"input": long_ids})
    assert r.status_code == 400
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    r = await http.post("/v1/embeddings", json={"input": long_ids, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    r = await http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400
    for path, api in (("/v1/chat/completions", "Chat Completions"),
                      ("/v1/completions", "Completions")):
        r = await http.post(path, json={"prompt": "hi", "messages": []})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == f"The model does not support {api} API"
    assert (await http.get("/v1/models")).json()["data"][0]["id"] == \
        gateway.config.served_model_name
    assert (await http.get("/health")).status_code == 200  # prefill only, no decode
    assert "pdserve_gateway_prompt_tokens_total" in (await http.get("/metrics")).text
    generate = await make_generate_gateway()
    for path, api in (("/v1/embeddings", "Embeddings"), ("/pooling", "Pooling"),
                      ("/score", "Score"), ("/rerank", "Rerank (Score)")):
        r = await generate.http.post(path, json={"input": "x", "text_1": "a", "text_2": "b",
                                                 "query": "a", "documents": ["b"]})
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": f"The model does not support {api} API",
                                     "type": "NotFoundError", "param": None,
                                     "code": 404}


@pytest_asyncio.fixture(loop_scope="module")
async def make_generate_gateway(gateway, ckpt):
    """A gateway of a generate deployment (no engine is called for these refusals)."""
    import contextlib

    async with contextlib.AsyncExitStack() as stack:
        async def make():
            return await stack.enter_async_context(running_gateway(
                ckpt.path, _Urls(gateway.config.prefill_urls)))
        yield make
