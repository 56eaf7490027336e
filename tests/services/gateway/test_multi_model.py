"""Several models behind one gateway, without engines: the routing table (ModelTable), the
ASGI router's dispatch by the body's `model`, --extra-model parsing, and `pdserve up`'s
repeated --model (the plan's children and the gateway's flags)."""

from __future__ import annotations

import asyncio
import json
import shlex
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdserve.services.cli import build_parser
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.multi_model import (
    ModelRouter,
    ModelTable,
    model_config,
    parse_extra_models,
)
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.models import add_models, model_of
from pdserve.services.launcher.plan import build_plan


class FakeLoRA:
    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.seen: set[str] = set()
        self.asked = 0

    def is_known(self, model: str) -> bool:
        return model in self.seen

    async def adapters(self):
        self.asked += 1
        self.seen = set(self.names)
        return [SimpleNamespace(lora_name=n) for n in sorted(self.names)]


def test_table_routes_names_then_adapters_else_none():
    a_lora, b_lora = FakeLoRA("a-sql"), FakeLoRA("b-chat", "shared")
    table = ModelTable([("a", "A", a_lora), ("b", "B", b_lora), ("c", "C", None)])
    run = asyncio.run
    assert table.names == ["a", "b", "c"]
    assert [run(table.route(m)) for m in ("a", "b", "c", None)] == ["A", "B", "C", "A"]
    assert run(table.route("b-chat")) == "B"  # an adapter not seen yet: asked again
    asked = b_lora.asked
    assert run(table.route("b-chat")) == "B" and b_lora.asked == asked  # seen: no call
    assert run(table.route("a-sql")) == "A"
    assert run(table.route("nope")) is None
    b_lora.names.add("a")  # a model's name wins over an adapter of that name
    assert run(table.route("a")) == "A"
    with pytest.raises(ValueError):
        ModelTable([])


def _app(name: str, max_body_size: int = 1000) -> Starlette:
    async def echo(request: Request):
        return JSONResponse({"app": name, "body": (await request.body()).decode()})

    app = Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"]),
                            Route("/v1/load_lora_adapter", echo, methods=["POST"]),
                            Route("/v1/models", echo, methods=["GET"])])
    app.state.gateway = SimpleNamespace(lora=FakeLoRA(f"{name}-lora"),
                                        config=SimpleNamespace(max_body_size=max_body_size))
    return app


def test_router_dispatches_by_body_model_and_replays_the_body():
    router = ModelRouter([("a", _app("a", max_body_size=64)), ("b", _app("b"))])
    assert [g.lora.names for g in router.default.state.gateways] == [{"a-lora"}, {"b-lora"}]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(router),
                                     base_url="http://gw") as http:
            async def post(body, path="/v1/chat/completions"):
                r = await http.post(path, content=body)
                return r.json()["app"], r.json()["body"]

            body = json.dumps({"model": "b", "messages": []})
            assert await post(body) == ("b", body)  # the whole body, replayed
            assert (await post('{"model": "b-lora"}'))[0] == "b"
            assert (await post('{"model": "a"}'))[0] == "a"
            assert (await post('{"model": "unknown"}'))[0] == "a"  # the default's 404
            assert (await post("not json"))[0] == "a"
            assert (await post('["b"]'))[0] == "a"
            big = json.dumps({"model": "b", "pad": "x" * 100})  # over the limit: default
            assert await post(big) == ("a", big)
            assert (await post('{"lora_name": "x", "base_model_name": "b"}',
                               "/v1/load_lora_adapter"))[0] == "b"
            assert (await http.get("/v1/models")).json()["app"] == "a"

    asyncio.run(go())


def test_router_runs_every_apps_lifespan():
    events = []

    def app(name):
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_):
            events.append(f"{name} up")
            yield
            events.append(f"{name} down")

        a = Starlette(lifespan=lifespan)
        a.state.gateway = SimpleNamespace(lora=None, config=SimpleNamespace(max_body_size=1))
        return a

    router = ModelRouter([("a", app("a")), ("b", app("b"))])
    sent, inbox = [], [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive():
        return inbox.pop(0)

    async def send(message):
        sent.append(message["type"])

    asyncio.run(router({"type": "lifespan"}, receive, send))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert events == ["a up", "b up", "b down", "a down"]


def test_parse_extra_models(model_path, tmp_path):
    config = GatewayConfig(model_path=model_path, served_model_name="a",
                           redis_url="redis://127.0.0.1:1/0")
    assert parse_extra_models([f"b={model_path}"], config) == (("b", model_path),)
    for bad, error in [("b", ValueError), (f"a={model_path}", ValueError),
                       (f"b={tmp_path}", FileNotFoundError)]:
        with pytest.raises(error):
            parse_extra_models([bad], config)
    with pytest.raises(ValueError, match="--redis-url"):
        parse_extra_models([f"b={model_path}"], GatewayConfig(model_path=model_path))
    extra = model_config(GatewayConfig(model_path=model_path, served_model_name="a",
                                       prefill_urls=("p:1",), decode_urls=("d:1",),
                                       chat_template="{{x}}", max_model_len=64), "b", "/b")
    assert (extra.served_model_name, extra.model_path, extra.prefill_urls, extra.decode_urls,
            extra.chat_template, extra.max_model_len) == ("b", "/b", (), (), None, None)


def test_up_repeated_model_plans_replicas_per_model(model_path, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text("{}")
    ns = build_parser().parse_args(["up", "--model", model_path, "--served-model-name", "a",
                                    "--model", str(tmp_path / "tiny"), "--prefill-port",
                                    "41000", "--lora-modules", f"x={tmp_path / 'x'}",
                                    "--enable-lora"])
    assert ns.model == model_path
    config = config_from_args(ns)
    assert config.extra_models == (str(tmp_path / "tiny"),)
    one = config_from_args(build_parser().parse_args(["up", "--model", model_path]))
    assert one.extra_models == () and one.engine_args.model == model_path
    plan = add_models(build_plan(config, model_path, "a", python="py"), config,
                      [("/m/tiny", "tiny")], python="py")
    names = [s.name for s in plan.children]
    assert names == ["redis", "prefill-0", "decode-0", "prefill-1", "decode-1", "gateway"]
    assert [model_of(s) for s in plan.children] == [None, "a", "a", "tiny", "tiny", None]
    by_name = {s.name: list(s.argv) for s in plan.children}
    assert "--lora-modules" in by_name["prefill-0"] and "--lora-modules" not in by_name[
        "prefill-1"]
    assert by_name["prefill-1"][by_name["prefill-1"].index("--model") + 1] == "/m/tiny"
    redis = plan.redis_url
    assert all(redis in argv for name, argv in by_name.items() if name != "redis")
    ports = [p for s in plan.children for p in s.ports]
    assert len(ports) == len(set(ports))
    gateway = shlex.join(by_name["gateway"])
    assert gateway.endswith("--extra-model tiny=/m/tiny")
    gw_ns = build_parser().parse_args(by_name["gateway"][by_name["gateway"].index("serve"):])
    assert gw_ns.extra_model == ["tiny=/m/tiny"]
    with pytest.raises(ValueError, match="same name"):
        add_models(build_plan(config, model_path, "a", python="py"), config,
                   [("/m/a", "a")], python="py")
