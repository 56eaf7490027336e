"""Fixtures of the end-to-end tests: the REAL gateway (uvicorn on a free port) in front of
REAL prefill and decode services (in-process grpc.aio on port 0, real engines).

One cluster (1 prefill + 1 decode) and one gateway per module; the tests run on the
module event loop: `pytestmark = pytest.mark.asyncio(loop_scope="module")`.
The offline reference answers are computed before the cluster starts (the offline engine
blocks for seconds, which must not happen on the event loop).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from tests.conftest import PARITY_MESSAGES
from tests.services.gateway.conftest import RunningGateway, running_gateway
from tests.services.helpers import Cluster, RedisServer, start_cluster

E2E_ENGINE = dict(kv_cache_memory="256MiB", max_model_len=2048)
"""Engine arguments of the e2e instances (and of the offline reference)."""
PARITY_CASES = [PARITY_MESSAGES[0], PARITY_MESSAGES[2]]
PARITY_MAX_TOKENS = 32


@dataclass(frozen=True)
class Urls:
    """What `running_gateway` reads from a cluster: the static backend lists."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]


@dataclass(frozen=True)
class Reference:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@pytest.fixture(scope="module")
def offline_answers(model_path) -> list[Reference]:
    """pdserve.shared.llm.LLM's greedy chat answers for PARITY_CASES (built and freed here)."""
    from pdserve.shared.llm import LLM
    from pdserve.shared.sampling_params import SamplingParams

    llm = LLM(model_path, **E2E_ENGINE)
    outs = llm.chat(PARITY_CASES, SamplingParams(temperature=0.0,
                                                 max_tokens=PARITY_MAX_TOKENS))
    del llm
    return [Reference(o.outputs[0].text, list(o.outputs[0].token_ids),
                      o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer | None]:
    if shutil.which("redis-server") is None:
        yield None
        return
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis_cluster(model_path, redis_server) -> AsyncIterator[Cluster]:
    """Real prefill + decode registered in the module's real Redis (skipped without one)."""
    if redis_server is None:
        pytest.skip("redis-server is not installed (the Redis index is part of the check)")
    c = await start_cluster(model_path, redis_server.url, **E2E_ENGINE)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real_cluster(model_path, offline_answers) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, None, **E2E_ENGINE)
    yield c
    await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real_gateway(model_path, real_cluster) -> AsyncIterator[RunningGateway]:
    urls = Urls((real_cluster.prefill.identity.address,),
                (real_cluster.decode.identity.address,))
    async with running_gateway(model_path, urls, rpc_timeout=10.0) as gw:  # type: ignore[arg-type]
        gw.client = gw.client.with_options(timeout=120)
        yield gw
