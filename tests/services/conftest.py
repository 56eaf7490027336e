"""Fixtures of the prefill / decode service tests: one prefill + one decode instance (real
engines, grpc.aio on port 0) shared by the session, on the root conftest's redis-server.

Tests that use `cluster` run on the session event loop:
`pytestmark = pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.services.helpers import Cluster, start_cluster


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster(model_path, redis_server) -> AsyncIterator[Cluster]:
    c = await start_cluster(model_path, redis_server.url if redis_server else None)
    yield c
    await c.close()


@pytest.fixture(scope="session")
def reference_llm(model_path):
    """The single-process engine the split must match token for token."""
    from pdserve.shared.llm import LLM

    return LLM(model_path, kv_cache_memory="128MiB")
