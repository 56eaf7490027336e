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

Engine-side backpressure comes first, long before the cut (`StreamPauser`): once a client is
more than `pause_at` bytes behind (--stream-pause-bytes; counted from what it has not yet
acknowledged: this backlog + the transport's buffer + the socket's send queue, SIOCOUTQ),
the stream's engine requests are paused on their decode instance (SetPaused: not scheduled,
not counted against its max_num_seqs or waiting queue; their KV kept until the pool needs
it). Below `resume_at` (--stream-resume-bytes) they are resumed. A stream paused longer than
--max-stream-pause-s is cut like one past the backlog limit (error event, [DONE], engine
requests aborted), so a client that stopped reading never holds KV or a decode seat for long:

    client behind ─┬─ > pause_at:  SetPaused(true)    (a slow reader costs the engine nothing)
                   ├─ < resume_at: SetPaused(false)   (polled while paused, 0.05 s .. 1 s)
                   ├─ paused > max_pause_s: cut + Abort
                   └─ backlog > limit:      cut + Abort   (tokens in flight when paused, or a
                                                           failover that ran unpaused)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import socket
import struct
import termios
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.services.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

TRANSPORT_KEY = "pdserve.transport"
"""scope["extensions"] key of the connection's asyncio transport (`TransportHttpProtocol`)."""
PAUSE_POLL_S = 0.05
PAUSE_POLL_MAX_S = 1.0
"""A paused stream checks whether its client has caught up after PAUSE_POLL_S, then at
intervals doubling up to PAUSE_POLL_MAX_S (a thousand paused streams: ~1,000 checks/s)."""


class SlowClientError(GatewayError):
    def __init__(self, limit: int = 0, paused_s: float = 0.0) -> None:
        why = (f"stayed behind the generated output for {paused_s:g} s while its request was "
               "paused (--max-stream-pause-s)") if paused_s else \
            f"fell more than {limit} bytes behind the generated output (--max-stream-backlog)"
        super().__init__(f"The stream was cut: the client {why}; its request was aborted.",
                         408, err_type="slow_client")


class TransportHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, handing each request's transport to the app (in
    scope["extensions"][TRANSPORT_KEY]) so a stream can see how far its client is behind."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {TRANSPORT_KEY: self.transport}  # type: ignore[typeddict-unknown-key]


def unacknowledged_bytes(transport: asyncio.Transport | None) -> int:
    """Bytes written to the connection that the client has not acknowledged: the
    transport's buffer plus the socket's send queue (Linux SIOCOUTQ). 0 without a transport.
    """
    if transport is None or transport.is_closing():  # (its fd may be another's by now)
        return 0
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return n


