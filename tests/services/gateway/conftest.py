"""Fixtures: a fake split engine on real gRPC servers and a real gateway (uvicorn, free port).

One fake cluster and one gateway per test module (the API test modules run in a module-wide
event loop: `pytestmark = pytest.mark.asyncio(loop_scope="module")`); `gateway` and
`cluster` reset the fakes' records and injected faults before each test, and
`make_gateway(**config_overrides)` starts a gateway with its own config for one test.

The end-to-end tests against real prefill/decode services only need other addresses in
`GatewayConfig.prefill_urls` / `decode_urls`; everything above the gRPC boundary is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import pytest_asyncio
import uvicorn

from pdserve.services.gateway.app import build_app
from pdserve.services.gateway.backpressure import TransportHttpProtocol, set_send_buffer
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.tokenization import load_tokenizer
from tests.services.gateway.fake_engine import (
    SCRIPT_TEXT,
    FakeCluster,
    FakeModel,
    start_fake_cluster,
)

SERVED_MODEL = "pdserve-test"


@pytest.fixture(scope="session")
def fast_tokenizer(model_path):
    """The gateway's own (torch-free) tokenizer of the default model."""
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def fake_model(fast_tokenizer) -> FakeModel:
    script = fast_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    return FakeModel(script + [fast_tokenizer.eos_token_id], fast_tokenizer.eos_token_id,
                     len(fast_tokenizer))


@dataclass
class RunningGateway:
    url: str
    app: object
    cluster: FakeCluster
    config: GatewayConfig
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI

    @property
    def prefill(self):
        return self.cluster.prefills[0]

    @property
    def decode(self):
        return self.cluster.decodes[0]


@contextlib.asynccontextmanager
async def running_gateway(model_path: str, cluster: FakeCluster,
                          **overrides) -> AsyncIterator[RunningGateway]:
    """A gateway app on uvicorn at a free port in front of `cluster`."""
    config = GatewayConfig(model_path=model_path, served_model_name=SERVED_MODEL,
                           prefill_urls=cluster.prefill_urls, decode_urls=cluster.decode_urls,
                           rpc_timeout=2.0)
    config = dataclasses.replace(config, **overrides)
    app = build_app(config)
    sock = socket.socket()
    set_send_buffer(sock, config.socket_send_buffer)  # as services/gateway/__main__.py
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    # NOTE: a bounded drain, as services/gateway/__main__.py has: without it uvicorn waits
    # without end for a connection still open at teardown (a module's teardown once hung
    # until a signal ended it).
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           http=TransportHttpProtocol,
                                           timeout_graceful_shutdown=30))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    url = f"http://{host}:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30) as client:
        try:
            yield RunningGateway(url, app, cluster, config, http, client)
        finally:
            server.should_exit = True
            await task


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_cluster(fake_model) -> AsyncIterator[FakeCluster]:
    c = await start_fake_cluster(fake_model)
    yield c
    await c.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def cluster(module_cluster) -> FakeCluster:
    await module_cluster.reset()
    return module_cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_gateway(model_path, module_cluster) -> AsyncIterator[RunningGateway]:
    async with running_gateway(model_path, module_cluster) as gw:
        yield gw


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(module_gateway, cluster) -> RunningGateway:
    return module_gateway


@pytest_asyncio.fixture(loop_scope="module")
async def make_gateway(model_path, cluster):
    """`await make_gateway(cluster=None, **config_overrides)` -> RunningGateway."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(cluster_: FakeCluster | None = None, **overrides) -> RunningGateway:
            return await stack.enter_async_context(
                running_gateway(model_path, cluster_ or cluster, **overrides))

        yield make

