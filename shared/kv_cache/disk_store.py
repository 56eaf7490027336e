"""DiskBlockStore: KV blocks as checksummed files in a local directory, LRU-bounded (torch-free).

The disk tier of one engine (`--kv-offload-dir`, `--kv-offload-size`): blocks evicted from
the pool are kept here and read back instead of recomputed (LMCache's local disk backend,
SGLang's hierarchical cache, vLLM's KV offloading do the same with other media).

    <kv-offload-dir>/<identity>/<hash[:2]>/<hash>.kv      one file per block
    file = header (40 B) | payload (block_nbytes)
    header = b"PDKV" | version u16 | 0 u16 | payload length u64 | xxh3_64(payload) u64 |
             block hash (16 B)                                            (little-endian)

`identity` names what the payload's bytes mean: model, dtype, quantization and the KV
layout (`kv_identity`), so an engine never reads blocks another configuration wrote, even
one that shares the directory. Within it a block is named by its chained block hash
(shared/kv_cache/prefix_hash.py), which already covers the served model name, the
quantization, a LoRA adapter and the cache salt.

Faults never serve wrong KV: a read checks the header, the length and the checksum, and a
block that fails (corrupt, truncated, deleted, unreadable) is dropped from the index and
answered as a miss, so the caller recomputes it. A write that fails (a full disk, a deleted
directory) is dropped and counted; a deleted directory is made again at the next write.

At start the store re-indexes its directory (oldest file first by mtime, so LRU order
survives a restart); files of the wrong size are deleted then, corrupt ones at first read.

Thread-safety: one lock guards the index, and a file is renamed into place or deleted
under it (so a file is on disk exactly while indexed); reading and writing a payload run
outside it, so a reader and a writer of different blocks do not wait on each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from pdserve.shared.kv_cache.prefix_hash import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQ16s")
HEADER_NBYTES = _HEADER.size
"""40 bytes before each block's payload."""
SUFFIX = ".kv"


def kv_identity(**fields: object) -> str:
    """A short, stable directory name for a KV configuration: the first 16 hex digits of
    the SHA-256 of its sorted `key=value` fields (e.g. model path, dtype, quantization,
    num_layers, block_size, num_kv_heads, head_dim)."""
    text = "\n".join(f"{k}={fields[k]}" for k in sorted(fields))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class DiskStoreStats:
    """Cumulative counters (monotonic, for Prometheus counters)."""

    stores: int = 0
    """Blocks written."""
    store_failures: int = 0
    """Writes dropped (a full disk, a deleted directory, any OSError)."""
    loads: int = 0
    """Blocks read back and verified."""
    load_failures: int = 0
    """Reads that found a missing, truncated or corrupt block (dropped, recomputed)."""
    evictions: int = 0
    """Blocks dropped to stay within the size bound."""


