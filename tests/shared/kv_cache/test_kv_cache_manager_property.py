"""Property test: random allocate / append / free / abort / preempt sequences keep the
KVCacheManager consistent, and every prefix-cache hit holds the right tokens.

A fake KV store records, per block slot, what real KV depends on: the cache salt and every
token up to and including that position. A hit block must hold exactly that for the request
that hits it (so a hash that ignored the parent, or the salt, would be caught).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 16
# Few prefixes over a tiny vocabulary, so requests share blocks; the first two differ only
# in block 0, so equal later blocks under different parents must not hit.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], [2, 2, 2, 2, 5, 6, 7, 8, 9, 9, 9, 9],
            [1, 2, 3, 4, 7, 7, 7, 7]]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True, model_name="m")
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.kv: dict[int, list[tuple | None]] = {}
        self.next_id = 0

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _fingerprint(request: Request, pos: int) -> tuple:
        return (request.cache_salt, tuple(request.token_slice(0, pos + 1)))

    def _write_kv(self, request: Request, start: int, end: int) -> None:
        block_ids = self.manager.get_block_ids(request.request_id)
        for pos in range(start, end):
            slots = self.kv.setdefault(block_ids[pos // BS], [None] * BS)
            slots[pos % BS] = self._fingerprint(request, pos)

    def _allocate(self, request: Request, num_new: int, hits=(), num_hit: int = 0) -> bool:
        free_before = self.manager.num_free_blocks
        ids_before = self.manager.get_block_ids(request.request_id)
        new = self.manager.allocate_slots(request, num_new, hits, num_hit)
        if new is None:
            assert self.manager.num_free_blocks == free_before
            assert self.manager.get_block_ids(request.request_id) == ids_before
            return False
        start = request.num_computed_tokens + num_hit
        request.num_computed_tokens = start + num_new
        self._write_kv(request, start, start + num_new)
        return True

    # -- rules ------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([3, 8, 9, 12]),
          tail=st.lists(st.integers(1, 2), max_size=6), salt=st.sampled_from([None, None, "s"]))
    def add_request(self, prefix, cut, tail, salt):
        prompt = prefix[:cut] + tail
        request = Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=50),
                          cache_salt=salt, block_hasher=self.manager.block_hasher)
        self.next_id += 1
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 20))
    def admit(self, data, chunk):
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit == len(hits) * BS <= request.num_tokens - 1
        for i, block in enumerate(hits):  # cached KV is what this request would compute
            assert self.kv[block.block_id] == [self._fingerprint(request, pos)
                                               for pos in range(i * BS, (i + 1) * BS)]
        num_new = min(chunk, request.num_tokens - num_hit)
        if self._allocate(request, num_new, hits, num_hit):
            self.running[request.request_id] = self.waiting.pop(request.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 20), token=st.integers(1, 2))
    def step(self, data, chunk, token):
        """Next prefill chunk, or (prefill done) append a sampled token and decode it."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)
        self._allocate(request, min(chunk, request.num_tokens - request.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.manager.free(request)
        assert self.manager.get_block_ids(request.request_id) == []

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.waiting)))
        request = self.running.pop(request_id, None) or self.waiting.pop(request_id)
        self.manager.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = request

    @rule()
    def reset_prefix_cache(self):
        ok = self.manager.reset_prefix_cache()
        assert ok == (not self.running)

    @rule()
    def drain_events(self):
        for event in self.manager.take_events():
            assert all(len(h) == 16 for h in event.block_hashes)

    # -- checked after every step -----------------------------------------------------------

    @invariant()
    def consistent(self):
        self.manager.check_invariants()
        for request in self.running.values():
            num_blocks = len(self.manager.get_block_ids(request.request_id))
            assert num_blocks == -(-request.num_computed_tokens // BS)
        for request in self.waiting.values():
            assert self.manager.get_block_ids(request.request_id) == []

    def teardown(self):
        for request in list(self.running.values()) + list(self.waiting.values()):
            self.manager.free(request)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManagerProperty = KVCacheMachine.TestCase
