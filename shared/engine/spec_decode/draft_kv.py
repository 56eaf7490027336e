"""DraftKVCache: the draft model's own paged KV bookkeeping, per request, kept in sync with
the target's tokens.

The draft holds KV for a prefix of each request's sequence plus the drafts it fed itself:

    positions      0 ......... T-1 | T ...... T+k-2
    token_ids      the request's    | d_0 .. d_{k-2}     (d_{k-1} is proposed, never fed)
                   known tokens     |
    num_confirmed  ^ positions known to equal the request's tokens

After the target verifies, the request's tokens are T-1's prefix + accepted drafts + one
more; `sync` compares only the unconfirmed tail (at most k - 1 entries) with them and rolls
the cache back to the longest common prefix, freeing the blocks past it. A rejected
draft's slot is simply rewritten when that position is fed again. Blocks are never shared
between requests (no prefix caching on the draft side), so every held block has
ref_cnt 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.shared.kv_cache.block_pool import BlockPool, KVCacheBlock
from pdserve.shared.request import Request


@dataclass(slots=True)
class DraftSequence:
    """One request's state in the draft cache."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """The token fed at each position whose KV the draft cache holds."""
    num_confirmed: int = 0
    """Leading entries of `token_ids` known to equal the request's tokens."""


class DraftKVCache:
    """Blocks of the draft's pool, per request id.

    Args:
        num_gpu_blocks: pool size, null block included.
        block_size: tokens per block (the target's).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching=False,
                                    enable_kv_cache_events=False)
        self.seqs: dict[str, DraftSequence] = {}

    def sync(self, request: Request) -> int:
        """Roll `request`'s draft KV back to the longest prefix equal to its tokens; returns
        that length (0 for a request the draft has not seen)."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return 0
        n = seq.num_confirmed
        end = min(len(seq.token_ids), request.num_tokens)
        if n < end:
            real = request.token_slice(n, end)
            while n < end and seq.token_ids[n] == real[n - seq.num_confirmed]:
                n += 1
        self.truncate(request.request_id, n)
        seq.num_confirmed = n
        return n

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep KV for the first `num_tokens` positions; free the blocks past them."""
        seq = self.seqs[request_id]
        del seq.token_ids[num_tokens:]
        seq.num_confirmed = min(seq.num_confirmed, num_tokens)
        num_keep = -(-num_tokens // self.block_size)
        if len(seq.blocks) > num_keep:
            tail = seq.blocks[num_keep:]
            del seq.blocks[num_keep:]
            self.block_pool.free_blocks(reversed(tail))

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for positions [0, num_tokens) of `request_id`; returns its block ids, or
        None when the pool lacks them (nothing changes)."""
        seq = self.seqs.get(request_id)
        num_held = len(seq.blocks) if seq is not None else 0
        num_new = -(-num_tokens // self.block_size) - num_held
        if num_new > self.block_pool.get_num_free_blocks():
            return None
        if seq is None:
            seq = self.seqs[request_id] = DraftSequence()
        if num_new > 0:
            seq.blocks.extend(self.block_pool.get_new_blocks(num_new))
        return [b.block_id for b in seq.blocks]

    def append_tokens(self, request_id: str, token_ids: list[int], confirmed: bool) -> None:
        """Record the tokens a draft forward fed (their KV is written); `confirmed`: they
        are the request's own tokens, not drafts."""
        seq = self.seqs[request_id]
        if confirmed:
            assert seq.num_confirmed == len(seq.token_ids)
            seq.num_confirmed += len(token_ids)
        seq.token_ids.extend(token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        seq = self.seqs.get(request_id)
        return len(seq.token_ids) if seq is not None else 0

    def free(self, request_id: str) -> None:
        """Release all of `request_id`'s draft blocks; a no-op if it holds none."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.blocks:
            self.block_pool.free_blocks(reversed(seq.blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each held block has one holder, and each request holds
        exactly the blocks its KV needs.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        self.block_pool.check_invariants()
        held = 0
        for request_id, seq in self.seqs.items():
            assert all(b.ref_cnt == 1 for b in seq.blocks), f"{request_id}: shared block"
            assert len(seq.blocks) >= -(-len(seq.token_ids) // self.block_size), request_id
            assert seq.num_confirmed <= len(seq.token_ids), request_id
            held += len(seq.blocks)
        assert held + self.num_free_blocks == self.block_pool.num_gpu_blocks - 1, \
            f"{held} held + {self.num_free_blocks} free != usable blocks"
