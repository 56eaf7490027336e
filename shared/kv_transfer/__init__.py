"""KV transfer between instances: the typed transfer parameters and KV handle (params.py,
torch-free), the chunk codec of paged KV blocks (codec.py), the scheduler's connector."""
