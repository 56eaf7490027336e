"""Pure-Python KV block bookkeeping: prefix hashes, the block pool, the per-request manager."""
