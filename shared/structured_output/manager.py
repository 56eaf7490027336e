"""StructuredOutputManager: grammar compile cache, per-request matchers, the step's bitmask.

    grammar(params) ─▶ LRU cache hit? ─▶ Future (done)
                       └─ miss ─▶ compile pool thread ─▶ Future   (never the engine thread)

    add_request ─▶ init_request: matcher from the compiled grammar, replaying the tokens the
                   request already has (decode after a prefill elsewhere; a failover)
    each step   ─▶ apply_bitmask(logits, rows' requests): guided rows get -inf outside
                   their grammar, unguided rows are untouched (token-identical)
                ─▶ accept_tokens: each guided matcher advances with its sampled token

A service awaits `wait_for_grammar` before it adds the request, so the engine thread never
waits for a compilation; the offline engine blocks in `init_request` instead.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import Any

from pdserve.shared.request import Request
from pdserve.shared.structured_output.params import StructuredOutputsParams
from pdserve.shared.structured_output.request import StructuredOutputRequest

DEFAULT_CACHE_SIZE = 128
"""Compiled grammars kept (a JSON schema's is ~0.1-3 MB)."""
DEFAULT_COMPILE_TIMEOUT_S = 60.0
DEFAULT_COMPILE_WORKERS = 4
"""Compile threads: a slow grammar holds one of them, never the other new grammars
(xgrammar's compiler is C++; a compile of the 20 test schemas takes about 12 ms)."""


class StructuredOutputManager:
    """Compiles (off the caller's thread, cached) and applies request grammars.

    Args:
        backend: compiles params, makes matchers, allocates and applies bitmasks
            (`XgrammarBackend`, or a fake in tests).
        cache_size: compiled grammars kept, least recently used dropped first.
        num_workers: compile threads.
        compile_timeout: seconds a request waits for its grammar before it is refused.
    """

    def __init__(self, backend: Any, cache_size: int = DEFAULT_CACHE_SIZE,
                 num_workers: int = DEFAULT_COMPILE_WORKERS,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self.compile_timeout = compile_timeout
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = Lock()
        self._executor = ThreadPoolExecutor(max_workers=num_workers,
                                            thread_name_prefix="grammar-compile")
        self._bitmask: Any = None
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_seconds: deque[float] = deque(maxlen=1000)
        """Wall time of each compilation (the last 1000), for metrics and benchmarks."""

    # -- compile (any thread) ----------------------------------------------------------------

    def grammar(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params` as a Future (its exception: a ValueError naming
        what does not compile). Thread-safe; never blocks on a compilation."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            self.num_compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.compile(params)
        finally:
            self.compile_seconds.append(time.perf_counter() - start)

    async def wait_for_grammar(self, params: StructuredOutputsParams) -> None:
        """Wait (asyncio) until `params` is compiled.

        Raises:
            ValueError: it does not compile, or not within `compile_timeout`.
        """
        future = asyncio.wrap_future(self.grammar(params))
        try:
            # NOTE: shielded: a cancelled waiter must not cancel the cached compilation.
            await asyncio.wait_for(asyncio.shield(future), self.compile_timeout)
        except TimeoutError:
            raise ValueError(f"structured output: the {params.kind} grammar did not compile "
                             f"within {self.compile_timeout:g} s") from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- engine thread -----------------------------------------------------------------------

    def init_request(self, request: Request) -> None:
        """Give a guided request its matcher (no-op for an unguided one), advanced past the
        output tokens it already has.

        Raises:
            ValueError: the grammar does not compile (in time), or an output token breaks it.
        """
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        try:
            compiled = self.grammar(params).result(timeout=self.compile_timeout)
        except TimeoutError:
            raise ValueError(f"structured output: the {params.kind} grammar did not compile "
                             f"within {self.compile_timeout:g} s") from None
        state = StructuredOutputRequest(request.request_id, self.backend.new_matcher(compiled))
        state.replay(request.output_token_ids)
        request.structured_output = state

    def apply_bitmask(self, logits: Any, requests: list[Request]) -> None:
        """In place: mask each guided row of logits ([len(requests), vocab]) to its grammar's
        allowed next tokens. Unguided rows are not touched."""
        rows = [i for i, r in enumerate(requests)
                if r.structured_output is not None and not r.structured_output.is_terminated]
        if not rows:
            return
        if self._bitmask is None or self._bitmask.shape[0] < len(requests):
            self._bitmask = self.backend.allocate_bitmask(max(len(requests), 64))
        for i in rows:
            requests[i].structured_output.fill_bitmask(self._bitmask, i)
        self.backend.apply_bitmask(logits, self._bitmask, rows)

    @staticmethod
    def accept_tokens(requests: list[Request], token_ids: list[int]) -> None:
        """Advance each guided request's matcher with its sampled token."""
        for request, token_id in zip(requests, token_ids):
            if request.structured_output is not None:
                request.structured_output.accept(token_id)
