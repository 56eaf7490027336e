"""Placement: which prefill and decode instance serve a request (cache-aware, then least loaded).

A request under a LoRA adapter is placed among the instances that have it loaded
(`prefer`, services/gateway/lora.py; all of them when none has) and its prompt hashes under
the adapter, as the engines hash its blocks (`request_extra_keys`).

Candidates come from the live registry (the gateway's `registry_view.RegistryView`, a
copy of the Redis index refreshed in the background each second, so no request waits on
Redis; or any object with the same two methods), asked for every placement: instances that
register are placed on from then on, expired ones no more. While Redis is unreachable the
view keeps what it last saw (the health checks still weed it; a registry that answers
nothing while its `is_up` is False gets its last answer kept here); with no instance there,
the static `--prefill-url` / `--decode-url` lists. Per docs/services-contracts.md:

1. score each candidate by the number of leading prompt blocks it holds cached (looked up
   in the view's copy of each instance's held set), highest first; a hit counts only
   when it covers MIN_CACHED_FRACTION of the prompt (as SGLang's router's cache_threshold):
   a short prefix every prompt shares (a chat template's system prompt) must not pull all
   traffic onto the instance that happened to cache it first, or an instance that joins
   would never be placed on;
2. break ties by load: the instance's `num_running + num_waiting` plus the requests this
   gateway has in flight there;
3. the peer tier: when another instance (either role) holds more leading blocks than the
   instance that will compute the prompt and fetching them beats computing them
   (`peer_tier.choose_peer`), the placement names it (`Placement.peer`);
4. if the prompt's part not cached on the chosen decode instance is shorter than
   `local_prefill_threshold` tokens (or no prefill instance exists), skip the prefill
   instance: the decode instance prefills locally (conditional disaggregation); so it does
   when this gateway already has `max_prefill_queue_size` prefills in flight at the chosen
   prefill instance (load: NVIDIA Dynamo's rule; a queued remote prefill would start later
   than a local one, and its KV still has to travel).

With a health view (`services.gateway.health.HealthTracker`), instances known NOT_SERVING or
unreachable are skipped; when that leaves no decode instance, the skipped ones are checked
live (at most HEALTH_RECHECK_BOUND s) before placement gives up. `avoid` (the instances that
already failed this request) is a preference for decode (used if nothing else is left) and
a hard exclusion for prefill (the decode instance can always prefill itself).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from pdserve.services.gateway.in_flight import InFlight
from pdserve.services.gateway.peer_tier import Holder, PeerFetchCost, PeerKV, choose_peer
from pdserve.shared.kv_cache.prefix_hash import ExtraKey, block_extra_keys, hash_request_tokens
from pdserve.shared.lora.request import LoRARequest

logger = logging.getLogger(__name__)

HEALTH_RECHECK_BOUND = 1.0
"""Seconds placement waits for live health checks when no decode instance is usable."""
MIN_CACHED_FRACTION = 0.5
"""A cached prefix shorter than this fraction of the prompt counts as no hit (load decides)."""


class InstanceRegistry(Protocol):
    """What placement needs from the prefix index (services/common/prefix_index.PrefixIndex)."""

    async def live_instances(self, role: str | None = None) -> list[Any]:
        """Instances with `instance_id`, `role`, `address`, `num_running`, `num_waiting`."""
        ...

    async def longest_prefix(self, block_hashes: list[bytes]) -> dict[str, int]:
        """instance_id -> number of leading blocks of `block_hashes` it holds."""
        ...


class HealthView(Protocol):
    """What placement needs from pdserve.services.gateway.health.HealthTracker."""

    def is_usable(self, address: str) -> bool:
        ...

    async def refresh(self, addresses: Iterable[str], bound: float) -> None:
        ...


class Candidate(NamedTuple):
    address: str
    instance_id: str
    load: int
    num_cached_blocks: int
    kv_block_bytes: int = 0


class Placement(NamedTuple):
    prefill_address: str | None
    """None: the decode instance prefills the prompt itself."""
    decode_address: str
    peer: PeerKV | None = None
    """An instance (either role) holding more of the prompt than the one that computes it,
    worth fetching from (services/gateway/peer_tier.py); None: compute what is not cached."""


class PromptHashes:
    """One prompt's block hashes for placement, computed once per HTTP request: every choice
    (n > 1) and every retry reads the same list (docs/lifecycle.md, "Hashing")."""

    __slots__ = ("token_ids", "_key", "_hashes")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._key: tuple | None = None
        self._hashes: list[bytes] = []

    def get(self, block_size: int, extra_keys: tuple[ExtraKey, ...]) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (len(token_ids) // block_size of
        them, 32 bytes each) under the first block's `extra_keys`, as the engines hash them
        (shared/kv_cache/prefix_hash.py); computed on the first call for that key."""
        key = (block_size, extra_keys)
        if key != self._key:
            self._hashes = hash_request_tokens(self.token_ids, block_size, extra_keys)
            self._key = key
        return self._hashes


