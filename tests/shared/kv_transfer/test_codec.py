"""KV codec: blocks -> chunks -> blocks is exact for every dtype and shape, chunks stay under
the message limit, and a chunk that does not fit the transfer is refused."""

from __future__ import annotations

import pytest
import torch

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.kv_transfer.codec import (
    DEFAULT_MAX_CHUNK_BYTES,
    KVChunkData,
    KVCodecError,
    KVLayout,
    TransferTracker,
    encode_kv_blocks,
    plan_chunks,
    write_kv_blocks,
)

# (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
SHAPES = [(1, 8, 4, 1, 8), (3, 20, 16, 3, 64), (4, 12, 8, 2, 32), (2, 6, 32, 4, 16)]


def _caches(num_layers, num_blocks, block_size, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(num_layers)]


def _transfer(src, src_ids, dst, dst_ids, max_chunk_bytes):
    """Send every index of src_ids, as the two services do; returns the chunks."""
    layout = KVLayout.of(dst)
    indices = list(range(len(src_ids)))
    tracker = TransferTracker(layout, indices)
    chunks = list(encode_kv_blocks(src, src_ids, indices, max_chunk_bytes))
    for chunk in chunks:
        data = tracker.accept(chunk)
        write_kv_blocks(dst, [dst_ids[i] for i in chunk.block_indices], chunk.layer_start, data)
    assert tracker.complete
    return chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_exact(dtype, shape):
    num_layers, num_blocks, block_size, heads, head_dim = shape
    src = _caches(*shape, dtype)
    dst = _caches(*shape, dtype, seed=1)
    g = torch.Generator().manual_seed(num_blocks)
    k = min(5, num_blocks - 1)  # distinct, shuffled, never block 0
    src_ids = (torch.randperm(num_blocks - 1, generator=g)[:k] + 1).tolist()
    dst_ids = (torch.randperm(num_blocks - 1, generator=g)[:k] + 1).tolist()
    per_block = KVLayout.of(src).bytes_per_block
    chunks = _transfer(src, src_ids, dst, dst_ids, max_chunk_bytes=2 * per_block + 1)
    assert len(chunks) == -(-len(src_ids) // 2)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[dst_ids], sk[src_ids]) and torch.equal(dv[dst_ids], sv[src_ids])


def test_a_block_larger_than_the_limit_is_split_by_layers():
    src = _caches(5, 6, 16, 2, 32, torch.float32)
    dst = _caches(5, 6, 16, 2, 32, torch.float32, seed=3)
    layout = KVLayout.of(src)
    limit = 2 * layout.bytes_per_block_layer  # two layers of one block
    chunks = _transfer(src, [1, 4], dst, [5, 2], max_chunk_bytes=limit)
    assert [(c.block_indices, c.layer_start, c.shape[0]) for c in chunks] == [
        ([0], 0, 2), ([0], 2, 2), ([0], 4, 1), ([1], 0, 2), ([1], 2, 2), ([1], 4, 1)]
    assert all(len(c.data) <= limit for c in chunks)
    for (sk, _), (dk, _) in zip(src, dst):
        assert torch.equal(dk[[5, 2]], sk[[1, 4]])
    with pytest.raises(KVCodecError, match="cannot hold one layer"):
        plan_chunks(1, layout, layout.bytes_per_block_layer - 1)


def test_chunks_of_the_default_model_fit_grpcs_default_limit():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32: 720 KiB per block over all layers.
    layout = KVLayout(30, 16, 3, 64, "float32")
    specs = plan_chunks(125, layout)  # a 2,000-token prompt
    assert sum(len(s.positions) for s in specs) == 125
    assert all(len(s.positions) * layout.bytes_per_block <= DEFAULT_MAX_CHUNK_BYTES
               for s in specs)
    assert len(specs[0].positions) == 5
    caches = _caches(30, 8, 16, 3, 64, torch.float32)
    chunk = next(encode_kv_blocks(caches, list(range(1, 8)), list(range(7))))
    message = pb.KVChunk(request_id="r" * 64, block_indices=chunk.block_indices,
                         dtype=chunk.dtype, shape=chunk.shape, data=chunk.data)
    assert message.ByteSize() <= 4 << 20


def _good_chunk(layout: KVLayout, indices: list[int]) -> KVChunkData:
    shape = layout.chunk_shape(layout.num_layers, len(indices))
    n = layout.itemsize
    for d in shape:
        n *= d
    return KVChunkData(indices, 0, layout.dtype, shape, bytes(n))


@pytest.mark.parametrize("change, message", [
    (lambda c: c._replace(dtype="float16"), "dtype"),
    (lambda c: c._replace(shape=(c.shape[0], 2, 2, 4, 2, 9)), "shape"),
    (lambda c: c._replace(shape=(3,) + c.shape[1:]), "layers"),
    (lambda c: c._replace(layer_start=1), "layers"),
    (lambda c: c._replace(data=c.data[:-1]), "bytes"),
    (lambda c: c._replace(block_indices=[0, 7]), "not requested"),
    (lambda c: c._replace(block_indices=[]), "no block_indices"),
])
def test_tracker_refuses_chunks_that_do_not_fit(change, message):
    layout = KVLayout(2, 4, 2, 8, "float32")
    tracker = TransferTracker(layout, [0, 1, 2])
    with pytest.raises(KVCodecError, match=message):
        tracker.accept(change(_good_chunk(layout, [0, 1])))
    assert tracker.num_missing_blocks == 3


def test_tracker_refuses_repeats_and_counts_what_is_missing():
    layout = KVLayout(2, 4, 2, 8, "float32")
    tracker = TransferTracker(layout, [0, 1, 2])
    tracker.accept(_good_chunk(layout, [0, 1]))
    with pytest.raises(KVCodecError, match="repeats"):
        tracker.accept(_good_chunk(layout, [1, 2]))
    assert tracker.num_missing_blocks == 1 and not tracker.complete
    with pytest.raises(KVCodecError, match="duplicates"):
        TransferTracker(layout, [0, 0])


@pytest.mark.parametrize("change, message", [
    (lambda c: c._replace(block_indices=[1, 1]), "repeats a block index"),
    (lambda c: c._replace(layer_start=-1), "layers"),
    (lambda c: c._replace(shape=()), "layers"),
    (lambda c: c._replace(shape=c.shape[:5]), "shape"),
    (lambda c: c._replace(shape=c.shape[:2] + (3,) + c.shape[3:]), "shape"),
    (lambda c: c._replace(data=c.data + bytes(4)), "bytes"),
    (lambda c: c._replace(data=b""), "bytes"),
    (lambda c: c._replace(block_indices=[0, -1]), "not requested"),
    (lambda c: c._replace(dtype="int8"), "dtype"),
])
def test_tracker_refuses_more_malformed_chunks(change, message):
    layout = KVLayout(2, 4, 2, 8, "float32")
    tracker = TransferTracker(layout, [0, 1, 2])
    with pytest.raises(KVCodecError, match=message):
        tracker.accept(change(_good_chunk(layout, [0, 1])))
    assert tracker.num_missing_blocks == 3 and tracker.num_bytes == 0


@pytest.mark.parametrize("sender, message", [
    ((2, 6, 4, 2, 8, torch.bfloat16), "dtype"),       # another dtype
    ((2, 6, 4, 3, 8, torch.float32), "shape"),        # more KV heads
    ((2, 6, 4, 2, 16, torch.float32), "shape"),       # another head_dim
    ((2, 6, 8, 2, 8, torch.float32), "shape"),        # another block size
    ((3, 6, 4, 2, 8, torch.float32), "layers"),       # more layers
])
def test_chunks_encoded_in_another_layout_than_the_handle_are_refused(sender, message):
    """A prefill whose cache geometry is not the handle's (the receiver's): every chunk it
    encodes is refused before a byte is written."""
    *shape, dtype = sender
    handle_layout = KVLayout(2, 4, 2, 8, "float32")
    tracker = TransferTracker(handle_layout, [0, 1])
    chunks = list(encode_kv_blocks(_caches(*shape, dtype), [3, 4], [0, 1]))
    for chunk in chunks:
        with pytest.raises(KVCodecError, match=message):
            tracker.accept(chunk)
    assert tracker.num_missing_blocks == 2


def test_overlapping_layer_ranges_are_refused():
    layout = KVLayout(4, 4, 2, 8, "float32")
    caches = _caches(4, 6, 4, 2, 8, torch.float32)
    tracker = TransferTracker(layout, [0])
    first, second = encode_kv_blocks(caches, [2], [0], 2 * layout.bytes_per_block_layer)
    tracker.accept(first)  # layers [0, 2)
    overlapping = KVChunkData(second.block_indices, 1, second.dtype, second.shape, second.data)
    with pytest.raises(KVCodecError, match="repeats"):
        tracker.accept(overlapping)  # layers [1, 3)
    tracker.accept(second)  # layers [2, 4)
    assert tracker.complete
