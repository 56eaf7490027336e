"""A request's KV transfer parameters, one type per direction (vLLM's kv_transfer_params).

    prefill instance:  RemoteDecode() ──finished, length capped──▶ HeldBlocks(block_hashes)
                       (set by the service)   (set by the scheduler; the service answers the
                                               gateway with the KVHandle built from it)
    decode instance:   RemotePrefill(num_tokens) ──blocks allocated──▶ num_computed_tokens set
                       (set by the service from the KVHandle it got)

`Request.kv_transfer_params` holds one of these or None (torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """Prefill side: the request goes on in a decode instance; when it ends on its length cap
    (its one engine token) the scheduler keeps its blocks for the decode to fetch."""


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: the KV of the first `num_tokens` tokens arrives from a prefill instance;
    the request waits as WAITING_FOR_REMOTE_KVS until it is written."""

    num_tokens: int
    """Tokens whose KV the prefill computed (its prompt): ceil(num_tokens / block_size)
    blocks."""
    num_computed_tokens: int = 0
    """Set by the scheduler when it allocates the blocks: max(num_tokens, the local prefix
    hit), the request's num_computed_tokens once the receive ends (0 before)."""


class HeldBlocks(NamedTuple):
    """Prefill side, once finished: the scheduler holds the request's blocks for a fetch."""

    block_hashes: list[bytes]
    """One per full prompt block (num_prompt_tokens // block_size), chained, in order."""
