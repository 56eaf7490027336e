"""KVCacheManager: per-request block lists on top of the BlockPool, with prefix caching.

A request's blocks, in logical order (`block_size` tokens each):

    |<------------------- request.num_tokens (prompt + output) ------------------->|
    | cached prefix hits | computed earlier | computed this step | not yet computed  |
    [ hit  ][ hit  ][ own   ][ own   ][ own   ][ new   ]
                                             ^ only full blocks get a hash and are cached

Per request the manager keeps only its blocks and how many of them it cached (vLLM's
single-type manager: `req_to_blocks`, `num_cached_block`); the block ids are read off the
blocks, and the block hashes are the request's own (`Request.block_hashes`, filled by the
`block_hasher` this manager builds and the engine hands each request). Every block in
`req_to_blocks` but the null block holds one reference of its request: `check_invariants`
counts them against each block's ref_cnt.

With a sliding window on every layer (Mistral), the blocks that fall out of the window as
the request grows are freed and replaced by the null block in its list (vLLM v1's
SlidingWindowManager): the attention kernels never read a block wholly before a query's
window. A freed block that is cached stays findable until evicted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.shared.kv_cache.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from pdserve.shared.kv_cache.prefix_hash import BlockHasher, request_block_hasher
from pdserve.shared.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (monotonic, for Prometheus counters).

    Counted once per admission (a request's first `allocate_slots` since it last held no
    blocks), so a request that waits several steps for blocks is not counted again.
    """

    requests: int = 0
    """Admissions that looked up the cache."""
    queries: int = 0
    """Tokens looked up (the request's num_tokens at admission)."""
    hits: int = 0
    """Tokens found cached."""


