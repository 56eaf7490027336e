"""KV transfer between instances: the handle and the chunk codec of paged KV blocks."""

from pdserve.shared.kv_transfer.codec import (
    DEFAULT_MAX_CHUNK_BYTES,
    DTYPES,
    ChunkSpec,
    KVChunkData,
    KVCodecError,
    KVLayout,
    TransferTracker,
    decode_kv_chunk,
    dtype_name,
    encode_kv_blocks,
    plan_chunks,
    write_kv_blocks,
)
from pdserve.shared.kv_transfer.handle import KVHandle

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "DTYPES",
    "ChunkSpec",
    "KVChunkData",
    "KVCodecError",
    "KVHandle",
    "KVLayout",
    "TransferTracker",
    "decode_kv_chunk",
    "dtype_name",
    "encode_kv_blocks",
    "plan_chunks",
    "write_kv_blocks",
]
