"""PrefixIndex: the cluster's view of which instance caches which KV blocks, in Redis.

Keys (`{p}` is the key prefix, "pdserve" by default):

    {p}:instance:{instance_id}   string, JSON InstanceInfo, TTL `ttl` (the heartbeat)
    {p}:instances:{model}        set of instance ids that registered for the model
    {p}:held:{instance_id}       set of 16-byte block hashes the instance holds cached,
                                 in any tier (TTL `ttl`, refreshed by the heartbeat)
    {p}:held_disk:{instance_id}  the subset it holds on its disk tier only, not in its pool
                                 (docs/kv-tiers.md; same TTL): the rest are in memory
    {p}:held_gen:{instance_id}   string, the held set's generation: a new value at every
                                 write of the set (TTL `ttl`), so readers copy a set only
                                 when it changed (`snapshot`)

An instance's own hash map is authoritative; this is the shared, eventually consistent
view. A dead instance's keys expire by themselves. Redis is optional: when it cannot be
reached every method logs it once, returns a fallback at once (no retry storm) and tries
again after an exponential backoff. Torch-free (the gateway imports it).

NOTE: Redis holds a cache, never an answer: nothing here may sit on a request's path. The
gateway reads `snapshot` in the background (services/gateway/registry_view.py) and the
instances write from a task of their own (services/common/monitor.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)
T = TypeVar("T")
_BATCH = 4096

# KEYS[1]: the model's instance set; ARGV[1]: key prefix. Drops ids whose registration expired.
_LIVE_INSTANCES = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local info = redis.call('GET', ARGV[1] .. ':instance:' .. id)
  if info then table.insert(out, info) else redis.call('SREM', KEYS[1], id) end
end
return out
"""

# KEYS[1]: the model's instance set; ARGV[1]: key prefix; ARGV[2..]: block hashes in order.
# Returns {id, n, id, n, ...}: leading hashes each live instance holds (n > 0 only).
_LONGEST_PREFIX = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. ':instance:' .. id) == 1 then
    local held = ARGV[1] .. ':held:' .. id
    local n = 0
    for i = 2, #ARGV do
      if redis.call('SISMEMBER', held, ARGV[i]) == 0 then break end
      n = n + 1
    end
    if n > 0 then table.insert(out, id); table.insert(out, n) end
  end
end
return out
"""

# KEYS[1]: the model's instance set; ARGV[1]: key prefix; ARGV[2..]: instance id, held-set
# generation pairs the caller already holds. Returns {run_id, {info, generation, held}, ...}
# for every live instance; `held` (the whole set) only where the generation differs from
# the caller's or is missing, else false. One atomic read: the run id tells a restart.
_SNAPSHOT = """
local known = {}
for i = 2, #ARGV, 2 do known[ARGV[i]] = ARGV[i + 1] end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
local out = {run_id}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local info = redis.call('GET', ARGV[1] .. ':instance:' .. id)
  if info then
    local gen = redis.call('GET', ARGV[1] .. ':held_gen:' .. id)
    local held = false
    if not gen or known[id] ~= gen then
      held = redis.call('SMEMBERS', ARGV[1] .. ':held:' .. id)
    end
    table.insert(out, {info, gen or '', held})
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """One registered prefill or decode instance, as the gateway routes to it."""

    instance_id: str
    role: str
    """"prefill" | "decode"."""
    address: str
    """host:port of its gRPC server."""
    model: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    block_size: int = 16
    metrics_address: str = ""
    """host:port of its Prometheus endpoint ("" without one); the gateway federates it."""
    kv_block_bytes: int = 0
    """Bytes of one KV block over all layers (K and V): what fetching a block from it
    costs (the peer tier's placement); 0 from an instance that predates it (never a peer)."""
    lora_adapters: tuple[dict, ...] = ()
    """The LoRA adapters it has loaded: {"lora_name", "lora_int_id", "lora_path",
    "base_model_name"} each (services/common/lora.py), so every gateway lists and routes
    them."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> InstanceInfo:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in json.loads(text).items() if k in fields}
        if "lora_adapters" in values:
            values["lora_adapters"] = tuple(values["lora_adapters"])
        return cls(**values)


class ListedInstance(NamedTuple):
    """One live instance in a `RegistrySnapshot`."""

    info: InstanceInfo
    generation: str
    """Its held set's generation ("" when it has none: read the set every time)."""
    held: frozenset[bytes] | None
    """Its held set; None when the caller already holds this generation."""


class RegistrySnapshot(NamedTuple):
    run_id: str
    """The Redis server's run id: a new one means Redis restarted (and lost everything)."""
    instances: list[ListedInstance]


