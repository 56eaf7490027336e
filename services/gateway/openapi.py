"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), built from its routes.

Every route of the app becomes a path; the request bodies are the JSON schemas of the
pydantic models in protocol.py (`model_json_schema`), and every error is the OpenAI error
object (`ErrorResponse`). With API keys, every route but the public ones
(middleware.PUBLIC_ROUTES: /health, /ping, /version, /docs, /openapi.json, /metrics) needs
`Authorization: Bearer <api key>`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from pdserve.services.gateway.middleware import PUBLIC_ROUTES
from pdserve.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from pdserve.services.gateway.protocol_pooling import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)

_REF = "#/components/schemas/{model}"
_CONVERTER = re.compile(r"\{(\w+):\w+\}")
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/pooling": PoolingRequest,
    "/score": ScoreRequest,
    "/v1/score": ScoreRequest,
    "/rerank": RerankRequest,
    "/v1/rerank": RerankRequest,
    "/v2/rerank": RerankRequest,
}
_SUMMARIES = {
    "/v1/models": "The served model and its LoRA adapters (`parent`: the base model).",
    "/v1/models/{model}": "One model's or adapter's card (404 for any other name).",
    "/v1/load_lora_adapter": "vLLM's: load a LoRA adapter {lora_name, lora_path} on every "
                             "instance, all or nothing (admin key).",
    "/v1/unload_lora_adapter": "vLLM's: unload a LoRA adapter {lora_name} everywhere "
                               "(admin key).",
    "/ping": "As /health (vLLM's, for SageMaker-style load balancers).",
    "/version": "The pdserve version.",
    "/docs": "Swagger UI over this document.",
    "/v1/completions": "OpenAI completions (text or token-id prompts; `stream` for SSE).",
    "/v1/chat/completions": "OpenAI chat completions (`stream` for SSE).",
    "/tokenize": "Token ids of a prompt or of chat messages.",
    "/detokenize": "Text of token ids.",
    "/v1/embeddings": "OpenAI embeddings (a --runner pooling deployment; else 404).",
    "/pooling": "vLLM's pooling: the pooled hidden state of each input (--runner pooling).",
    "/score": "vLLM's score: cosine similarity of the texts' embeddings (--runner pooling).",
    "/v1/score": "As /score.",
    "/rerank": "vLLM's rerank: documents by cosine similarity to the query, most relevant "
               "first (--runner pooling).",
    "/v1/rerank": "As /rerank.",
    "/v2/rerank": "As /rerank.",
    "/health": "200 while a decode instance serves (it prefills locally when no prefill "
               "instance does), else 503; the body names each degraded part (no API key).",
    "/metrics": "Prometheus metrics of the gateway.",
    "/openapi.json": "This document.",
}
_STREAMING = frozenset({"/v1/completions", "/v1/chat/completions"})
_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key",
             "404": "Unknown model or route", "413": "Body over --max-body-size",
             "429": "Waiting queue full: retry after the `Retry-After` header's seconds",
             "503": "No prefill / decode instance available"}


_COUNTS = {"type": "object", "required": ["serving", "instances"], "properties": {
    "serving": {"type": "integer"}, "instances": {"type": "integer"}}}
_HEALTH_BODY = {"type": "object", "required": ["status", "degraded", "prefill", "decode",
                                               "redis"], "properties": {
    "status": {"type": "string", "enum": ["ok", "degraded", "unavailable"]},
    "degraded": {"type": "object", "additionalProperties": {"type": "string"},
                 "description": "Each degraded part (prefill, decode, redis) and why."},
    "prefill": _COUNTS, "decode": _COUNTS,
    "redis": {"type": ["object", "null"], "properties": {
        "up": {"type": "boolean"}, "view_age_s": {"type": ["number", "null"]}}}}}
"""/health's body (health.HealthReport)."""


def _health_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": _HEALTH_BODY}}}


def _error_response(description: str) -> dict:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model="ErrorResponse")}}}}


def _ok_response(path: str) -> dict:
    if path == "/metrics":
        return {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
    if path in ("/health", "/ping"):
        return _health_response("Ready: a decode instance serves")
    content = {"application/json": {"schema": {"type": "object"}}}
    if path in _STREAMING:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content}


def _operation(path: str, method: str) -> dict:
    op: dict = {"summary": _SUMMARIES.get(path, path),
                "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('.', '_')}",
                "responses": {"200": _ok_response(path)}}
    model = REQUEST_MODELS.get(path)
    if model is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}}
        op["responses"].update({code: _error_response(text) for code, text in _STATUSES.items()
                                if code != "401" or path not in PUBLIC_ROUTES})
    elif path in ("/health", "/ping"):
        op["responses"]["503"] = _health_response("No decode instance serves")
    else:
        op["responses"]["default"] = _error_response("An OpenAI error object")
    if path in PUBLIC_ROUTES:
        op["security"] = []
    elif "401" not in op["responses"]:
        op["responses"]["401"] = _error_response(_STATUSES["401"])
    return op


def openapi_path(path: str) -> str:
    """A route path as OpenAPI writes it: /v1/models/{model:path} -> /v1/models/{model}."""
    return _CONVERTER.sub(r"{\1}", path)


def build_openapi(routes: Iterable[BaseRoute], *, title: str, version: str) -> dict:
    """The OpenAPI 3.1 document of `routes` (starlette Routes; others are skipped)."""
    models = [*REQUEST_MODELS.values(), ErrorResponse]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    paths: dict[str, dict] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        methods = sorted(m.lower() for m in (route.methods or {"GET"}) if m != "HEAD")
        path = openapi_path(route.path)
        paths[path] = {m: _operation(path, m) for m in methods}
        for name in route.param_convertors:
            for op in paths[path].values():
                op["parameters"] = [{"name": name, "in": "path", "required": True,
                                     "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "pdserve's OpenAI-compatible gateway."},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
