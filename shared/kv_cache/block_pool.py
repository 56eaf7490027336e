"""BlockPool: every KV block, the LRU free-block queue and the block-hash map (torch-free).

    blocks:       [0: null] [1] [2] [3] ... [num_gpu_blocks - 1]
    free queue:   head -> b7 -> b3 -> b9 -> ... -> tail     (ref_cnt == 0, eviction order)
    hash map:     block_hash -> block, for cached (full, hashed) blocks, free or in use

A free block may still be cached: it stays findable by its hash until `get_new_blocks`
pops it from the head of the queue and evicts it (drops its hash). `touch` revives it.

With `track_changes(True)` the pool also records the ids of the blocks whose ref_cnt or
hash changed (`take_changed_block_ids`), for the state feed's deltas (services/common/
state_feed.py): a live block map then costs O(changed blocks) per frame, not O(pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from pdserve.shared.kv_cache.prefix_hash import BlockHash

if TYPE_CHECKING:
    from pdserve.shared.request import Request

MEDIUM_MEMORY = "GPU"
"""The medium of the engine's own pool in KV events: vLLM's `MEDIUM_GPU`, which vLLM's CPU
build reports for its pool too, so routers that read vLLM's events read pdserve's."""
MEDIUM_DISK = "STORAGE"
"""The medium of the local disk tier (shared/kv_cache/disk_store.py): vLLM's `MEDIUM_STORAGE`."""


class BlockStored(NamedTuple):
    """Blocks with these hashes became cached in this pool: vLLM's `BlockStored` fields.

    `block_hashes` are consecutive blocks of one request (a chain): `token_ids` holds
    exactly their tokens, `block_size` per block, and `parent_block_hash` is the hash of
    the block before the first (None: the first is the request's first block).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: Sequence[int] = ()
    """len(block_hashes) * block_size token ids; () when the pool was not given them."""
    block_size: int = 0
    lora_id: int | None = None
    """The request's LoRA adapter id (`lora_int_id`); None: the base model."""
    medium: str = MEDIUM_MEMORY
    lora_name: str | None = None


class BlockRemoved(NamedTuple):
    """Blocks with these hashes were evicted from this pool (`medium`)."""

    block_hashes: list[BlockHash]
    medium: str = MEDIUM_MEMORY


