"""pdserve's engine: everything one process needs to serve requests, with no service in it.

A torch-free core, importable by the gateway without torch:
    request.py, sampling_params.py, stop_rules.py   a request, its sampling and stop rules
    engine/scheduler.py, kv_cache/                   continuous batching; the paged block pool,
                                                     prefix hashes, the per-request manager
    config.py, engine_args.py                        the frozen configs and their CLI flags
    proto/, prefix_index.py                          the gRPC messages; the Redis prefix index
    tokenizer.py, chat_encoding.py, structured_output/, models/convert.py
The model side, with torch and `kernels/`:
    engine/model_runner.py, engine/attention.py, engine/sampler.py, models/
    engine/engine_core.py    EngineCore: scheduler + KV cache manager + model runner, one step
    engine/async_engine.py   AsyncEngine: the thread that owns an EngineCore, for asyncio servers
    kv_transfer/             KV blocks between instances: the handle, the chunk codec
    llm.py                   the offline `LLM` API (vLLM's), the engine in-process

Layering: `services/` (the gRPC prefill/decode servers, the gateway, the launcher, the
`pdserve` CLI in services/cli.py) imports `shared/`; `shared/` imports `kernels/` and never
`services/` (tests/repo/test_imports.py checks it).
"""
