"""longrope's switch to the long factors, per request (Phi-3 / Phi-3.5; the rows it reads:
shared/models/rope_scaling.py).

transformers rotates a forward pass whose sequence is longer than
original_max_position_embeddings (orig) wholly with the long factors, and Phi-3's
`prepare_inputs_for_generation` drops a cache computed short once the sequence outgrows orig
(input length orig + 1, past length <= orig) to recompute all of it long. The scheduler does
the same per request: one longer than orig when it is scheduled is `rope_long` from then on;
one that outgrows orig with KV computed short drops that KV, as a recompute preemption does,
and computes again from position 0 (it stays scheduled). Long blocks hash apart from short
ones (`prefix_hash.block_extra_keys`), so the prefix cache never serves one for the other.
"""

from __future__ import annotations

from pdserve.shared.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.shared.request import Request


def switch_to_long_rope(request: Request, original: int, kv_cache_manager: KVCacheManager
                        ) -> None:
    """Make `request` long if it is longer than `original` and not long yet: free its blocks,
    reset its computed tokens to 0 and hash it anew (`Request.set_rope_long`). A no-op
    otherwise (per scheduled request and step, for longrope models only)."""
    if request.rope_long or request.num_tokens <= original:
        return
    kv_cache_manager.free(request)
    request.num_computed_tokens = 0
    request.set_rope_long()
