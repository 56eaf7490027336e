"""The pooling routes of a `--runner pooling` deployment: POST /v1/embeddings, /pooling,
/score and /rerank (vLLM's, with vLLM's errors).

    inputs ─▶ tokenize, truncate, length check ─▶ one Pool call per input (prefill
    instances only: cache-aware placement, least loaded; another instance on a failed one)
    ─▶ pooled vectors ─▶ embeddings / pooling data / cosine scores / reranked documents

Score and rerank with an embedding model are vLLM's: the cosine similarity of the two texts'
embeddings (each distinct text embedded once). A generate deployment answers these routes,
and a pooling deployment the generate ones, with 404 (vLLM registers only the routes its
runner serves) and the message "The model does not support ... API".
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.services.gateway.admission import AdmissionQueue
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.errors import (
    GatewayError,
    bad_request,
    from_grpc_error,
    model_not_found,
    no_backend,
)
from pdserve.services.gateway.failover import EngineClient
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.placement import PromptHashes
from pdserve.services.gateway.prefill_decode import INSTANCE_FAILED
from pdserve.services.gateway.protocol_pooling import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pdserve.services.gateway.sampling import check_token_ids, truncate_prompt
from pdserve.services.gateway.serving import response_id
from pdserve.services.gateway.streams import run_until_disconnect
from pdserve.services.gateway.tenancy import request_cache_salt
from pdserve.services.gateway.tokenization import GatewayTokenizer
from pdserve.services.proto import engine_pb2


def not_supported(api: str) -> GatewayError:
    """A route the deployment's runner does not serve: 404, as vLLM (which does not register
    the route), with a message naming the API; never a 5xx, since nothing failed."""
    return GatewayError(f"The model does not support {api} API", 404,
                        err_type="NotFoundError")


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity (torch's: the product of the norms clamped at 1e-8)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(y * y for y in b))
    return dot / max(na * nb, 1e-8)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes (vLLM's and OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


class PoolingServing:
    def __init__(self, config: GatewayConfig, engine: EngineClient,
                 tokenizer: GatewayTokenizer, metrics: GatewayMetrics,
                 admission: AdmissionQueue) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission

    # -- routes ------------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest, request: Request,
                         api: str = "Embeddings") -> Response:
        self._check(req.model, api)
        if req.dimensions is not None:
            raise bad_request(
                f"Model {self.config.served_model_name!r} does not support Matryoshka "
                f"embeddings; dimensions must be unset (received dimensions={req.dimensions}).",
                "dimensions")
        if isinstance(req, PoolingRequest) and req.task not in (None, "embed"):
            raise bad_request(f"task {req.task!r} is not supported: this model pools for "
                              "embeddings (task 'embed')", "task")
        prompts = await self._prompts(req.input, req, "input")
        vectors = await self._pool(prompts, req, request, req.normalize_flag)
        pooling = isinstance(req, PoolingRequest)
        data = [{"index": i, "object": "pooling" if pooling else "embedding",
                 "data" if pooling else "embedding": encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        num_tokens = sum(map(len, prompts))
        return JSONResponse({
            "id": f"{'pool' if pooling else 'embd'}-{response_id(req, request)}",
            "object": "list", "created": int(time.time()),
            "model": self.config.served_model_name, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}})

    async def pooling(self, req: PoolingRequest, request: Request) -> Response:
        return await self.embeddings(req, request, "Pooling")

    async def score(self, req: ScoreRequest, request: Request) -> Response:
        self._check(req.model, "Score")
        first, second = req.pairs
        if len(first) > 1 and len(first) != len(second):
            raise bad_request("Input lengths must be either 1:1, 1:N or N:N", "text_1")
        if not first or not second:
            raise bad_request("At least one text element must be given"
                              if not first else "At least one text_pair element must be given",
                              "text_1" if not first else "text_2")
        scores, num_tokens = await self._scores(first * len(second) if len(first) == 1
                                                else first, second, req, request)
        return JSONResponse({
            "id": f"score-{response_id(req, request)}", "object": "list",
            "created": int(time.time()), "model": self.config.served_model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None}})

    async def rerank(self, req: RerankRequest, request: Request) -> Response:
        self._check(req.model, "Rerank (Score)")
        if req.top_n < 0:
            raise bad_request(f"top_n must be >= 0, got {req.top_n}", "top_n")
        if not req.documents:
            raise bad_request("At least one text_pair element must be given", "documents")
        scores, num_tokens = await self._scores([req.query] * len(req.documents),
                                                req.documents, req, request)
        results = [{"index": i, "relevance_score": s,
                    **({"document": {"text": d}} if req.return_documents else {})}
                   for i, (d, s) in enumerate(zip(req.documents, scores, strict=True))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if 0 < req.top_n < len(results):
            results = results[:req.top_n]
        return JSONResponse({
            "id": f"rerank-{response_id(req, request)}", "model": self.config.served_model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results})

    # -- shared ------------------------------------------------------------------------------

    def _check(self, model: str | None, api: str) -> None:
        if self.config.runner != "pooling":
            raise not_supported(api)
        if model is not None and model != self.config.served_model_name:
            raise model_not_found(model)

    async def _scores(self, first: list[str], second: list[str], req, request: Request
                      ) -> tuple[list[float], int]:
        """Each pair's cosine similarity (every distinct text embedded once), and the
        prompt tokens of the pairs (vLLM's usage: both texts of every pair)."""
        texts = list(dict.fromkeys(first + second))
        prompts = await self._prompts(texts, req, "text_1")
        vectors = dict(zip(texts, await self._pool(prompts, req, request, None), strict=True))
        tokens = dict(zip(texts, map(len, prompts), strict=True))
        return ([cosine(vectors[a], vectors[b]) for a, b in zip(first, second, strict=True)],
                sum(tokens[a] + tokens[b] for a, b in zip(first, second, strict=True)))

    async def _prompts(self, value, req, param: str) -> list[list[int]]:
        """Token ids of every input (text tokenized, ids checked), truncated as asked and
        within max_model_len. Raises GatewayError 400 naming `param`."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise bad_request(f"{param} must not be empty", param)
        max_model_len = (await self.engine.engine_info()).max_model_len
        prompts = []
        for item in value:
            if isinstance(item, str):
                ids = await self.tokenizer.encode_prompt(item, req.add_special_tokens)
            else:
                check_token_ids(item, self.tokenizer.vocab_size, param)
                ids = list(item)
            ids = truncate_prompt(ids, req.truncate_prompt_tokens, max_model_len)
            if not ids:
                raise bad_request(f"{param} must not be empty", param)
            if len(ids) > max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your prompt contains {len(ids)} input tokens, which exceeds this limit "
                    "even without any output tokens. Please reduce the length of the input "
                    "prompt.", param)
            prompts.append(ids)
        return prompts

    async def _pool(self, prompts: list[list[int]], req, request: Request,
                    normalize: bool | None) -> list[list[float]]:
        """One Pool call per prompt, all at once, in the waiting queue's bounds; cancelled
        (and so aborted on the engines) when the client goes away."""
        state = request.state
        salt = request_cache_salt(state.tenant_cache_salt, req.cache_salt)
        grant = self.admission.admit([len(p) for p in prompts])
        started = time.monotonic()

        async def one(i: int, ids: list[int]) -> list[float]:
            try:
                resp = await self._pool_one(f"{state.engine_request_prefix}-{i}", ids, salt,
                                            normalize, state.request_id)
                grant.start(i)
                return list(resp.data)
            finally:
                grant.finish(i)

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        for t in tasks:  # a sibling failing after the first failure: retrieved, not logged
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            vectors = await run_until_disconnect(request.receive, asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()  # a failed sibling: stop the rest (no-op on finished ones)
            grant.release()
        m = self.metrics
        m.prompt_tokens.inc(sum(map(len, prompts)))
        for p in prompts:
            m.request_prompt_tokens.observe(len(p))
            m.request_success.labels("stop").inc()
        m.request_inference_time.observe(time.monotonic() - started)
        return vectors

    async def _pool_one(self, engine_request_id: str, token_ids: list[int],
                        cache_salt: str | None, normalize: bool | None,
                        request_id: str) -> engine_pb2.PoolResponse:
        """Pool on the best prefill instance; a failed instance (unreachable, crashed) is
        marked and another one tried, up to --max-request-retries."""
        engine, info = self.engine, await self.engine.engine_info()
        engine.health.ensure_started()
        avoid: list[str] = []
        prompt_hashes = PromptHashes(token_ids)  # once for every retry
        failure = ""
        for attempt in range(self.config.max_request_retries + 1):
            address = await engine.placer.place_prefill(
                token_ids, model_name=info.model_name, block_size=info.block_size,
                cache_salt=cache_salt, avoid=avoid, quantization=info.quantization,
                prompt_hashes=prompt_hashes)
            if address is None:
                raise no_backend("no prefill instance is configured or live" + failure)
            message = engine_pb2.PoolRequest(
                request_id=f"{engine_request_id}-retry{attempt}" if attempt
                else engine_request_id, prompt_token_ids=token_ids,
                cache_salt=cache_salt or "")
            if normalize is not None:
                message.normalize = normalize
            try:
                return await engine.channels.pool(address, message, request_id)
            except grpc.aio.AioRpcError as e:
                if e.code() not in INSTANCE_FAILED:
                    raise from_grpc_error(e, "Pool") from None
                engine.health.mark_failed(address)
                avoid.append(address)
                failure = f" (prefill {address}: {e.code().name}: {e.details()})"
        raise GatewayError(f"Service unavailable: {failure.strip(' ()')} (retried "
                           f"{self.config.max_request_retries} times).", 503)