class ComputedBlocks(NamedTuple):
    blocks: list[KVCacheBlock]
    """The cached prefix, one block per `block_size` tokens, in logical order."""
    num_computed_tokens: int
    """len(blocks) * block_size."""


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of requests.

    Args:
        num_gpu_blocks: pool size, null block included.
        block_size: tokens per block.
        enable_caching: automatic prefix caching of full blocks.
        model_name: the served model name, an extra key of every first-block hash.
        enable_kv_cache_events: record events for `take_events()` (see BlockPool).
        sliding_window: the window, in tokens, of the model's layers when every layer has
            one (the largest); None (a full-attention layer anywhere): nothing is freed
            before the request ends.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True,
                 model_name: str = "", enable_kv_cache_events: bool = True,
                 quantization: str = "none", sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.quantization = quantization
        """The weights' quantization ("none" | "int8"): an extra key of first-block hashes."""
        self.block_hasher: BlockHasher = request_block_hasher(block_size, model_name,
                                                              quantization)
        """What the engine hands each request to fill its `block_hashes`."""
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, enable_kv_cache_events)
        self.stats = PrefixCacheStats()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        """request_id -> its blocks in logical order; with a sliding window, those out of
        it are the null block (never freed twice: the leading null blocks are skipped)."""
        self.num_cached_block: dict[str, int] = {}
        """request_id -> its leading blocks already passed to cache_full_blocks."""
        self.sliding_window = sliding_window

    # -- prefix lookup ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of `request`'s full blocks. Changes nothing.

        Capped so that the last token is always recomputed (its logits are needed):
        `num_computed_tokens <= request.num_tokens - 1`, a multiple of `block_size`.
        Call it only for a request that holds no blocks (waiting or preempted).
        """
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        block_hashes = request.block_hashes
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(block_hashes))
        blocks = []
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    # -- allocation -------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Give `request` blocks for its next `num_new_tokens` tokens.

            |<- request.num_computed_tokens ->|<- num_new_computed_tokens ->|<- num_new_tokens ->|
            [ blocks already held             ][ new_computed_blocks (hits) ][ fresh blocks      ]

        Touches `new_computed_blocks` (prefix hits from `get_computed_blocks`), appends them,
        then allocates enough fresh blocks to hold all three spans. Unless
        `delay_cache_blocks`, every block that becomes full among known tokens is cached.

        NOTE: caching happens at allocation, before this step writes the KV. A request
        admitted later in the same step may hit those blocks; that is correct because each
        layer stores all of the step's new K/V before attention reads the cache.

        Returns:
            The fresh blocks (possibly empty), or None when the pool lacks them; then
            nothing has changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(f"negative token count: num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}")
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None and self.sliding_window is not None:
            # NOTE: before counting free blocks, so this step can reuse what leaves the window.
            self.remove_skipped_blocks(request, request.num_computed_tokens)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # Hits sitting in the free queue stop counting as free once touched.
        num_free = self.block_pool.get_num_free_blocks()
        num_free -= sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > num_free:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            if self.enable_caching:
                self.stats.requests += 1
                self.stats.queries += request.num_tokens
                self.stats.hits += num_new_computed_tokens
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache `request`'s blocks that are full within its first `num_computed_tokens`.

        The delayed half of `allocate_slots(..., delay_cache_blocks=True)`: call it once the
        KV of those tokens is in place (e.g. written by a KV transfer).
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(blocks),
                       len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full,
                                          request, self.block_size)
        self.num_cached_block[request.request_id] = num_full

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free `request`'s blocks that no layer's window reaches any more: the next query
        (position `num_computed_tokens`) sees keys from num_computed_tokens - W + 1 on, so
        the blocks wholly before that become the null block in its list. A no-op without
        a sliding window; O(blocks freed) per call."""
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_skip = min(self.num_blocks_before_window(num_computed_tokens), len(blocks))
        null = self.block_pool.null_block
        freed = []
        # NOTE: vLLM's walk back from the window: the blocks before the last null are null.
        for i in range(num_skip - 1, -1, -1):
            if blocks[i] is null:
                break
            freed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(freed)

    def num_blocks_before_window(self, num_tokens: int) -> int:
        """The leading blocks that no layer's window reaches from position `num_tokens` (the
        query sees keys from num_tokens - W + 1 on); 0 without a sliding window."""
        if self.sliding_window is None:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def skip_blocks_before_window(self, request: Request, num_tokens: int) -> None:
        """For a request holding no blocks whose first `num_tokens` tokens' KV arrives at
        once (a KV transfer): hold the null block for the leading blocks no window reaches
        from position `num_tokens`, so that only the window's blocks are allocated and
        received. A no-op for a request that holds blocks."""
        num_skip = self.num_blocks_before_window(num_tokens)
        if num_skip and request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = [self.block_pool.null_block] * num_skip

    def trim_blocks(self, request: Request, num_tokens: int) -> None:
        """Free `request`'s blocks past the first cdiv(num_tokens, block_size), last block
        first: the rollback of rejected speculative drafts' slots.

        NOTE: never frees a cached block: blocks are cached only when full of known tokens
        (drafts are not known tokens), and the kept count is at least the cached one.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_keep = max(-(-num_tokens // self.block_size),
                       self.num_cached_block.get(request.request_id, 0))
        if len(blocks) <= num_keep:
            return
        tail = blocks[num_keep:]
        del blocks[num_keep:]
        self.block_pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Release all of `request`'s blocks and forget it. A no-op if it holds none.

        Blocks are freed last block first, so the tail of a sequence is evicted before its
        prefix (the prefix is the part other requests are likely to share).
        """
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            null = self.block_pool.null_block
            self.block_pool.free_blocks(block for block in reversed(blocks) if block is not null)

    # -- queries ----------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's physical block ids in logical order (a new list; [] if it holds
        none; 0, the null block, for blocks out of a sliding window)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """The pool's invariants, plus: each block's ref_cnt equals the number of requests
        holding it, and only leading blocks out of a sliding window are the null block.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        self.block_pool.check_invariants()
        null = self.block_pool.null_block
        holders: Counter[int] = Counter()
        for request_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_block.get(request_id, 0)
            assert num_cached <= len(blocks), f"{request_id}: more blocks cached than held"
            num_null = next((i for i, b in enumerate(blocks) if b is not null), len(blocks)) \
                if self.sliding_window is not None else 0  # leading: out of the window
            for i, block in enumerate(blocks[num_null:], num_null):
                assert block is not null, f"{request_id} holds block 0 at index {i}"
                holders[block.block_id] += 1
        assert set(self.num_cached_block) <= set(self.req_to_blocks), "stale cached counts"
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, " \
                f"held by {holders[block.block_id]} requests"
