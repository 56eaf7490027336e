"""The scheduler's loads from the disk tier, driven step by step on CPU: a real KVOffloader
and DiskBlockStore over a tiny CPU pool, the loader thread held at a gate where a test needs
a load in flight. A load that ends copies the blocks' bytes into the pool and caches them; a
partial one (a block gone bad) recomputes the rest; a request aborted while its load is in
flight keeps its blocks until the load ends, and the engine keeps stepping until then."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.services.common import state_feed
from pdserve.shared.config import SchedulerConfig
from pdserve.shared.engine.kv_offload import KVOffloader
from pdserve.shared.engine.scheduler import Scheduler
from pdserve.shared.kv_cache.disk_store import HEADER_NBYTES, DiskBlockStore
from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams

BS = 16
NUM_BLOCKS = 16
NUM_LAYERS = 2
BLOCK_SHAPE = (NUM_LAYERS, 2, BS, 1, 2)  # [num_layers, K/V, block_size, num_kv_heads, head_dim]
BLOCK_NBYTES = 4 * NUM_LAYERS * 2 * BS * 1 * 2


class Tier:
    """A scheduler whose disk tier's loader can be held in flight (`gate`)."""

    def __init__(self, tmp_path, monkeypatch):
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True, model_name="m")
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                   max_model_len=256,
                                                   scheduling_policy="fcfs"), self.kv)
        self.kv_caches = [(torch.zeros(NUM_BLOCKS, BS, 1, 2), torch.zeros(NUM_BLOCKS, BS, 1, 2))
                          for _ in range(NUM_LAYERS)]
        self.store = DiskBlockStore(str(tmp_path), 32 * (HEADER_NBYTES + BLOCK_NBYTES),
                                    "test", BLOCK_NBYTES)
        self.offloader = KVOffloader(self.store, self.kv_caches)
        self.kv.block_pool.on_evict = self.offloader.on_evict
        self.scheduler.kv_transfers.offloader = self.offloader
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()
        get_into = self.store.get_into

        def gated_get_into(block_hash, out):
            self.reading.set()
            assert self.gate.wait(30)
            return get_into(block_hash, out)

        monkeypatch.setattr(self.store, "get_into", gated_get_into)

    def add(self, request_id: str, prompt_len: int) -> Request:
        prompt = [(7 * i + len(request_id)) % 90 + 1 for i in range(prompt_len)]
        request = Request(request_id, prompt, SamplingParams(max_tokens=4))
        self.scheduler.add_request(request)
        return request

    def put_on_disk(self, request: Request) -> list[torch.Tensor]:
        """Write the request's full blocks to disk, block i's values all i + 1."""
        payloads = [torch.full(BLOCK_SHAPE, float(i + 1)) for i in range(len(request.block_hashes))]
        for block_hash, p in zip(request.block_hashes, payloads):
            assert self.store.put(block_hash, [p.view(torch.uint8).numpy().data])
        return payloads

    def wait_load_ended(self) -> None:
        deadline = time.monotonic() + 30
        while not self.offloader._finished:  # the loader's results, taken at the next step
            assert time.monotonic() < deadline
            time.sleep(0.002)

    def assert_leak_free(self) -> None:
        """As the services' leak audit (check_invariants_op): the pool's and the disk tier's
        invariants, and no block held by a request the scheduler does not know."""
        self.kv.check_invariants()
        self.offloader.check_invariants()
        s = self.scheduler
        assert list(state_feed.unowned(s.request_views(), s.block_holders())) == []


@pytest.fixture
def tier(tmp_path, monkeypatch):
    t = Tier(tmp_path, monkeypatch)
    yield t
    t.gate.set()
    t.offloader.shutdown()


def test_a_load_fills_the_pool_then_the_rest_is_computed(tier):
    request = tier.add("r", 40)  # 2 full blocks, 8 tokens computed
    payloads = tier.put_on_disk(request)
    out = tier.scheduler.schedule()
    assert out.scheduled == [] and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids = tier.kv.get_block_ids("r")
    assert len(block_ids) == 2
    tier.wait_load_ended()
    out = tier.scheduler.schedule()
    [s] = out.scheduled
    assert (s.start_pos, s.num_scheduled_tokens) == (32, 8)
    assert request.num_cached_tokens == 32
    assert s.block_ids[:2] == block_ids
    for i, block_id in enumerate(block_ids):  # the bytes on disk, now in the pool
        for layer, (k, v) in enumerate(tier.kv_caches):
            assert torch.equal(k[block_id], payloads[i][layer, 0])
            assert torch.equal(v[block_id], payloads[i][layer, 1])
    assert [tier.kv.block_pool.get_cached_block(h).block_id for h in request.block_hashes] \
        == block_ids
    assert tier.offloader.stats.disk_hits == tier.store.stats.loads == 2
    tier.assert_leak_free()


