"""Several models behind one gateway: one per-model app each, a request routed by its `model`.

    pdserve serve gateway --model DIR_A [--served-model-name A] --redis-url URL \\
        --extra-model B=DIR_B [--extra-model C=DIR_C ...]

    ModelRouter (ASGI)
      POST with a JSON body (completions, chat, responses, pooling, tokenize, ...)
        body.model ─▶ ModelTable.route ─▶ that model's app (the body replayed to it)
      everything else (/v1/models, /health, /metrics, admin, dashboard) ─▶ the first model's app
        /v1/models lists every model's card and adapters (app.state.gateways)
        /metrics every model's gateway families (labelled model_name) and engines

Each model's app is a whole gateway (app.build_app): its own tokenizer and chat template,
its own RegistryView (the Redis registry is keyed by the served model name, so a placer
only ever sees instances of its own model), placer, failover, prefix-aware routing, LoRA
view and federation. Nothing can place a request on another model's instance. An extra
model's instances are found through Redis only (the static --prefill-url / --decode-url
lists are the first model's).

The gateway reads each model's tokenizer from the local directory it is given (as for
--model): a model it was not given is unknown here, and a request naming it gets vLLM's 404,
even when instances of it are registered in Redis. The first model answers requests that
name no model, an unknown one (its 404, after the API key check) and the shared routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.shutdown import ShutdownNotice

BODY_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""POST routes whose JSON body names the model (the LoRA admin routes by base_model_name)."""


def parse_extra_models(values: Sequence[str], config: GatewayConfig
                       ) -> tuple[tuple[str, str], ...]:
    """--extra-model NAME=PATH values as (served name, model directory) pairs.

    Raises:
        ValueError: not NAME=PATH, a name served twice, or no --redis-url.
        FileNotFoundError: PATH is not a local model directory.
    """
    from pdserve.shared.models.convert import resolve_model_path

    out: list[tuple[str, str]] = []
    names = {config.served_model_name}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--extra-model {value!r}: expected NAME=PATH")
        if name in names:
            raise ValueError(f"--extra-model {value!r}: the model name {name!r} is served "
                             "twice")
        try:
            resolved = str(resolve_model_path(path, convert=False))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--extra-model {name}: {e}") from None
        if not os.path.isfile(os.path.join(resolved, "tokenizer.json")):
            raise FileNotFoundError(f"--extra-model {name}: no tokenizer.json in {resolved} "
                                    "(the gateway tokenizes each model's prompts itself)")
        names.add(name)
        out.append((name, resolved))
    if out and not config.redis_url:
        raise ValueError("--extra-model needs --redis-url: an extra model's instances are "
                         "found in the registry")
    return tuple(out)


def model_config(config: GatewayConfig, name: str, path: str) -> GatewayConfig:
    """An extra model's config: the first model's, with its own name, directory, tokenizer
    and chat template (its own), context (asked of its engines) and no static instances."""
    generation = config.generation_config if config.generation_config in ("auto", "vllm") \
        else "auto"
    return dataclasses.replace(config, model_path=path, served_model_name=name,
                               tokenizer=None, chat_template=None, max_model_len=None,
                               prefill_urls=(), decode_urls=(), generation_config=generation)


class ModelTable:
    """Served model name -> its target (an app), and the adapters of each model's LoRA view.

    `route(model)`: the model of that name; else the model one of whose adapters has that
    name (the adapters seen last, then asked again); else None (unknown: vLLM's 404)."""

    def __init__(self, entries: Sequence[tuple[str, Any, Any]]) -> None:
        """`entries`: (served name, target, LoRAView or None) each, the default first."""
        if not entries:
            raise ValueError("a model table needs at least one model")
        self.entries = list(entries)
        self.by_name = {name: target for name, target, _ in self.entries}
        self.default = self.entries[0][1]

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]

    async def route(self, model: str | None) -> Any | None:
        if model is None:
            return self.default
        if model in self.by_name:
            return self.by_name[model]
        for _, target, lora in self.entries:
            if lora is not None and lora.is_known(model):
                return target
        for _, target, lora in self.entries:  # a new adapter: look again
            if lora is not None and model in {a.lora_name for a in await lora.adapters()}:
                return target
        return None


def build_gateway_app(config: GatewayConfig, extra_models: Sequence[tuple[str, str]] = ()):
    """The gateway app: app.build_app's for one model, a ModelRouter over one app per model
    otherwise (they share the shutdown notice, so a SIGTERM drains them all)."""
    from pdserve.services.gateway.app import build_app

    if not extra_models:
        return build_app(config)
    shutdown = ShutdownNotice()
    apps = [(config.served_model_name, build_app(config, shutdown=shutdown))]
    apps += [(name, build_app(model_config(config, name, path), shutdown=shutdown))
             for name, path in extra_models]
    return ModelRouter(apps)


class ModelRouter:
    """The ASGI app in front of the per-model apps (module docstring)."""

    def __init__(self, apps: Sequence[tuple[str, Any]]) -> None:
        self.apps = [app for _, app in apps]
        self.table = ModelTable([(name, app, app.state.gateway.lora) for name, app in apps])
        self.default = self.apps[0]
        self.default.state.gateways = [app.state.gateway for app in self.apps]
        self.default.state.render_metrics = self.render_metrics
        self.state = self.default.state
        """`state.gateway`: the first model's (its shutdown notice is every model's)."""

    async def render_metrics(self) -> bytes:
        """/metrics: every model's gateway families (labelled model_name) and engines."""
        from pdserve.services.gateway.federation import merge, render_families

        gateways = [app.state.gateway for app in self.apps]
        parts = await asyncio.gather(*(gw.federation.families(
            {"model_name": gw.config.served_model_name}) for gw in gateways))
        first = gateways[0]
        return render_families(merge(f for families in parts for f in families),
                               first.federation.compat, first.config.served_model_name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in BODY_ROUTES:
            await self.default(scope, receive, send)
            return
        limit = self.default.state.gateway.config.max_body_size
        chunks, size, more = [], 0, True
        while more and size <= limit:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body came
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)
        app = self.default if more else \
            await self.table.route(_model_of(body, scope["path"])) or self.default
        await app(scope, _replay(body, more, receive), send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            try:
                for app in self.apps:
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as e:
                await send({"type": "lifespan.startup.failed", "message": repr(e)})
                return
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})


def _model_of(body: bytes, path: str) -> str | None:
    """The model a request body names (None: none, or not a JSON object)."""
    try:
        parsed = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    key = "base_model_name" if path.endswith("_lora_adapter") else "model"
    value = parsed.get(key) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """A receive that hands the app the body read so far, then the client's own messages
    (the rest of an oversized body, a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replayed
