"""A request's KV transfer parameters, one type per direction (vLLM's kv_transfer_params).

    prefill: RemoteDecode() ──finished, length capped──▶ HeldBlocks ──▶ KVHandle (to the decode)
    decode:  KVHandle ──▶ RemotePrefill(num_tokens) ──blocks allocated──▶ num_computed_tokens

`Request.kv_transfer_params` holds one of the first three or None (torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.shared.kv_transfer.codec import KVLayout


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """Prefill side: the request goes on in a decode instance; when it ends on its length cap
    (its one engine token) the scheduler keeps its blocks for the decode to fetch."""


@dataclass(slots=True)
class RemotePrefill:
    """Decode side: the KV of the first `num_tokens` tokens (the prompt) arrives from a
    prefill instance; the request waits as WAITING_FOR_REMOTE_KVS until it is written."""

    num_tokens: int
    num_computed_tokens: int = 0
    """Set by the scheduler when it allocates the blocks (0 before): max(num_tokens, the
    local prefix hit), the request's num_computed_tokens once the receive ends."""
    recompute_on_failure: bool = False
    """A failed receive frees the blocks and the request computes its prompt here (the KV
    came from a peer: an optional tier), instead of waiting for the service's abort."""
    after: RemoteDecode | None = None
    """The request's kv_transfer_params once the receive ended (a prefill receiving a
    peer's prefix: RemoteDecode, held for its decode when it finishes); None: unchanged."""


class HeldBlocks(NamedTuple):
    """Prefill side, once finished: the scheduler holds the request's blocks for a fetch."""

    block_hashes: list[bytes]
    """One per full prompt block (num_prompt_tokens // block_size), chained, in order."""


class KVHandle(NamedTuple):
    """The domain form of the proto `KVTransferParams`: what a decode instance needs to fetch
    and verify a prefill's KV, and nothing else (the prefill finds the blocks by request id;
    FetchKV names them by position, 0 .. num_blocks - 1)."""

    prefill_address: str
    """host:port of the prefill instance's gRPC server (FetchKV, ReleaseKV)."""
    block_hashes: list[bytes]
    """One per full block (num_tokens // block_size), chained, as the prefix cache has them."""
    num_tokens: int
    """Tokens whose KV the blocks hold (the prompt)."""
    layout: KVLayout
    model: str
    """The served model name (an extra key of the first block's hash)."""
    quantization: str = "none"
    """The prefill's weight quantization ("none" | "int8"; "" from a peer that predates it):
    a decode instance refuses KV computed under another mode."""
    lora_name: str = ""
    """The LoRA adapter the KV was computed under ("": the base model): a decode instance
    refuses KV of another adapter than its request's."""
    lora_int_id: int = 0
    """That adapter's id (0: the base model)."""
    peer: bool = False
    """Held by a peer for us (PinKV, the peer tier), not by a prefill for its decode: read
    over KVPeerService, and a failed fetch is recomputed here (not the request's failure).
    Never on the wire."""

    @property
    def num_blocks(self) -> int:
        """ceil(num_tokens / block_size): the blocks held for the request, full or not."""
        return -(-self.num_tokens // self.layout.block_size)