class PrefixIndex:
    """Registration, block-hash publishing and longest-prefix lookups (redis.asyncio).

    Args:
        redis_url: e.g. redis://localhost:6379/0.
        model: the served model name (instances of other models are never returned).
        ttl: seconds a registration (and the held set) lives without a heartbeat.
        key_prefix: prefix of every key.
        socket_timeout: per-command timeout, seconds.
        max_backoff: longest wait between reconnection attempts, seconds.
    """

    def __init__(self, redis_url: str, model: str, *, ttl: float = 10.0,
                 key_prefix: str = "pdserve", socket_timeout: float = 1.0,
                 max_backoff: float = 5.0):
        self.redis_url = redis_url
        self.model = model
        self.ttl = ttl
        self.key_prefix = key_prefix
        self.max_backoff = max_backoff
        self._redis = aioredis.from_url(
            redis_url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0))
        self._live_script = self._redis.register_script(_LIVE_INSTANCES)
        self._prefix_script = self._redis.register_script(_LONGEST_PREFIX)
        self._snapshot_script = self._redis.register_script(_SNAPSHOT)
        self._generation_prefix = os.urandom(6).hex()
        """Unique to this object, so a restarted instance never reuses a generation."""
        self._num_writes = 0
        self.is_up = True
        """False from a connection failure until the next successful command."""
        self._backoff = 0.0
        self._retry_at = 0.0

    # -- keys -------------------------------------------------------------------------------

    def _key(self, kind: str, instance_id: str) -> str:
        """`{p}:{kind}:{instance_id}`, kind instance, held or held_gen (the module's keys)."""
        return f"{self.key_prefix}:{kind}:{instance_id}"

    def _next_generation(self) -> str:
        self._num_writes += 1
        return f"{self._generation_prefix}:{self._num_writes}"

    @property
    def instances_key(self) -> str:
        return f"{self.key_prefix}:instances:{self.model}"

    # -- instance side ----------------------------------------------------------------------

    async def register(self, info: InstanceInfo) -> bool | None:
        """Write (or refresh: this is the heartbeat) the registration of `info`.

        Returns:
            True when no registration was there (first start, Redis restarted, or the TTL
            lapsed): the caller must `republish`. False when refreshed. None when Redis is
            unreachable.
        """
        async def op() -> bool:
            ttl_ms = int(self.ttl * 1000)
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._key("instance", info.instance_id), info.to_json(), px=ttl_ms,
                         get=True)
                pipe.sadd(self.instances_key, info.instance_id)
                pipe.pexpire(self._key("held", info.instance_id), ttl_ms)
                pipe.pexpire(self._key("held_disk", info.instance_id), ttl_ms)
                pipe.pexpire(self._key("held_gen", info.instance_id), ttl_ms)
                previous, *_ = await pipe.execute()
            return previous is None
        return await self._call("register", op, None)

    async def publish(self, instance_id: str, added: Iterable[bytes],
                      removed: Iterable[bytes], on_disk: Iterable[bytes] = ()) -> bool:
        """Apply a batch of cache changes (net effect: a hash is in at most one of `added`
        and `removed`); `on_disk`: the hashes of `added` held on the disk tier only (the
        others are in the pool).

        Returns whether Redis took it; on False the caller republishes later.
        """
        added, removed = list(added), list(removed)
        if not added and not removed:
            return True
        return await self._write_held("publish", instance_id, added, removed, list(on_disk))

    async def republish(self, instance_id: str, block_hashes: Iterable[bytes],
                        on_disk: Iterable[bytes] = ()) -> bool:
        """Replace everything published for `instance_id` with `block_hashes` (atomically),
        `on_disk` of them on the disk tier only."""
        return await self._write_held("republish", instance_id, list(block_hashes), None,
                                      list(on_disk))

    async def _write_held(self, what: str, instance_id: str, added: list[bytes],
                          removed: list[bytes] | None, on_disk: list[bytes]) -> bool:
        """One transaction: drop `removed` (None: the whole set) from the held set, add
        `added`, record which are on disk only, refresh the TTLs and give the set a new
        generation."""
        def batches(hashes: list[bytes]):
            return (hashes[i:i + _BATCH] for i in range(0, len(hashes), _BATCH))

        async def op() -> bool:
            key, ttl_ms = self._key("held", instance_id), int(self.ttl * 1000)
            disk_key = self._key("held_disk", instance_id)
            disk = set(on_disk)
            async with self._redis.pipeline(transaction=True) as pipe:
                if removed is None:
                    pipe.delete(key, disk_key)
                for batch in batches(removed or []):
                    pipe.srem(key, *batch)
                    pipe.srem(disk_key, *batch)
                for batch in batches(added):
                    pipe.sadd(key, *batch)
                if removed is not None:  # hashes back in the pool
                    for batch in batches([h for h in added if h not in disk]):
                        pipe.srem(disk_key, *batch)
                for batch in batches(on_disk):
                    pipe.sadd(disk_key, *batch)
                pipe.pexpire(key, ttl_ms)
                pipe.pexpire(disk_key, ttl_ms)
                pipe.set(self._key("held_gen", instance_id), self._next_generation(), px=ttl_ms)
                await pipe.execute()
            return True
        return bool(await self._call(what, op, False))

    async def unregister(self, instance_id: str) -> bool:
        async def op() -> bool:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._key("instance", instance_id), self._key("held", instance_id),
                            self._key("held_disk", instance_id),
                            self._key("held_gen", instance_id))
                pipe.srem(self.instances_key, instance_id)
                await pipe.execute()
            return True
        return bool(await self._call("unregister", op, False))

    # -- gateway side -----------------------------------------------------------------------

    async def live_instances(self, role: str | None = None) -> list[InstanceInfo]:
        """Registered instances of this model whose heartbeat is current (one round trip)."""
        async def op() -> list[InstanceInfo]:
            raw = await self._live_script(keys=[self.instances_key], args=[self.key_prefix])
            infos = [InstanceInfo.from_json(r) for r in raw]
            return [i for i in infos if role is None or i.role == role]
        return await self._call("live_instances", op, [])

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """instance_id -> how many leading `block_hashes` it holds (one round trip; live
        instances with at least one block only)."""
        if not block_hashes:
            return {}

        async def op() -> dict[str, int]:
            raw = await self._prefix_script(keys=[self.instances_key],
                                            args=[self.key_prefix, *block_hashes])
            return {raw[i].decode(): int(raw[i + 1]) for i in range(0, len(raw), 2)}
        return await self._call("longest_prefix", op, {})

    async def snapshot(self, known: Mapping[str, str] | None = None
                       ) -> RegistrySnapshot | None:
        """Every live instance of this model with its held set, in one atomic round trip
        (the background refresh of services/gateway/registry_view.py); None when Redis is
        unreachable.

        Args:
            known: instance_id -> the held-set generation the caller holds: those sets
                come back as None when unchanged (a set is copied only when it moved).
        """
        args = [self.key_prefix]
        for instance_id, generation in (known or {}).items():
            args += [instance_id, generation]

        async def op() -> RegistrySnapshot:
            raw = await self._snapshot_script(keys=[self.instances_key], args=args)
            return RegistrySnapshot(raw[0].decode(), [
                ListedInstance(InstanceInfo.from_json(info), generation.decode(),
                               None if held is None else frozenset(held))
                for info, generation, held in raw[1:]])
        return await self._call("snapshot", op, None)

    async def held_hashes(self, instance_id: str) -> set[bytes] | None:
        """Everything published for `instance_id` (audits and tests); None when down."""
        async def op() -> set[bytes]:
            return set(await self._redis.smembers(self._key("held", instance_id)))
        return await self._call("held_hashes", op, None)

    async def disk_hashes(self, instance_id: str) -> set[bytes] | None:
        """The published hashes `instance_id` holds on its disk tier only (the rest of
        `held_hashes` are in its pool); None when Redis is down."""
        async def op() -> set[bytes]:
            return set(await self._redis.smembers(self._key("held_disk", instance_id)))
        return await self._call("disk_hashes", op, None)

    async def close(self) -> None:
        await self._redis.aclose()

    # -- failure handling -------------------------------------------------------------------

    async def _call(self, what: str, op: Callable[[], Awaitable[T]], fallback: T) -> T:
        now = time.monotonic()
        if not self.is_up and now < self._retry_at:
            return fallback
        try:
            result = await op()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            if self.is_up:
                logger.warning("Redis at %s is unreachable (%s: %s); serving without the prefix "
                               "index, retrying with backoff", self.redis_url, what, e)
            self.is_up = False
            self._backoff = min(max(self._backoff * 2, 0.1), self.max_backoff)
            self._retry_at = time.monotonic() + self._backoff
            return fallback
        except RedisError as e:
            logger.warning("Redis %s failed: %s", what, e)
            return fallback
        if not self.is_up:
            logger.info("Redis at %s is reachable again", self.redis_url)
            self.is_up = True
        self._backoff = 0.0
        return result
