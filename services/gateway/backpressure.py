"""Backpressure for SSE streams: a bounded backlog between the engine's output and the socket.

    engine outputs ─▶ events() ─▶ producer task ─▶ backlog ─▶ writer ─▶ uvicorn send()
                                  (never waits     (bytes not   (blocks while the socket's
                                   for the socket)  yet sent)    transport is paused)

The producer always reads the engine's output, so a client that reads slowly never holds up
its gRPC stream (nor, through the shared channel and the decode's output loop, anyone
else's). The writer sends everything queued as one write, so a client that is only a little
behind catches up in larger writes. When the backlog passes `limit` bytes the client is too
far behind (on top of what the transport (64 KiB) and the kernel's socket buffers hold): the
producer closes events(), which aborts the stream's engine requests (their KV blocks are
freed at once), drops the backlog, and queues one OpenAI error event (code 408, type
`slow_client`) and `data: [DONE]`, sent after what the client was already sent. A stream
holds at most about 2 x `limit` in the gateway (the backlog and the write in progress) plus
the transport's buffer; a client that never reads again keeps that until it disconnects.

The kernel's send buffer comes before all of this: autotuned, it grows to 4 MiB per
connection (net.ipv4.tcp_wmem) for a client that does not read, so a slow client would be
cut only after megabytes, held in kernel memory. `set_send_buffer` fixes it on the listening
socket (--socket-send-buffer), which the accepted connections inherit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from services.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

class SlowClientError(GatewayError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The stream was cut: the client fell more than {limit} bytes behind "
                         "the generated output (--max-stream-backlog); its request was "
                         "aborted.", 408, err_type="slow_client")


class StreamBacklog:
    """One stream's backlog: `start()` the producer, iterate `chunks()` to write, `close()`.

    Args:
        events: the SSE events (str), ending with `data: [DONE]`; closed on a cut.
        limit: bytes that may wait for the client (0: no limit).
        on_cut: called once when the stream is cut.
    """

    def __init__(self, events: AsyncGenerator[str, None], limit: int,
                 on_cut: Callable[[], None]) -> None:
        self._events = events
        self.limit = limit
        self._on_cut = on_cut
        self._chunks: list[bytes] = []
        self.size = 0
        """Bytes produced and not yet handed to the writer."""
        self._ready = asyncio.Event()
        self._done = False
        self._error: BaseException | None = None
        self._producer: asyncio.Task | None = None
        self.cut = False

    def start(self) -> None:
        self._producer = asyncio.ensure_future(self._produce())

    async def _produce(self) -> None:
        try:
            async for event in self._events:
                data = event.encode()
                self._chunks.append(data)
                self.size += len(data)
                if self.limit and self.size > self.limit:
                    await self._cut()
                    return
                self._ready.set()
        except Exception as e:  # events() turns its own errors into error events
            self._error = e
        finally:
            self._done = True
            self._ready.set()

    async def _cut(self) -> None:
        self.cut = True
        behind = self.size
        self._chunks.clear()
        self.size = 0
        # NOTE: events()'s finally closes the run: its engine requests are aborted here.
        await self._events.aclose()
        error = json.dumps(SlowClientError(self.limit).to_dict(), separators=(",", ":"))
        self._chunks += [f"data: {error}\n\n".encode(), b"data: [DONE]\n\n"]
        logger.info("stream cut: %d bytes waiting for a slow client (limit %d)", behind,
                    self.limit)
        self._on_cut()

    async def chunks(self) -> AsyncIterator[bytes]:
        """What to write, as it comes: everything queued at once, in order."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self.size = 0
                yield data
                continue
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            self._ready.clear()
            await self._ready.wait()

    async def close(self) -> None:
        """Stop the producer (and so events(): its run is closed) and wait for it."""
        # NOTE: a producer cutting the stream is closing events() already: let it finish.
        if self._producer is not None and not self._producer.done() and not self.cut:
            self._producer.cancel()
        if self._producer is not None:
            await asyncio.gather(self._producer, return_exceptions=True)


def set_send_buffer(sock: socket.socket, nbytes: int) -> None:
    """Fix SO_SNDBUF of the connections accepted on the listening socket `sock` (they
    inherit it; Linux doubles the value and turns autotuning off). 0: leave the kernel's."""
    if nbytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