class Placer:
    def __init__(self, prefill_urls: Sequence[str] = (), decode_urls: Sequence[str] = (),
                 registry: InstanceRegistry | None = None, local_prefill_threshold: int = 0,
                 health: HealthView | None = None, max_prefill_queue_size: int = 0,
                 in_flight: InFlight | None = None, peer_cost: PeerFetchCost | None = None):
        self.prefill_urls = tuple(prefill_urls)
        self.health = health
        self.decode_urls = tuple(decode_urls)
        self.registry = registry
        self.local_prefill_threshold = local_prefill_threshold
        self.max_prefill_queue_size = max_prefill_queue_size
        self.num_local_by_load = 0
        """Prompts prefilled on their decode instance because the prefill queue was full."""
        self.in_flight = InFlight() if in_flight is None else in_flight
        """Engine calls this gateway has in flight per address (shared with the channel
        pool: services/gateway/in_flight.py)."""
        self._last_live: dict[str, list[Any]] = {}
        self._registry_warned = False
        self.peer_cost = PeerFetchCost() if peer_cost is None else peer_cost
        """The peer tier's rule (prefill_rate 0: off)."""
        self.num_peer_hints = 0
        """Placements that named a peer to fetch a prefix from."""

    async def _live(self, role: str) -> list[Any]:
        """Live instances of `role` (the RegistryView answers from memory); while the
        registry is down (`is_up` False) and answers nothing, its last answer."""
        if self.registry is None:
            return []
        try:
            live = [i for i in await self.registry.live_instances(role) if i.role == role]
            self._registry_warned = False
        except Exception as e:  # the registry is optional: fall back to the static lists
            if not self._registry_warned:
                logger.warning("registry unavailable (%s); using static instance lists", e)
                self._registry_warned = True
            live = []
        last = self._last_live.get(role)
        if not live and getattr(self.registry, "is_up", True) is False and last is not None:
            return last  # Redis is down (it answered nothing): keep the last view
        self._last_live[role] = live
        return live

    async def addresses(self, role: str) -> list[str]:
        """Every known instance of `role` (registry first, then the static list)."""
        live = [i.address for i in await self._live(role)]
        static = self.prefill_urls if role == "prefill" else self.decode_urls
        return list(dict.fromkeys(live + list(static)))

    async def _candidates(self, role: str, cached: dict[str, int]) -> list[Candidate]:
        live = await self._live(role)
        if live:
            return [Candidate(i.address, i.instance_id,
                              int(i.num_running) + int(i.num_waiting) + self.in_flight[i.address],
                              cached.get(i.instance_id, 0),
                              int(getattr(i, "kv_block_bytes", 0) or 0)) for i in live]
        static = self.prefill_urls if role == "prefill" else self.decode_urls
        return [Candidate(a, a, self.in_flight[a], 0) for a in static]

    def _usable(self, candidates: list[Candidate]) -> list[Candidate]:
        if self.health is None:
            return candidates
        return [c for c in candidates if self.health.is_usable(c.address)]

    async def _usable_rechecked(self, role: str, cached: dict[str, int]) -> list[Candidate]:
        """The usable candidates of `role`; when none is, every one is checked live first."""
        everything = await self._candidates(role, cached)
        usable = self._usable(everything)
        if not usable and everything and self.health is not None:
            await self.health.refresh([c.address for c in everything], HEALTH_RECHECK_BOUND)
            usable = self._usable(everything)
        return usable

    @staticmethod
    def _best(candidates: list[Candidate], num_tokens: int, block_size: int) -> Candidate | None:
        # Most cached blocks (at least MIN_CACHED_FRACTION of the prompt's) first, then least
        # load; stable on the list order otherwise.
        min_cached_blocks = max(1, math.ceil(MIN_CACHED_FRACTION * num_tokens / block_size))
        return min(candidates, default=None, key=lambda c: (
            -c.num_cached_blocks if c.num_cached_blocks >= min_cached_blocks else 0, c.load))

    async def _cached_blocks(self, prompt: PromptHashes, model_name: str,
                             cache_salt: str | None, block_size: int,
                             quantization: str = "none",
                             lora_request: LoRARequest | None = None) -> dict[str, int]:
        if self.registry is None or len(prompt.token_ids) < block_size:
            return {}
        hashes = prompt.get(block_size, request_extra_keys(
            model_name, cache_salt, quantization, lora_request))
        try:
            return dict(await self.registry.longest_prefix(hashes))
        except Exception as e:  # no affinity without the index, but still serve
            logger.warning("prefix lookup in the registry failed (%r): placing by load", e)
            return {}

    async def place(self, prompt_token_ids: Sequence[int], *, model_name: str,
                    block_size: int, cache_salt: str | None = None,
                    avoid: Collection[str] = (), local_prefill: bool = False,
                    quantization: str = "none", lora_request: LoRARequest | None = None,
                    prefer: Collection[str] | None = None,
                    prompt_hashes: PromptHashes | None = None) -> Placement | None:
        """Pick the instances for one engine request; None when no decode instance exists
        (or none is usable). `local_prefill`: always let the decode instance prefill.
        `lora_request`: the request's adapter (its blocks hash under it); `prefer`: the
        instances that have it loaded: the decode is one of them if any is usable, and so is
        the prefill, else the decode prefills itself. `prompt_hashes`: the prompt's hashes
        shared by every choice and retry of its HTTP request (None: hashed here)."""
        cached = await self._cached_blocks(prompt_hashes or PromptHashes(prompt_token_ids),
                                           model_name, cache_salt, block_size,
                                           quantization, lora_request)
        usable = await self._usable_rechecked("decode", cached)
        candidates = _preferred([c for c in usable if c.address not in avoid] or usable, prefer)
        decode = self._best(candidates, len(prompt_token_ids), block_size)
        logger.debug("placement: cached blocks %s, decode candidates %s -> %s", cached,
                     candidates, decode)
        if decode is None:
            return None
        prefills = [c for c in self._usable(await self._candidates("prefill", cached))
                    if c.address not in avoid]
        if local_prefill:
            return self._with_peer(Placement(None, decode.address), decode, usable + prefills,
                                   avoid, block_size)
        uncached = len(prompt_token_ids) - decode.num_cached_blocks * block_size
        prefill = self._best([c for c in prefills if prefer is None or c.address in prefer],
                             len(prompt_token_ids), block_size)
        if prefill is None or uncached < self.local_prefill_threshold:
            placement, computing = Placement(None, decode.address), decode
        elif self.max_prefill_queue_size and \
                self.in_flight[prefill.address] >= self.max_prefill_queue_size:
            self.num_local_by_load += 1
            placement, computing = Placement(None, decode.address), decode
        else:
            placement, computing = Placement(prefill.address, decode.address), prefill
        return self._with_peer(placement, computing, usable + prefills, avoid, block_size)

    def _with_peer(self, placement: Placement, computing: Candidate,
                   holders: list[Candidate], avoid: Collection[str],
                   block_size: int) -> Placement:
        """`placement` with the peer tier's hint for the instance that computes the prompt
        (peer_tier.choose_peer); instances this request failed on are never asked."""
        peer = choose_peer((Holder(c.address, c.num_cached_blocks, c.kv_block_bytes)
                            for c in holders if c.address not in avoid),
                           computing.address, computing.num_cached_blocks, block_size,
                           self.peer_cost)
        if peer is None:
            return placement
        self.num_peer_hints += 1
        return placement._replace(peer=peer)

    async def place_prefill(self, prompt_token_ids: Sequence[int], *, model_name: str,
                            block_size: int, cache_salt: str | None = None,
                            avoid: Collection[str] = (), quantization: str = "none",
                            prompt_hashes: PromptHashes | None = None) -> str | None:
        """The prefill instance for a prefill-only request (a pooling model's): the most
        cached blocks, then least loaded, as `place`; None when none is usable."""
        cached = await self._cached_blocks(prompt_hashes or PromptHashes(prompt_token_ids),
                                           model_name, cache_salt, block_size,
                                           quantization)
        usable = await self._usable_rechecked("prefill", cached)
        best = self._best([c for c in usable if c.address not in avoid],
                          len(prompt_token_ids), block_size)
        return None if best is None else best.address


def _preferred(candidates: list[Candidate], prefer: Collection[str] | None) -> list[Candidate]:
    """The candidates in `prefer` (all of them when `prefer` is None or none is in it)."""
    if prefer is None:
        return candidates
    return [c for c in candidates if c.address in prefer] or candidates


def request_extra_keys(model_name: str, cache_salt: str | None, quantization: str,
                       lora_request: LoRARequest | None) -> tuple[ExtraKey, ...]:
    """The first block's extra keys as the engines hash them (the KV cache manager's): an
    adapter's blocks hash apart from the base model's and every other adapter's."""
    return block_extra_keys(model_name, cache_salt, quantization,
                            lora_name=None if lora_request is None else lora_request.lora_name)
