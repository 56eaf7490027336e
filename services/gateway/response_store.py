"""Stored Responses API responses (`store`, `previous_response_id`, GET / DELETE by id).

    key  {p}:response:{tenant}:{response_id}   JSON {"response": ..., "conversation": [...]}
                                               TTL --responses-ttl seconds

`conversation` is every input item of the chain up to this response (the earlier turns'
inputs and outputs, then this turn's input; never `instructions`, which OpenAI does not
carry over), so a follow-up turn rebuilds the whole conversation with one GET.

`tenant` is the API key's tenant salt (services/gateway/tenancy.py; "public" without API
keys): another tenant's id is simply absent, a 404 that tells nothing.

With --redis-url every gateway of the cluster reads and writes the same records; without
one, each gateway keeps its own in memory (`MemoryResponseStore`). Redis is never on the
path of a generation: a store that fails is logged and counted (the response is answered
all the same), a lookup that fails is `StoreUnavailable` (503 to the client). Every Redis
command has a short timeout and no retry.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict

logger = logging.getLogger(__name__)

PUBLIC_TENANT = "public"
"""The one tenant when no API keys are configured."""
REDIS_TIMEOUT = 0.5
"""Seconds a store command may take (connect or answer)."""


class StoreUnavailable(Exception):
    """The response store could not be read or written (Redis unreachable)."""


class ResponseStore:
    """Records by (tenant, response id), each with the store's TTL."""

    ttl: float

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        raise NotImplementedError

    async def get(self, tenant: str, response_id: str) -> dict | None:
        """The record; None when absent or expired. Raises: StoreUnavailable."""
        raise NotImplementedError

    async def delete(self, tenant: str, response_id: str) -> bool:
        """True when the record was there. Raises: StoreUnavailable."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


class MemoryResponseStore(ResponseStore):
    """One gateway's own records (no --redis-url), the oldest dropped past `max_records`."""

    def __init__(self, ttl: float, max_records: int = 10_000) -> None:
        self.ttl = ttl
        self.max_records = max_records
        self._records: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        key = (tenant, response_id)
        self._records.pop(key, None)
        self._records[key] = (time.monotonic() + self.ttl, json.dumps(record))
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    async def get(self, tenant: str, response_id: str) -> dict | None:
        entry = self._records.get((tenant, response_id))
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._records[(tenant, response_id)]
            return None
        return json.loads(entry[1])

    async def delete(self, tenant: str, response_id: str) -> bool:
        found = await self.get(tenant, response_id) is not None
        self._records.pop((tenant, response_id), None)
        return found


class RedisResponseStore(ResponseStore):
    """The cluster's records in Redis (redis.asyncio), shared by every gateway."""

    def __init__(self, redis_url: str, ttl: float, *, key_prefix: str = "pdserve",
                 timeout: float = REDIS_TIMEOUT) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.ttl = ttl
        self.key_prefix = key_prefix
        self._redis = aioredis.from_url(redis_url, socket_timeout=timeout,
                                        socket_connect_timeout=timeout,
                                        retry=Retry(NoBackoff(), 0))

    def key(self, tenant: str, response_id: str) -> str:
        return f"{self.key_prefix}:response:{tenant}:{response_id}"

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        await self._call(self._redis.set(self.key(tenant, response_id), json.dumps(record),
                                         px=max(1, int(self.ttl * 1000))))

    async def get(self, tenant: str, response_id: str) -> dict | None:
        raw = await self._call(self._redis.get(self.key(tenant, response_id)))
        return None if raw is None else json.loads(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call(self._redis.delete(self.key(tenant, response_id))))

    async def close(self) -> None:
        await self._redis.aclose()

    @staticmethod
    async def _call(awaitable):
        from redis.exceptions import RedisError

        try:
            return await awaitable
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from None


def open_response_store(redis_url: str | None, ttl: float) -> ResponseStore:
    """Redis when the gateway has --redis-url, else this gateway's memory."""
    if redis_url:
        return RedisResponseStore(redis_url, ttl)
    return MemoryResponseStore(ttl)
