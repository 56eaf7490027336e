"""Build a prefill or decode ServiceRuntime from its flags (the `serve` commands, tests)."""

from __future__ import annotations

import threading

from pdserve.services.common.config import Role, ServiceConfig
from pdserve.services.common.kv_events import KVEventsConfig
from pdserve.services.common.server import LoadEngine, ServiceRuntime
from pdserve.shared.engine.engine_core import EngineCore
from pdserve.shared.engine_args import EngineArgs

SERVICE_NAMES = {"prefill": "pdserve.v1.PrefillService", "decode": "pdserve.v1.DecodeService"}
_LOAD_LOCK = threading.Lock()
"""NOTE: transformers' lazy imports are not thread-safe: two engines loading at once in one
process (tests) must take turns."""


def engine_loader(engine_args: EngineArgs, role: Role) -> LoadEngine:
    """Resolve the configs, build the EngineCore and read the
    tokenizer's EOS id. Runs in a thread while the server already answers health checks."""
    def load() -> tuple[EngineCore, int | None]:
        from pdserve.shared.tokenizer import get_tokenizer

        with _LOAD_LOCK:
            configs = engine_args.create_engine_configs()
            # NOTE: one thread while loading: only the engine thread may own a multi-
            # threaded OpenMP pool (see apply_cpu_placement).
            core = EngineCore(*configs, enable_kv_cache_events=True, load_threads=1,
                              speculative_config=None if role == "prefill"
                              else engine_args.create_speculative_config(),
                              lora_config=engine_args.create_lora_config())
            return core, get_tokenizer(configs[0].model_path).eos_token_id
    return load


def build_runtime(config: ServiceConfig, engine_args: EngineArgs | None = None,
                  load_engine: LoadEngine | None = None) -> ServiceRuntime:
    """A runtime for `config.role`; pass `load_engine` to replace the default loader.

    Raises:
        ValueError: a bad --kv-events-config (one line).
    """
    kv_events_config = KVEventsConfig.from_value(engine_args.kv_events_config) \
        if engine_args is not None else None
    if load_engine is None:
        assert engine_args is not None, "engine_args or load_engine"
        load_engine = engine_loader(engine_args, config.role)
    if config.role == "prefill":
        from pdserve.services.prefill.servicer import add_prefill_servicer as add_servicer
        from pdserve.services.prefill.worker import PrefillWorker as Worker
    else:
        from pdserve.services.decode.servicer import add_decode_servicer as add_servicer
        from pdserve.services.decode.worker import DecodeWorker as Worker
    return ServiceRuntime(config, load_engine, Worker, add_servicer, SERVICE_NAMES[config.role],
                          kv_events_config)
