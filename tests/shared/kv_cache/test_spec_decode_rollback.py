"""Property: random draft accept / reject lengths, driven through the Scheduler and the
KVCacheManager with a fake paged KV, keep every invariant: each request reads back exactly
its own accepted tokens, no rejected draft's block is ever cached, no block leaks."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.shared.engine.model_runner_output import ModelRunnerOutput
from pdserve.shared.kv_cache.prefix_hash import NONE_HASH, block_extra_keys, hash_block_tokens
from tests.shared.engine.test_scheduler import (
    BS,
    check,
    make_request,
    make_scheduler,
    runner_output,
)


def _valid_hashes(requests) -> set:
    """Chained hashes of every full block of the requests' accepted tokens."""
    out = set()
    for r in requests:
        parent = NONE_HASH
        for i in range(r.num_tokens // BS):
            extra = block_extra_keys("m", r.cache_salt) if i == 0 else ()
            parent = hash_block_tokens(parent, r.token_slice(i * BS, (i + 1) * BS), extra)
            out.add(parent)
    return out


class SpecFakeRunner:
    """Writes (position, token) for every scheduled token (drafts too) into a fake paged KV,
    checks each request reads back its own accepted tokens before its new ones, and samples
    k + 1 tokens for a request with k drafts: the first `a` equal to the drafts (a random)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.kv: dict[int, tuple[int, int]] = {}
        self.expected: dict[str, list[int]] = {}
        """request_id -> what the last step should keep (accepted drafts + 1)."""

    def execute(self, out) -> ModelRunnerOutput:
        sampled = {}
        for s in out.scheduled:
            req, start, n = s.request, s.start_pos, s.num_scheduled_tokens
            assert len(s.block_ids) * BS >= start + n and 0 not in s.block_ids
            for pos in range(start):
                slot = s.block_ids[pos // BS] * BS + pos % BS
                assert self.kv.get(slot) == (pos, req.token_at(pos)), (req.request_id, pos)
            tokens = req.token_slice(start, min(start + n, req.num_tokens))
            tokens += list(s.spec_token_ids)
            for pos, token in zip(range(start, start + n), tokens, strict=True):
                self.kv[s.block_ids[pos // BS] * BS + pos % BS] = (pos, token)
            if not s.sample:
                continue
            drafts = list(s.spec_token_ids)
            if not drafts:
                sampled[req.request_id] = self.rng.randrange(1, 50)
                continue
            a = self.rng.randint(0, len(drafts))
            # A rejected position samples something else than its draft (drafts are >= 1000).
            tokens = drafts[:a] + [self.rng.randrange(1, 50) for _ in range(len(drafts) + 1 - a)]
            sampled[req.request_id] = tokens
            self.expected[req.request_id] = tokens[:a + 1]
        return runner_output(sampled)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(12, 40),
       budget=st.sampled_from([8, 24, 64]), k=st.integers(1, 6))
def test_random_accept_reject_keeps_invariants(seed, num_blocks, budget, k):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget)
    shared_prefix = [rng.randrange(1, 50) for _ in range(BS + 3)]
    requests = [make_request(f"r{i}", prompt=shared_prefix + [rng.randrange(1, 50)
                                                              for _ in range(rng.randint(1, 20))],
                             max_tokens=rng.randint(1, 40))
                for i in range(5)]
    for r in requests:
        scheduler.add_request(r)
    runner = SpecFakeRunner(rng)
    kv = scheduler.kv_cache_manager
    for _ in range(400):
        if not scheduler.has_unfinished_requests():
            break
        for r in scheduler.running:  # propose fresh drafts (never equal to real samples)
            r.spec_token_ids = [rng.randrange(1000, 1100) for _ in range(rng.randint(0, k))]
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= budget
        runner.expected.clear()
        deltas = scheduler.update_from_output(out, runner.execute(out))
        check(scheduler)
        for d in deltas:  # the accepted drafts and one more; less only at a stop
            expected = runner.expected.get(d.request_id)
            if expected is not None:
                assert d.new_token_ids == expected[:len(d.new_token_ids)]
                assert d.finished or len(d.new_token_ids) == len(expected)
        valid = _valid_hashes(requests)
        for block in kv.block_pool.blocks[1:]:
            assert block.block_hash is None or block.block_hash in valid
    assert not scheduler.has_unfinished_requests()
    for r in requests:
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert kv.num_free_blocks == num_blocks - 1 and not kv.req_to_blocks
    stats = scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
