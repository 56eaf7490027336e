"""KV transfer between instances: the typed transfer parameters (params.py, torch-free), the
KV handle (handle.py), the chunk codec of paged KV blocks (codec.py) and the scheduler's
connector (connector.py)."""
