"""KV codec: paged KV blocks <-> raw chunks of at most `max_chunk_bytes` (torch-only, no gRPC).

One chunk holds some of a request's blocks, for a run of layers, K and V:

    kv_caches[layer] = (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]

    chunk.data = bytes of a C-contiguous tensor
        [num_layers_in_chunk, 2 (K, V), len(block_indices), block_size, num_kv_heads, head_dim]
         ^ layers layer_start ...        ^ block_indices[j] = position in the request's blocks

    prefill block_ids:  [ 41 ][ 7 ][ 13 ][ 90 ][ 91 ][ 5 ][ 2 ]      (its own: never sent)
    block_indices:                [2,   3,    4]        [5,  6]      (two chunks, all layers)
    decode block_ids:   [ 11 ][ 12][ 30 ][ 31 ][ 32 ][ 8 ][ 9 ]      (written at the same indices)

Normally a chunk carries `max_chunk_bytes // bytes_per_block` whole blocks (all layers); only
when a single block over all layers exceeds the limit is it split by layers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from pdserve.shared.config import DEFAULT_MAX_CHUNK_BYTES  # re-exported: the per-chunk payload cap

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class KVLayout(NamedTuple):
    """The geometry both ends must agree on before any byte moves."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """"float32" | "bfloat16" | "float16"."""

    @classmethod
    def of(cls, kv_caches: KVCaches) -> KVLayout:
        k_cache = kv_caches[0][0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        return cls(len(kv_caches), block_size, num_kv_heads, head_dim, dtype_name(k_cache.dtype))

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def bytes_per_block_layer(self) -> int:
        """One block of one layer, K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """One block over all layers, K and V."""
        return self.num_layers * self.bytes_per_block_layer

    def chunk_shape(self, num_layers: int, num_blocks: int) -> tuple[int, ...]:
        return (num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class ChunkSpec(NamedTuple):
    """Which part of a transfer one chunk carries."""

    positions: range
    """Positions in the transfer's list of block indices."""
    layer_start: int
    num_layers: int


class KVChunkData(NamedTuple):
    """A chunk as it travels (mirrors the proto KVChunk)."""

    block_indices: list[int]
    layer_start: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes


class KVCodecError(ValueError):
    """A chunk that does not fit the transfer (wrong dtype, shape, length, indices...)."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise KVCodecError(f"unsupported KV dtype {dtype}")


def plan_chunks(num_blocks: int, layout: KVLayout,
                max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[ChunkSpec]:
    """Split `num_blocks` blocks into chunks of at most `max_chunk_bytes` of data each.

    Raises:
        KVCodecError: not even one layer of one block fits in `max_chunk_bytes`.
    """
    blocks_per_chunk = max_chunk_bytes // layout.bytes_per_block
    if blocks_per_chunk >= 1:
        return [ChunkSpec(range(i, min(i + blocks_per_chunk, num_blocks)), 0, layout.num_layers)
                for i in range(0, num_blocks, blocks_per_chunk)]
    layers_per_chunk = max_chunk_bytes // layout.bytes_per_block_layer
    if layers_per_chunk < 1:
        raise KVCodecError(f"max_chunk_bytes={max_chunk_bytes} cannot hold one layer of one "
                           f"block ({layout.bytes_per_block_layer} bytes)")
    return [ChunkSpec(range(i, i + 1), start, min(layers_per_chunk, layout.num_layers - start))
            for i in range(num_blocks)
            for start in range(0, layout.num_layers, layers_per_chunk)]


def encode_kv_blocks(kv_caches: KVCaches, block_ids: Sequence[int], block_indices: Sequence[int],
                     max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Iterator[KVChunkData]:
    """Yield the KV of `block_indices` (positions in `block_ids`) as chunks, lazily.

    Each chunk is gathered when the iterator reaches it, so a caller that streams it holds
    one chunk in memory at a time. The blocks must stay allocated meanwhile.
    """
    layout = KVLayout.of(kv_caches)
    device = kv_caches[0][0].device
    for spec in plan_chunks(len(block_indices), layout, max_chunk_bytes):
        indices = [block_indices[p] for p in spec.positions]
        src = torch.tensor([block_ids[i] for i in indices], dtype=torch.long, device=device)
        shape = layout.chunk_shape(spec.num_layers, len(indices))
        buf = torch.empty(shape, dtype=DTYPES[layout.dtype], device=device)
        for j in range(spec.num_layers):
            k_cache, v_cache = kv_caches[spec.layer_start + j]
            torch.index_select(k_cache, 0, src, out=buf[j, 0])
            torch.index_select(v_cache, 0, src, out=buf[j, 1])
        data = buf.cpu().view(torch.uint8).numpy().tobytes()
        yield KVChunkData(indices, spec.layer_start, layout.dtype, shape, data)


def decode_kv_chunk(chunk: KVChunkData, layout: KVLayout) -> torch.Tensor:
    """Check a chunk against `layout` (the handle's, which the receiver checked equals its
    own); return its data as a tensor view `[num_layers, 2, n, block_size, H, D]` (no copy).

    Raises:
        KVCodecError: naming the field that disagrees: dtype, no or repeated block indices,
            layer range outside [0, num_layers), shape, or byte length.
    """
    if chunk.dtype != layout.dtype:
        raise KVCodecError(f"chunk dtype is {chunk.dtype!r}, expected {layout.dtype!r}")
    n = len(chunk.block_indices)
    if n == 0:
        raise KVCodecError("chunk has no block_indices")
    if len(set(chunk.block_indices)) != n:
        raise KVCodecError(f"chunk repeats a block index within itself: {chunk.block_indices}")
    num_layers = chunk.shape[0] if chunk.shape else 0
    if chunk.layer_start < 0 or num_layers < 1 \
            or chunk.layer_start + num_layers > layout.num_layers:
        raise KVCodecError(f"chunk layers [{chunk.layer_start}, {chunk.layer_start + num_layers})"
                           f" are outside [0, {layout.num_layers})")
    expected = layout.chunk_shape(num_layers, n)
    if tuple(chunk.shape) != expected:
        raise KVCodecError(f"chunk shape is {list(chunk.shape)}, expected {list(expected)}")
    num_bytes = math.prod(expected) * layout.itemsize
    if len(chunk.data) != num_bytes:
        raise KVCodecError(f"chunk data has {len(chunk.data)} bytes, shape {list(expected)} "
                           f"needs {num_bytes}")
    with warnings.catch_warnings():  # an immutable `bytes`: we only ever read from it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(chunk.data, dtype=torch.uint8)
    return raw.view(DTYPES[layout.dtype]).view(expected)


def write_kv_blocks(kv_caches: KVCaches, dst_block_ids: Sequence[int], layer_start: int,
                    data: torch.Tensor) -> None:
    """Write a decoded chunk `[num_layers, 2, n, block_size, H, D]` into blocks `dst_block_ids`.

    NOTE: the destination blocks must be held by a request nobody else runs yet (allocated
    for the transfer, not yet cached): nothing else reads or writes them meanwhile.
    """
    device = kv_caches[0][0].device
    dst = _to_device(torch.tensor(list(dst_block_ids), dtype=torch.long), device)
    data = _to_device(data, device)
    for j in range(data.shape[0]):
        k_cache, v_cache = kv_caches[layer_start + j]
        k_cache.index_copy_(0, dst, data[j, 0])
        v_cache.index_copy_(0, dst, data[j, 1])


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, without waiting for the device.

    NOTE: a copy to a GPU from pageable memory (a `bytes` buffer, a fresh tensor) waits for
    the stream's queued work, i.e. for the engine thread's step in flight, and this runs on
    the service's event loop. From pinned memory it is queued like a kernel; the stream
    orders it before the next step that reads the blocks, and the pinned buffer is kept
    until the copy is done (torch's caching host allocator).
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TransferTracker:
    """Which (block index, layer) pairs of a transfer have arrived; rejects strays.

    Args:
        layout: the receiving instance's KV layout.
        block_indices: the indices asked for (positions in the request's block list).
    """

    def __init__(self, layout: KVLayout, block_indices: Sequence[int]):
        self.layout = layout
        self._received: dict[int, list[bool]] = {
            i: [False] * layout.num_layers for i in block_indices}
        if len(self._received) != len(block_indices):
            raise KVCodecError("block_indices has duplicates")
        self.num_bytes = 0

    def accept(self, chunk: KVChunkData) -> torch.Tensor:
        """Validate `chunk` and mark it received; returns its data (see decode_kv_chunk).

        Raises:
            KVCodecError: a block index not asked for, or a part that already arrived.
        """
        data = decode_kv_chunk(chunk, self.layout)
        layers = range(chunk.layer_start, chunk.layer_start + data.shape[0])
        for i in chunk.block_indices:
            flags = self._received.get(i)
            if flags is None:
                raise KVCodecError(f"chunk carries block index {i}, which was not requested")
            if any(flags[layer] for layer in layers):
                raise KVCodecError(f"chunk repeats block index {i}")
        for i in chunk.block_indices:
            for layer in layers:
                self._received[i][layer] = True
        self.num_bytes += len(chunk.data)
        return data

    @property
    def num_missing_blocks(self) -> int:
        return sum(1 for flags in self._received.values() if not all(flags))

    @property
    def complete(self) -> bool:
        return self.num_missing_blocks == 0
