"""DiskBlockStore (the disk tier's files): round trip, the LRU bound and its changes, the
re-index of a reopened directory, and every fault a block file can meet (corrupt, truncated,
another block's, deleted, its directory deleted, a full disk): each a miss or a dropped
write, never an exception, never a file left outside the index."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from pdserve.shared.kv_cache.disk_store import HEADER_NBYTES, SUFFIX, DiskBlockStore

BLOCK_NBYTES = 64
FILE_NBYTES = HEADER_NBYTES + BLOCK_NBYTES
IDENTITY = "0123456789abcdef"


def block_hash(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(BLOCK_NBYTES))


def make_store(directory, capacity_blocks: int = 4) -> DiskBlockStore:
    return DiskBlockStore(str(directory), capacity_blocks * FILE_NBYTES, IDENTITY, BLOCK_NBYTES)


def put(store: DiskBlockStore, i: int) -> bool:
    data = payload(i)  # two chunks, as the offloader hands one per layer and K/V
    return store.put(block_hash(i), [memoryview(data)[:20], data[20:]])


def get(store: DiskBlockStore, i: int) -> bytes | None:
    out = bytearray(BLOCK_NBYTES)
    return bytes(out) if store.get_into(block_hash(i), memoryview(out)) else None


def path_of(store: DiskBlockStore, i: int) -> str:
    name = block_hash(i).hex()
    return os.path.join(store.root, name[:2], name + SUFFIX)


def files_on_disk(store: DiskBlockStore) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), store.root)
                  for d, _, fs in os.walk(store.root) for f in fs)


def test_round_trip(tmp_path):
    store = make_store(tmp_path)
    assert store.root == str(tmp_path / IDENTITY)
    assert put(store, 1) is True
    assert os.path.getsize(path_of(store, 1)) == FILE_NBYTES
    assert block_hash(1) in store and len(store) == 1 and store.num_bytes == FILE_NBYTES
    assert get(store, 1) == payload(1)
    assert get(store, 2) is None  # never written: a plain miss, not a failure
    assert put(store, 1) is True  # already on disk: only touched
    assert (store.stats.stores, store.stats.loads, store.stats.load_failures) == (1, 1, 0)
    assert store.take_changes() == [(block_hash(1), True)]
    assert store.take_changes() == []
    with pytest.raises(ValueError, match="expected 64"):
        store.put(block_hash(3), [b"short"])
    store.check_invariants()


def test_lru_eviction_at_the_size_bound(tmp_path):
    store = make_store(tmp_path, capacity_blocks=3)
    for i in (1, 2, 3):
        put(store, i)
    assert get(store, 1) == payload(1)  # 1 becomes the most recently used
    put(store, 4)  # over the bound: 2, the least recently used, goes
    assert store.hashes() == [block_hash(3), block_hash(1), block_hash(4)]
    assert not os.path.exists(path_of(store, 2)) and get(store, 2) is None
    assert store.stats.evictions == 1 and store.num_bytes == 3 * FILE_NBYTES
    assert store.take_changes() == [(block_hash(1), True), (block_hash(2), True),
                                    (block_hash(3), True), (block_hash(4), True),
                                    (block_hash(2), False)]
    assert store.count_prefix([block_hash(i) for i in (3, 1, 2, 4)], 0, 4) == 2
    assert store.count_prefix([block_hash(i) for i in (3, 1, 2, 4)], 3, 4) == 1
    assert len(files_on_disk(store)) == 3
    store.check_invariants()
    with pytest.raises(ValueError, match="hold no block"):
        DiskBlockStore(str(tmp_path), FILE_NBYTES - 1, IDENTITY, BLOCK_NBYTES)


def test_reindex_keeps_lru_order_and_deletes_bad_files(tmp_path):
    store = make_store(tmp_path)
    for i in (1, 2, 3):
        put(store, i)
    for age, i in enumerate((2, 3, 1)):  # oldest first: 2, then 3, then 1 (mtimes)
        os.utime(path_of(store, i), (1_000_000 + age, 1_000_000 + age))
    wrong_size = path_of(store, 5)
    os.makedirs(os.path.dirname(wrong_size), exist_ok=True)
    with open(wrong_size, "wb") as f:
        f.write(b"x" * (FILE_NBYTES - 1))
    stray_tmp = path_of(store, 1) + ".1234.tmp"
    with open(stray_tmp, "wb") as f:
        f.write(b"partial")

    reopened = make_store(tmp_path)
    assert reopened.hashes() == [block_hash(i) for i in (2, 3, 1)]
    assert reopened.take_changes() == [(block_hash(i), True) for i in (2, 3, 1)]
    assert not os.path.exists(wrong_size) and not os.path.exists(stray_tmp)
    assert [get(reopened, i) for i in (1, 2, 3)] == [payload(i) for i in (1, 2, 3)]
    reopened.check_invariants()

    # the reads above made 1, 2, 3 the most recent in that order (a hit touches the mtime):
    # a smaller bound at the next start drops the oldest, 1
    smaller = make_store(tmp_path, capacity_blocks=2)
    assert smaller.hashes() == [block_hash(2), block_hash(3)]
    assert not os.path.exists(path_of(smaller, 1)) and len(files_on_disk(smaller)) == 2
    smaller.check_invariants()


def corrupt_byte(store, i, path):
    with open(path, "r+b") as f:
        f.seek(HEADER_NBYTES + 10)
        byte = f.read(1)
        f.seek(HEADER_NBYTES + 10)
        f.write(bytes([byte[0] ^ 0x01]))


def corrupt_magic(store, i, path):
    with open(path, "r+b") as f:
        f.write(b"XXXX")


def truncate(store, i, path):
    os.truncate(path, FILE_NBYTES - 1)


def too_long(store, i, path):
    with open(path, "ab") as f:
        f.write(b"\0")


def another_blocks_file(store, i, path):
    put(store, i + 1)
    shutil.copyfile(path_of(store, i + 1), path)  # a valid file, for the wrong hash


def delete_file(store, i, path):
    os.unlink(path)


def delete_directory(store, i, path):
    shutil.rmtree(store.root)


FAULTS = [corrupt_byte, corrupt_magic, truncate, too_long, another_blocks_file, delete_file,
          delete_directory]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__ for f in FAULTS])
def test_a_bad_block_is_a_miss_and_dropped(tmp_path, fault):
    store = make_store(tmp_path)
    put(store, 1)
    fault(store, 1, path_of(store, 1))
    store.take_changes()
    assert get(store, 1) is None  # no exception, and no garbage served
    assert block_hash(1) not in store and not os.path.exists(path_of(store, 1))
    assert store.stats.load_failures == 1 and store.stats.loads == 0
    assert store.take_changes() == [(block_hash(1), False)]
    assert get(store, 1) is None and store.stats.load_failures == 1  # a plain miss now
    store.check_invariants()
    assert put(store, 1) is True  # written again, the directory made again if it was gone
    assert get(store, 1) == payload(1)
    store.check_invariants()


def test_full_disk_drops_the_write(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    put(store, 1)
    store.take_changes()
    real_writev = os.writev

    def writev_enospc(fd, buffers):
        real_writev(fd, [bytes(buffers[0])[:10]])  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", writev_enospc)
    assert put(store, 2) is False
    assert store.stats.store_failures == 1 and store.stats.stores == 1
    assert block_hash(2) not in store and store.take_changes() == []
    assert files_on_disk(store) == [os.path.relpath(path_of(store, 1), store.root)]
    store.check_invariants()

    monkeypatch.setattr(os, "writev", lambda fd, buffers: real_writev(fd, buffers[:1]))
    assert put(store, 3) is False  # a short write is dropped the same way
    assert store.stats.store_failures == 2 and len(files_on_disk(store)) == 1

    monkeypatch.setattr(os, "writev", real_writev)  # room again: writes go through
    assert put(store, 2) is True and get(store, 2) == payload(2)
    assert get(store, 1) == payload(1)
    store.check_invariants()


def test_a_directory_that_cannot_be_made_again_drops_the_write(tmp_path):
    store = make_store(tmp_path)
    shutil.rmtree(store.root)
    with open(store.root, "wb"):  # a file where the directory was
        pass
    assert put(store, 1) is False and store.stats.store_failures == 1
    assert block_hash(1) not in store


def test_check_invariants_catches_an_orphan_file(tmp_path):
    store = make_store(tmp_path)
    put(store, 1)
    store.check_invariants()
    orphan = path_of(store, 9)
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    shutil.copyfile(path_of(store, 1), orphan)
    with pytest.raises(AssertionError, match="not indexed"):
        store.check_invariants()
    os.unlink(orphan)
    os.unlink(path_of(store, 1))  # indexed but gone is no leak: a read answers a miss
    store.check_invariants()
