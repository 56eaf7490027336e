"""The peer tier's placement rule: fetch a prefix from the instance that holds it, or compute it?

The instance that computes a prompt (its prefill instance, or its decode instance when that
prefills) may lack a prefix another instance holds (in its pool or on its disk tier: the
prefix index records both). Fetching `n` blocks costs a pin round trip plus their bytes over
the link; computing them costs `n * block_size` tokens of prefill. The hint goes out when
fetching is the cheaper (Mooncake's conductor weighs transfer against prefill the same way:
Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving", 2024).

    fetch_s   = overhead_s + n * kv_block_bytes / bandwidth     (the holder's advertised size)
    compute_s = n * block_size / prefill_rate

The instance then pins and fetches (services/decode/worker.py); a failure there costs only
a recompute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


class PeerKV(NamedTuple):
    """The hint sent with the request (proto PeerKV)."""

    address: str
    num_blocks: int
    """Leading full blocks of the prompt the peer holds."""


class Holder(NamedTuple):
    """An instance, as this rule sees it."""

    address: str
    num_cached_blocks: int
    kv_block_bytes: int
    """0: an instance that predates the peer tier (never asked)."""


@dataclass(frozen=True, slots=True)
class PeerFetchCost:
    """The link and the prefill speed the rule weighs (the gateway's --kv-peer-* flags).

    Args:
        bandwidth: bytes per second between instances (default 1e9: about 10 GbE).
        prefill_rate: prompt tokens per second one instance prefills; 0 turns the peer tier
            off.
        overhead_s: seconds a fetch costs besides its bytes (the PinKV round trip, the
            holder's one-token step, the stream's start).
    """

    bandwidth: float = 1e9
    prefill_rate: float = 2000.0
    overhead_s: float = 0.02

    def worth_fetching(self, num_blocks: int, kv_block_bytes: int, block_size: int) -> bool:
        """Fetching `num_blocks` blocks beats computing their tokens."""
        if self.prefill_rate <= 0 or num_blocks <= 0 or kv_block_bytes <= 0:
            return False
        fetch_s = self.overhead_s + num_blocks * kv_block_bytes / self.bandwidth
        return fetch_s < num_blocks * block_size / self.prefill_rate


def choose_peer(holders: Iterable[Holder], computing_address: str, num_local_blocks: int,
                block_size: int, cost: PeerFetchCost) -> PeerKV | None:
    """The peer for the instance at `computing_address` (holding `num_local_blocks` of the
    prompt's leading blocks) to fetch from: the holder of the most blocks beyond those,
    when fetching them beats computing them; None otherwise."""
    best = max((h for h in holders if h.address != computing_address and h.kv_block_bytes),
               key=lambda h: h.num_cached_blocks, default=None)
    if best is None or not cost.worth_fetching(best.num_cached_blocks - num_local_blocks,
                                               best.kv_block_bytes, block_size):
        return None
    return PeerKV(best.address, best.num_cached_blocks)
