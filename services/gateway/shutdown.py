"""The drain on SIGTERM, and the end of the grace period, told to the requests still running.

    SIGTERM / Ctrl-C ─▶ draining: the port stays open, new requests get 503
                       (server_shutdown, `Connection: close`; vLLM's --shutdown-timeout
                       drain), in-flight requests go on
                    ─▶ once none is left, uvicorn stops accepting and exits 0
                    ─▶ `grace_period` s later ShutdownNotice.cut(): every stream still
                       running sends a final error event ({"error": {"type":
                       "server_shutdown", ...}}) and `data: [DONE]`, a non-streamed request
                       answers 503 (type server_shutdown); their engine requests are aborted
                    ─▶ uvicorn finds no task left and exits 0 (its own, later timeout would
                       cancel the tasks instead: tracebacks, and a cut connection)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.streams import cancel_and_wait, run_unless

_T = TypeVar("_T")


class ServerShutdown(GatewayError):
    def __init__(self) -> None:
        super().__init__("The server is shutting down: the grace period for requests in "
                         "flight ended before this one finished.", 503,
                         err_type="server_shutdown")


class Draining(GatewayError):
    def __init__(self) -> None:
        super().__init__("The server is shutting down and takes no new requests; retry on "
                         "another instance.", 503, err_type="server_shutdown")
        self.headers = {"Connection": "close"}


class ShutdownNotice:
    """Set once, on the event loop, when the grace period ends."""

    def __init__(self) -> None:
        self._cut: asyncio.Event | None = None
        self.draining = False
        self.num_requests = 0
        """HTTP requests in progress (the middleware counts them)."""

    async def drained(self, grace: float, margin: float) -> None:
        """Return once no HTTP request is in progress, or `grace + margin` s after the call
        (the streams cut at `grace` have ended by then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace + margin
        while self.num_requests > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _event(self) -> asyncio.Event:
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    def begin(self, grace: float) -> None:
        """Start the grace period (call on the event loop)."""
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(grace, self.cut)

    def cut(self) -> None:
        self._event().set()

    async def wait(self) -> None:
        await self._event().wait()

    async def race(self, awaitable) -> object:
        """`awaitable`'s result, or ServerShutdown when the grace period ends first."""
        if self._cut is not None and self._cut.is_set():
            raise ServerShutdown()
        return await run_unless(awaitable, self.wait(), ServerShutdown)

    async def until_cut(self, items: AsyncIterator[_T]) -> AsyncIterator[_T]:
        """`items` until they end, or ServerShutdown when the grace period ends first.

        One waiter on the cut for the whole stream, one task per item (its next).
        """
        it = aiter(items)
        cut = asyncio.ensure_future(self.wait())
        try:
            while True:
                task = asyncio.ensure_future(anext(it))
                try:
                    await asyncio.wait((task, cut), return_when=asyncio.FIRST_COMPLETED)
                except BaseException:
                    # NOTE: wait for the cancelled `anext` to end: until then `items` is still
                    # running and the caller's aclose() of it (which aborts the engine
                    # requests of a client that left) fails with RuntimeError.
                    await cancel_and_wait(task)
                    raise
                if not task.done():
                    await cancel_and_wait(task)
                    raise ServerShutdown()
                try:
                    item = task.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            cut.cancel()
