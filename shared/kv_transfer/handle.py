"""KVHandle: where a prefilled request's pinned KV blocks live and how to read them."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.shared.kv_transfer.codec import KVLayout


class KVHandle(NamedTuple):
    """The domain form of the proto `KVTransferParams` (vLLM's kv_transfer_params)."""

    prefill_instance_id: str
    prefill_address: str
    """host:port of the prefill instance's gRPC server (FetchKV, ReleaseKV)."""
    block_ids: list[int]
    """The request's blocks on the prefill instance, in logical order: ceil(num_tokens /
    block_size) of them."""
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