class AllBlocksCleared(NamedTuple):
    """The whole prefix cache of `medium` was dropped.

    `block_hashes` (every hash it held) is for in-process consumers (the Redis index's
    net changes); vLLM's wire event carries no fields, so the publisher leaves it off.
    """

    block_hashes: list[BlockHash]
    medium: str = MEDIUM_MEMORY


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: BlockHash | None = None):
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        """Requests holding this block; 0 means it sits in the free queue."""
        self.block_hash = block_hash
        """Set while the block is cached (full and in the hash map); None otherwise."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is evicted first.

    Freed blocks are appended at the tail, so the least recently freed block is evicted
    first (LRU). A block hit by the prefix cache is unlinked from the middle in O(1).
    Sentinel head/tail nodes keep every operation branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (evicted first) to tail. O(n): tests and checks only."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of one instance: allocation, ref counts, LRU eviction, the hash map.

    Args:
        num_gpu_blocks: pool size, null block included (so `num_gpu_blocks - 1` usable).
        enable_caching: keep full blocks findable by hash after they are freed.
        enable_kv_cache_events: record cache add/evict events for `take_events()`. Pass
            False when nothing drains them, or the event list grows without bound.

    NOTE: the hash map is one-to-one. When a block fills up with a hash that another block
    already holds (two requests computed the same prefix at once), the second block is
    left uncached rather than de-duplicated: a request's block ids never change once
    handed out, so its block table stays append-only. It is freed as a plain block.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool,
                 enable_kv_cache_events: bool = True):
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is the null block), "
                             f"got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        """Block 0: a placeholder for padding; never handed out, never in the free queue."""
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []
        self._changed: set[int] | None = None
        """Ids of blocks whose ref_cnt or hash changed since the last take (tracking on)."""
        self.on_evict: Callable[[list[int], list[BlockHash]], None] | None = None
        """Called with (block_ids, block_hashes) of cached blocks `get_new_blocks` evicts,
        before it returns them for reuse (the disk tier copies their KV out here)."""

    # -- allocation -------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, each with ref_cnt 1.

        A popped block that was still cached is evicted (its hash dropped).

        Raises:
            ValueError: when fewer than `num_blocks` blocks are free (nothing changes).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, only "
                             f"{self.free_block_queue.num_free_blocks} left")
        evicted: list[BlockHash] = []
        evicted_ids: list[int] = []
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                evicted.append(block.block_hash)
                evicted_ids.append(block.block_id)
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted_ids, evicted)
        if evicted and self.enable_kv_cache_events:
            self._events.append(BlockRemoved(evicted, MEDIUM_MEMORY))
        if self._changed is not None:
            self._changed.update(block.block_id for block in blocks)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The cached block holding `block_hash` (free or in use), or None on a miss."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt += 1 for each block; a free (ref_cnt 0) block leaves the free queue."""
        changed = self._changed
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if changed is not None:
                changed.add(block.block_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1 for each block; one reaching 0 goes to the tail of the free queue.

        Args:
            ordered_blocks: in eviction priority, the first to be evicted first.
        """
        changed = self._changed
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
            if changed is not None:
                changed.add(block.block_id)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int,
                          request: Request | None = None, block_size: int = 0) -> None:
        """Make `blocks[num_cached_blocks:num_full_blocks]` findable by their hashes.

        Args:
            blocks: one request's blocks in logical order.
            block_hashes: that request's chained block hashes, at least `num_full_blocks`.
            num_cached_blocks: leading blocks already handled by an earlier call.
            num_full_blocks: leading blocks that are now full.
            request: the request the blocks belong to, with `block_size`: the events then
                carry its token ids and LoRA adapter (read only while events are on).

        Blocks that already carry a hash (prefix-cache hits) and blocks whose hash another
        block already holds are skipped (see the class NOTE). With events on, each run of
        consecutive newly cached blocks is one `BlockStored`, so that its `token_ids` are
        exactly those blocks' tokens.
        """
        if not self.enable_caching:
            return
        stored: list[int] = []  # indices into `blocks` of the blocks cached now, ascending
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                continue  # a hit, or out of a sliding window (freed)
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            stored.append(i)
            if self._changed is not None:
                self._changed.add(block.block_id)
        if stored and self.enable_kv_cache_events:
            self._record_stored(stored, block_hashes, request, block_size)

    def _record_stored(self, stored: list[int], block_hashes: Sequence[BlockHash],
                       request: Request | None, block_size: int) -> None:
        """One `BlockStored` per run of consecutive indices in `stored`."""
        lora = request.lora_request if request is not None else None
        start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[start], stored[k - 1]
            token_ids = request.token_slice(first * block_size, (last + 1) * block_size) \
                if request is not None else ()
            self._events.append(BlockStored(
                [block_hashes[i] for i in range(first, last + 1)],
                block_hashes[first - 1] if first > 0 else None, token_ids, block_size,
                lora.lora_int_id if lora is not None else None, MEDIUM_MEMORY,
                lora.lora_name if lora is not None else None))
            start = k

    # -- queries ----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue, cached ones included (they can be evicted)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (null block excluded) held by requests, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_gpu_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def track_changes(self, on: bool) -> None:
        """Start (anew, forgetting earlier changes) or stop recording changed block ids."""
        self._changed = set() if on else None

    def take_changed_block_ids(self) -> list[int]:
        """Ids of the blocks whose ref_cnt or hash changed since the last call (or since
        tracking started), ascending; [] while tracking is off."""
        if self._changed is None:
            return []
        changed, self._changed = self._changed, set()
        return sorted(changed)

    def take_events(self) -> list[KVCacheEvent]:
        """The cache add / evict events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Only when no block is in use; returns whether it did."""
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        cleared = list(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            if self._changed is not None:
                self._changed.add(block.block_id)
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared(cleared))
        return True

    def check_invariants(self) -> None:
        """Check the pool's bookkeeping. O(num_gpu_blocks): for tests and debugging.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None, f"null block touched: {null}"
        assert null.prev_free_block is None and null.next_free_block is None, \
            "null block is in the free queue"
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, \
            f"free queue holds {len(free)} blocks, counter says " \
            f"{self.free_block_queue.num_free_blocks}"
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        prev = self.free_block_queue._head
        for block in free:
            assert block.prev_free_block is prev, f"broken back link at {block}"
            assert block.ref_cnt == 0, f"free block with ref_cnt != 0: {block}"
            prev = block
        num_in_use = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"negative ref_cnt: {block}"
            if block.ref_cnt > 0:
                num_in_use += 1
                assert block.block_id not in free_ids, f"in-use block in free queue: {block}"
            else:
                assert block.block_id in free_ids, f"ref_cnt 0 block not in free queue: {block}"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"hashed block missing from the hash map: {block}"
        assert len(free) + num_in_use == self.num_gpu_blocks - 1, \
            f"free ({len(free)}) + in use ({num_in_use}) != {self.num_gpu_blocks - 1}"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"hash map entry disagrees with {block}"
        if not self.enable_caching:
            assert not self.cached_block_hash_to_block, "caching disabled, but blocks cached"
