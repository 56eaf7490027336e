"""The decode service: KV admission and transfer, continuous-batch decoding."""