class DiskBlockStore:
    """One engine's disk tier: block hash -> a file of `block_nbytes` bytes, LRU-bounded.

    Args:
        directory: the tier's root (`--kv-offload-dir`); made if missing.
        capacity_bytes: most bytes of files kept (headers included).
        identity: the KV configuration's name (`kv_identity`); a subdirectory.
        block_nbytes: the payload size of every block (all layers, K and V).

    Raises:
        ValueError: a capacity below one block.
        OSError: the directory cannot be made.
    """

    def __init__(self, directory: str, capacity_bytes: int, identity: str, block_nbytes: int):
        self.file_nbytes = HEADER_NBYTES + block_nbytes
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"kv_offload_size: {capacity_bytes} bytes hold no block "
                             f"({self.file_nbytes} bytes each)")
        self.root = os.path.join(directory, identity)
        self.block_nbytes = block_nbytes
        self.capacity_blocks = capacity_bytes // self.file_nbytes
        self.stats = DiskStoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, None] = OrderedDict()
        """Blocks on disk, least recently used first."""
        self._changes: list[tuple[BlockHash, bool]] = []
        """(hash, stored) in the order the index changed since the last `take_changes`:
        True written (or found at start), False dropped (evicted, or found bad)."""
        os.makedirs(self.root, exist_ok=True)
        self._reindex()

    # -- queries ----------------------------------------------------------------------------

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        """Bytes of the files indexed, headers included."""
        return len(self._index) * self.file_nbytes

    def count_prefix(self, block_hashes: list[BlockHash], start: int, stop: int) -> int:
        """How many of `block_hashes[start:stop]`, from `start` on, are on disk in a row."""
        index = self._index
        n = 0
        for i in range(start, stop):
            if block_hashes[i] not in index:
                break
            n += 1
        return n

    def hashes(self) -> list[BlockHash]:
        """Every hash on disk, least recently used first (a copy)."""
        with self._lock:
            return list(self._index)

    def take_changes(self) -> list[tuple[BlockHash, bool]]:
        """(hash, stored) for each change of the index since the last call, in order: True
        a block written (or found at start), False one dropped (evicted, missing, bad)."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    # -- writes -----------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, chunks: Sequence[memoryview | bytes]) -> bool:
        """Write one block whose payload is `chunks` joined (e.g. one per layer and K/V, so
        no caller has to join them); a block already on disk is only touched.

        Returns whether the block is on disk now. A failed write (OSError: a full disk, a
        deleted directory that cannot be made again) is logged, counted in
        `stats.store_failures`, and leaves no partial file behind.

        Raises:
            ValueError: a payload of the wrong size.
        """
        nbytes = sum(memoryview(c).nbytes for c in chunks)
        if nbytes != self.block_nbytes:
            raise ValueError(f"block payload is {nbytes} bytes, expected {self.block_nbytes}")
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        checksum = xxhash.xxh3_64()
        for c in chunks:
            checksum.update(c)
        path = self._path(block_hash)
        header = _HEADER.pack(MAGIC, VERSION, 0, self.block_nbytes, checksum.intdigest(),
                              block_hash)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except FileNotFoundError:  # the directory was deleted: make it again
                self._forget_all_if_gone()
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if os.writev(fd, [header, *chunks]) != self.file_nbytes:
                    raise OSError("short write")
            finally:
                os.close(fd)
            with self._lock:  # a file is on disk only while indexed (check_invariants)
                os.replace(tmp, path)
                self._index[block_hash] = None
                self._changes.append((block_hash, True))
        except OSError as e:
            self._discard(tmp)
            self.stats.store_failures += 1
            if self.stats.store_failures in (1, 10, 100) or self.stats.store_failures % 1000 == 0:
                logger.warning("disk tier: write of a block failed (%s); %d writes dropped "
                               "so far", e, self.stats.store_failures)
            return False
        with self._lock:
            self.stats.stores += 1
            while len(self._index) > self.capacity_blocks:
                old, _ = self._index.popitem(last=False)
                self._discard(self._path(old))
                self._changes.append((old, False))
                self.stats.evictions += 1
        return True

    # -- reads ------------------------------------------------------------------------------

    def get_into(self, block_hash: BlockHash, out: memoryview) -> bool:
        """Read the block's payload into `out` (writable, `block_nbytes` bytes) and verify
        it. False is a miss: not indexed, or found missing, truncated or corrupt (then it
        is dropped from the index and its file deleted; `out` may hold garbage). A hit
        becomes the most recently used."""
        with self._lock:
            if block_hash not in self._index:
                return False
            self._index.move_to_end(block_hash)
        path = self._path(block_hash)
        header = bytearray(HEADER_NBYTES)
        try:
            with open(path, "rb", buffering=0) as f:
                nread = f.readinto(header) + f.readinto(out) + len(f.read(1))
            why = self._check(header, nread, out, block_hash)
        except OSError as e:
            why = f"unreadable ({e.__class__.__name__})"
            if isinstance(e, FileNotFoundError) and self._forget_all_if_gone():
                self.stats.load_failures += 1
                return False
        if why:
            self.stats.load_failures += 1
            logger.warning("disk tier: block %s %s; dropped, it will be recomputed",
                           block_hash.hex()[:12], why)
            self.drop(block_hash)
            return False
        self.stats.loads += 1
        try:
            os.utime(path)  # the LRU order a restart re-reads
        except OSError:
            pass
        return True

    def _forget_all_if_gone(self) -> bool:
        """After a missing file: when the tier's directory itself is gone (deleted under
        the engine), forget every block at once, so each is written again at its next
        eviction instead of being found missing one load at a time. Returns whether it was
        gone."""
        if os.path.isdir(self.root):
            return False
        with self._lock:
            self._changes.extend((h, False) for h in self._index)
            lost, _ = len(self._index), self._index.clear()
        if lost:
            logger.warning("disk tier: %s was deleted; its %d blocks are forgotten (written "
                           "again when next evicted)", self.root, lost)
        return True

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a block and delete its file (a no-op for one not on disk): a read found
        it bad, or failed in a way the read could not tell (the loader's exception), so it
        is recomputed rather than read again."""
        with self._lock:
            if block_hash in self._index:
                del self._index[block_hash]
                self._changes.append((block_hash, False))
            self._discard(self._path(block_hash))

    def _check(self, header: bytearray, nread: int, payload: memoryview,
               block_hash: BlockHash) -> str:
        """Why a read file is not a good copy of the block; "" when it is."""
        if nread != self.file_nbytes:
            return f"is truncated or too long ({nread} bytes, expected {self.file_nbytes})"
        magic, version, _, length, checksum, stored_hash = _HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or length != self.block_nbytes:
            return "has a bad header"
        if stored_hash != block_hash:
            return "holds another block"
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            return "failed its checksum"
        return ""

    def check_invariants(self) -> None:
        """Every block file is indexed (none leaked: partial writes leave none), and the
        index is within the capacity. Indexed blocks whose file vanished are not a leak (a
        read answers them as a miss). O(files).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        with self._lock:
            indexed = self._index
            assert len(indexed) <= self.capacity_blocks, \
                f"disk tier holds {len(indexed)} blocks, capacity {self.capacity_blocks}"
            for sub in (os.scandir(self.root) if os.path.isdir(self.root) else ()):
                for entry in (os.scandir(sub.path) if sub.is_dir() else ()):
                    name = entry.name
                    if name.endswith(".tmp"):
                        continue  # a write in flight
                    assert name.endswith(SUFFIX) and \
                        bytes.fromhex(name[:-len(SUFFIX)]) in indexed, \
                        f"disk tier file {entry.path} is not indexed (leaked)"

    # -- files ------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> str:
        name = block_hash.hex()
        return os.path.join(self.root, name[:2], name + SUFFIX)

    @staticmethod
    def _discard(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _reindex(self) -> None:
        """Index the files already in the directory, oldest first; delete stray temporary
        files and files of the wrong size; drop the oldest past the capacity."""
        found: list[tuple[float, BlockHash]] = []
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if not name.endswith(SUFFIX):
                    if name.endswith(".tmp"):
                        self._discard(entry.path)
                    continue
                try:
                    block_hash = bytes.fromhex(name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                if len(block_hash) != 16 or st.st_size != self.file_nbytes:
                    self._discard(entry.path)
                    continue
                found.append((st.st_mtime, block_hash))
        found.sort()
        drop = max(0, len(found) - self.capacity_blocks)
        for _, block_hash in found[:drop]:
            self._discard(self._path(block_hash))
        self._index.update((h, None) for _, h in found[drop:])
        self._changes.extend((h, True) for h in self._index)
        if self._index:
            logger.info("disk tier: %d blocks (%.1f MiB) found in %s", len(self._index),
                        self.num_bytes / 2**20, self.root)
