"""HTTP routes: thin handlers (read, parse, delegate) and the error handlers."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from pdserve.services.gateway.dashboard import dashboard_feed, dashboard_page, dashboard_script
from pdserve.services.gateway.debug import kv_audit
from pdserve.services.gateway.errors import GatewayError, error_response, model_not_found
from pdserve.services.gateway.lora import load_lora_adapter, unload_lora_adapter
from pdserve.services.gateway.openapi import build_openapi
from pdserve.services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from pdserve.services.gateway.protocol_pooling import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pdserve.services.gateway.responses_protocol import ResponsesRequest
from pdserve.services.gateway.serving_pooling import not_supported
from pdserve.services.gateway.streams import ClientDisconnected

logger = logging.getLogger(__name__)

# nginx's "client closed request": logged and counted, never seen by the client.
_CLIENT_CLOSED = 499


async def read_body(request: Request) -> bytes:
    """The request body, refusing more than --max-body-size bytes (413)."""
    limit = request.app.state.gateway.config.max_body_size
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise GatewayError(f"The request body exceeds {limit} bytes.", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(f"The request body exceeds {limit} bytes.", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _cards(request: Request) -> list[dict]:
    """The served model's card, then one per LoRA adapter (`parent`: the base model, as
    vLLM's); behind several models (multi_model.py) each model's in turn."""
    cards = []
    for gw in getattr(request.app.state, "gateways", None) or [request.app.state.gateway]:
        base = {"id": gw.config.served_model_name, "object": "model", "created": gw.created,
                "owned_by": "pdserve", "root": gw.config.model_path, "parent": None,
                "max_model_len": await gw.tokenization.max_model_len()}
        lora = gw.lora
        cards += [base] + [{**base, "id": a.lora_name, "root": a.lora_path,
                            "parent": base["id"]}
                           for a in (await lora.adapters() if lora is not None else [])]
    return cards


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": await _cards(request)})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model}: the card of the served model or an adapter (404 for any
    other name)."""
    model = request.path_params["model"]
    for card in await _cards(request):
        if card["id"] == model:
            return JSONResponse(card)
    raise model_not_found(model)


async def version(request: Request) -> Response:
    return JSONResponse({"version": _version()})


def _parsed(model_cls: type, serve, generate_api: str | None = None):
    """A POST handler: the body parsed as `model_cls`, handed to `serve(gateway)(req,
    request)`. `generate_api`: a generate route, whose name a pooling deployment (--runner
    pooling: it generates nothing) refuses with 404, as vLLM."""
    async def handler(request: Request) -> Response:
        gateway = request.app.state.gateway
        if generate_api is not None and gateway.config.runner == "pooling":
            raise not_supported(generate_api)
        req = parse_request(model_cls, await read_body(request))
        return await serve(gateway)(req, request)
    return handler


create_completion = _parsed(CompletionRequest, lambda gw: gw.completion.create, "Completions")
create_chat_completion = _parsed(ChatCompletionRequest, lambda gw: gw.chat.create,
                                 "Chat Completions")
create_response = _parsed(ResponsesRequest, lambda gw: gw.responses.create, "Responses")
create_embedding = _parsed(EmbeddingRequest, lambda gw: gw.pooling.embeddings)
create_pooling = _parsed(PoolingRequest, lambda gw: gw.pooling.pooling)
create_score = _parsed(ScoreRequest, lambda gw: gw.pooling.score)
create_rerank = _parsed(RerankRequest, lambda gw: gw.pooling.rerank)


async def retrieve_response(request: Request) -> Response:
    return await request.app.state.gateway.responses.retrieve(
        request.path_params["response_id"], request)


async def delete_response(request: Request) -> Response:
    return await request.app.state.gateway.responses.delete(
        request.path_params["response_id"], request)


async def tokenize(request: Request) -> Response:
    req = parse_request(TokenizeRequest, await read_body(request))
    return JSONResponse(await request.app.state.gateway.tokenization.tokenize(req))


async def detokenize(request: Request) -> Response:
    req = parse_request(DetokenizeRequest, await read_body(request))
    return JSONResponse(await request.app.state.gateway.tokenization.detokenize(req))


async def health(request: Request) -> Response:
    """200 while the gateway can answer: a decode instance is SERVING (it prefills locally
    when no prefill instance does), else 503; the JSON body names each degraded part (live
    checks bounded to health.HEALTH_ROUTE_BOUND s, then the last known states; no Redis
    call)."""
    report = await request.app.state.gateway.engine.health_report()
    return JSONResponse(report.body, status_code=200 if report.can_serve else 503)


async def metrics(request: Request) -> Response:
    """The gateway's metrics, then every registered engine's (labelled instance and role)."""
    gw = request.app.state.gateway
    render = getattr(request.app.state, "render_metrics", None) or gw.federation.render
    return Response(await render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def docs(request: Request) -> Response:
    """Swagger UI over /openapi.json (the UI's script and style come from a CDN)."""
    return HTMLResponse(_DOCS_HTML)


_DOCS_HTML = """<!doctype html>
<html><head><title>pdserve API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head><body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>
"""


async def openapi(request: Request) -> Response:
    """The OpenAPI document of every route (built once per app)."""
    doc = getattr(request.app.state, "openapi", None)
    if doc is None:
        doc = request.app.state.openapi = build_openapi(
            request.app.routes,
            title=f"pdserve gateway ({request.app.state.gateway.config.served_model_name})",
            version=_version())
    return JSONResponse(doc)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0"


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/embeddings", create_embedding, methods=["POST"]),
    Route("/pooling", create_pooling, methods=["POST"]),
    Route("/score", create_score, methods=["POST"]),
    Route("/v1/score", create_score, methods=["POST"]),
    Route("/rerank", create_rerank, methods=["POST"]),
    Route("/v1/rerank", create_rerank, methods=["POST"]),
    Route("/v2/rerank", create_rerank, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/ping", health, methods=["GET", "POST"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/docs", docs, methods=["GET"]),
    Route("/debug/kv-audit", kv_audit, methods=["GET"]),
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    Route("/dashboard", dashboard_page, methods=["GET"]),
    Route("/dashboard/app.js", dashboard_script, methods=["GET"]),
    Route("/dashboard/feed", dashboard_feed, methods=["GET"]),
]


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 429 and not headers:  # an engine's RESOURCE_EXHAUSTED
        headers = {"Retry-After": "1"}
    return error_response(exc, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    # exc.headers carries e.g. the `Allow` header of a 405.
    return error_response(GatewayError(exc.detail or "error", exc.status_code),
                          dict(exc.headers) if exc.headers else None)


async def _client_gone(request: Request, exc: Exception) -> Response:
    logger.info("[%s] client disconnected; request cancelled",
                getattr(request.state, "request_id", "-"))
    return Response(status_code=_CLIENT_CLOSED)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("[%s] unhandled error", getattr(request.state, "request_id", "-"),
                 exc_info=exc)
    return error_response(GatewayError("Internal server error.", 500))


EXCEPTION_HANDLERS = {
    GatewayError: _gateway_error,
    HTTPException: _http_error,
    ClientDisconnected: _client_gone,
    ClientDisconnect: _client_gone,
    Exception: _internal_error,
}
