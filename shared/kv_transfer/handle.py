"""KVHandle: where a prefilled request's held KV blocks live and how to read them."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.shared.kv_transfer.codec import KVLayout


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

    @property
    def num_blocks(self) -> int:
        """ceil(num_tokens / block_size): the blocks held for the request, full or not."""
        return -(-self.num_tokens // self.layout.block_size)
