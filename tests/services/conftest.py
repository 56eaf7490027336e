"""Fixtures of the prefill / decode service tests: a real redis-server on a free port and one
prefill + one decode instance (real engines, grpc.aio on port 0) shared by the session.

Tests that use `cluster` run on the session event loop:
`pytestmark = pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.services.helpers import Cluster, RedisServer, start_cluster


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | None]:
    """None without the `redis-server` binary: the cluster then runs without the index
    (as the services do when Redis is unreachable) and the index checks skip."""
    if shutil.which("redis-server") is None:
        yield None
        return
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server) -> RedisServer:
    if redis_server is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return redis_server


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster(model_path, redis_server) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, redis_server.url if redis_server else None)
    yield c
    await c.close()


@pytest.fixture(scope="session")
def reference_llm(model_path):
    """The single-process engine the split must match token for token."""
    from shared.llm import LLM

    return LLM(model_path, kv_cache_memory="128MiB")