def test_a_partial_load_recomputes_the_rest(tier):
    request = tier.add("r", 56)  # 3 full blocks on disk; the second goes bad
    tier.put_on_disk(request)
    path = tier.store._path(request.block_hashes[1])
    with open(path, "r+b") as f:
        f.seek(HEADER_NBYTES + 5)
        f.write(b"\xff\xff")
    assert tier.scheduler.schedule().scheduled == []
    tier.wait_load_ended()
    [s] = tier.scheduler.schedule().scheduled
    # the first block loaded and cached is a pool hit now; the bad one is dropped from the
    # disk tier, so the rest (and the third block, still on disk) is computed
    assert (s.start_pos, s.num_scheduled_tokens) == (16, 40)
    assert request.num_cached_tokens == 16
    assert tier.store.stats.load_failures == 1 and tier.store.stats.loads == 1
    assert request.block_hashes[1] not in tier.store and request.block_hashes[2] in tier.store
    tier.assert_leak_free()


def test_a_failing_loader_is_reported_and_recomputed(tier, monkeypatch):
    request = tier.add("r", 40)
    tier.put_on_disk(request)

    def broken(block_hash, out):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tier.store, "get_into", broken)
    assert tier.scheduler.schedule().scheduled == []
    tier.wait_load_ended()
    # the run's first block is dropped, so the request, back in the queue, computes its
    # prompt instead of starting the same load again (and again)
    [s] = tier.scheduler.schedule().scheduled
    assert (s.start_pos, s.num_scheduled_tokens) == (0, 40)
    assert request.block_hashes[0] not in tier.store and request.block_hashes[1] in tier.store
    assert tier.store.take_changes()[-1] == (request.block_hashes[0], False)
    tier.assert_leak_free()


def test_abort_while_loading_frees_the_blocks_only_after_the_load(tier):
    request = tier.add("r", 40)
    tier.put_on_disk(request)
    tier.gate.clear()
    assert tier.scheduler.schedule().scheduled == []
    assert tier.reading.wait(30)  # the loader is in its first read, held
    block_ids = tier.kv.get_block_ids("r")
    pool = tier.kv.block_pool
    assert len(block_ids) == 2 and pool.get_num_free_blocks() == NUM_BLOCKS - 3

    assert tier.scheduler.abort_requests("r") == [request]
    assert request.status == RequestStatus.FINISHED_ABORTED
    # the loader still writes into those blocks: held, and owned (not a leak), and the
    # engine must keep stepping so that a step frees them once the load ends
    assert tier.kv.get_block_ids("r") == block_ids
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 3
    assert tier.scheduler.has_unfinished_requests()
    tier.assert_leak_free()
    assert tier.scheduler.schedule().scheduled == []
    assert tier.kv.get_block_ids("r") == block_ids  # a step while the load runs frees nothing

    tier.gate.set()
    tier.wait_load_ended()
    assert tier.scheduler.schedule().scheduled == []  # the aborted request is not run
    assert "r" not in tier.kv.req_to_blocks
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert pool.num_cached_blocks == 0  # loaded for nobody: never cached
    assert not tier.scheduler.kv_transfers.loading
    assert not tier.scheduler.kv_transfers.aborted_loading
    assert not tier.scheduler.has_unfinished_requests() and not tier.scheduler.waiting
    tier.assert_leak_free()


def test_abort_while_one_of_two_loads_is_in_flight(tier):
    """Two requests share a disk prefix; one is aborted mid-load, the other runs on."""
    a, b = tier.add("a", 40), tier.add("b", 40)
    assert a.block_hashes == b.block_hashes  # same length, same tokens (the ids' lengths)
    tier.put_on_disk(a)
    tier.gate.clear()
    assert tier.scheduler.schedule().scheduled == []
    assert tier.reading.wait(30)
    tier.scheduler.abort_requests("a")
    tier.gate.set()
    deadline = time.monotonic() + 30
    scheduled = []
    while not scheduled:
        assert time.monotonic() < deadline
        scheduled = tier.scheduler.schedule().scheduled
        time.sleep(0.002)
    [s] = scheduled
    assert s.request is b and (s.start_pos, s.num_scheduled_tokens) == (32, 8)
    assert "a" not in tier.kv.req_to_blocks
    tier.assert_leak_free()