class StreamPauser:
    """Pauses a stream's engine requests while its client is behind; resumes them once it
    has caught up; gives up after `max_pause_s` (module docstring).

    Args:
        set_paused: pause (True) or resume (False) the stream's engine requests; returns
            whether an instance held any (False also when the call failed).
        behind: bytes the client is behind now.
        pause_at / resume_at: thresholds on `behind`, bytes (pause_at 0: never pause).
        max_pause_s: seconds paused before `on_timeout` (0: no limit).
        on_pause: called on every confirmed pause (a metric).
        on_timeout: called once when a pause lasted `max_pause_s` (the stream is cut).
    """

    def __init__(self, set_paused: Callable[[bool], Awaitable[bool]], behind: Callable[[], int],
                 pause_at: int, resume_at: int, max_pause_s: float,
                 on_pause: Callable[[], None], on_timeout: Callable[[], None]) -> None:
        self._set_paused = set_paused
        self._behind = behind
        self.pause_at, self.resume_at, self.max_pause_s = pause_at, resume_at, max_pause_s
        self._on_pause, self._on_timeout = on_pause, on_timeout
        self._task: asyncio.Task | None = None
        self.paused = False
        """The engine holds the stream's requests paused (as far as this gateway knows)."""

    def check(self) -> None:
        """After each event queued: pause when the client is more than pause_at behind. A
        pause that found no request (not on the decode instance yet) is asked again here."""
        if self.pause_at and self._task is None and self._behind() > self.pause_at:
            self._task = asyncio.ensure_future(self._pause_while_behind())

    async def _pause_while_behind(self) -> None:
        try:
            if not await self._set_paused(True):
                return
            self.paused = True
            self._on_pause()
            since, interval = time.monotonic(), PAUSE_POLL_S
            while self._behind() > self.resume_at:
                if self.max_pause_s and time.monotonic() - since >= self.max_pause_s:
                    self._on_timeout()
                    return
                await asyncio.sleep(interval)
                interval = min(2 * interval, PAUSE_POLL_MAX_S)
            await self._set_paused(False)
            self.paused = False
        finally:
            self._task = None

    async def close(self) -> None:
        """Stop watching (the stream is over: its requests are finished or aborted)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class StreamBacklog:
    """One stream's backlog: `start()` the producer, iterate `chunks()` to write, `close()`.

    Args:
        events: the SSE events (str), ending with `data: [DONE]`; closed on a cut.
        limit: bytes that may wait for the client (0: no limit).
        on_cut: called once when the stream is cut.
        transport: the connection's (`TransportHttpProtocol`), to count what the client
            has not acknowledged yet; None: only this backlog counts.
        pause: `StreamPauser` arguments after `behind`, for engine-side backpressure
            (None: never pause). Its `on_timeout` is this backlog's: do not pass one.
    """

    def __init__(self, events: AsyncGenerator[str, None], limit: int,
                 on_cut: Callable[[], None], transport: asyncio.Transport | None = None,
                 pause: dict | None = None) -> None:
        self._events = events
        self.limit = limit
        self._on_cut = on_cut
        self._transport = transport
        self.pauser = None if pause is None else StreamPauser(
            behind=self.behind, on_timeout=self._pause_timed_out, **pause)
        self._paused_too_long = 0.0
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

    def behind(self) -> int:
        """Bytes produced that the client has not acknowledged (backlog + connection)."""
        return self.size + unacknowledged_bytes(self._transport)

    def _pause_timed_out(self) -> None:
        """Cut a stream paused too long: the producer (waiting for events that will not come
        while paused) is cancelled, which closes events() and so aborts the requests."""
        if self._producer is None or self._producer.done() or self.cut:
            return
        assert self.pauser is not None
        self._paused_too_long = self.pauser.max_pause_s
        self.cut = True
        self._producer.cancel()

    async def _produce(self) -> None:
        try:
            async for event in self._events:
                data = event.encode()
                self._chunks.append(data)
                self.size += len(data)
                if self.limit and self.size > self.limit:
                    await self._cut()
                    return
                if self.pauser is not None:
                    self.pauser.check()
                self._ready.set()
        except asyncio.CancelledError:
            if not self._paused_too_long:
                raise
            self._queue_cut(SlowClientError(paused_s=self._paused_too_long), self.size)
        except Exception as e:  # events() turns its own errors into error events
            self._error = e
        finally:
            if self.pauser is not None:
                await self.pauser.close()
            self._done = True
            self._ready.set()

    async def _cut(self) -> None:
        self.cut = True
        behind = self.size
        # NOTE: events()'s finally closes the run: its engine requests are aborted here.
        await self._events.aclose()
        self._queue_cut(SlowClientError(self.limit), behind)

    def _queue_cut(self, error: SlowClientError, behind: int) -> None:
        """Drop the backlog; queue the error event and [DONE] (events() is closed)."""
        self._chunks.clear()
        self.size = 0
        data = json.dumps(error.to_dict(), separators=(",", ":"))
        self._chunks += [f"data: {data}\n\n".encode(), b"data: [DONE]\n\n"]
        logger.info("stream cut: %d bytes waiting for a slow client (%s)", behind,
                    f"paused {self._paused_too_long:g} s" if self._paused_too_long
                    else f"limit {self.limit}")
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
