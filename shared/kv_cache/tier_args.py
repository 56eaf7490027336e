"""The engine's KV tier flags: `--kv-offload-dir`, `--kv-offload-size` (the local disk tier,
shared/kv_cache/disk_store.py) and vLLM's `--kv-events-config` (services/common/kv_events.py);
`EngineArgs` carries the fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_kv_tier_cli_args(group: argparse._ArgumentGroup, env: Callable) -> None:
    """Add the flags to `group`; `env(name, default)` reads PDSERVE_<NAME>."""
    group.add_argument("--kv-offload-dir", default=env("kv_offload_dir", ""),
                       help="a directory for this engine's disk tier of KV blocks: blocks "
                            "evicted from the pool are kept there and loaded back instead "
                            "of recomputed; kept across restarts (default: no disk tier)")
    group.add_argument("--kv-offload-size", default=env("kv_offload_size", "8GiB"),
                       help="most bytes the disk tier holds, least recently used dropped "
                            "first (e.g. 8GiB)")
    group.add_argument("--kv-events-config", default=env("kv_events_config", None),
                       help="vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\": true, "
                            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'")
