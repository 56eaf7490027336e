"""Pure-Python KV block bookkeeping: prefix hashes, the block pool, the per-request manager."""

from shared.kv_cache.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheEvent,
)
from shared.kv_cache.kv_cache_manager import ComputedBlocks, KVCacheManager, PrefixCacheStats
from shared.kv_cache.prefix_hash import (
    NONE_HASH,
    BlockHash,
    block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ComputedBlocks",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "NONE_HASH",
    "PrefixCacheStats",
    "block_extra_keys",
    "hash_block_tokens",
    "hash_request_tokens",
]
