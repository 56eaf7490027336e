"""Asyncio helpers of the OpenAI handlers: the choices of one HTTP request merged into one
stream, and work cancelled when its client disconnects (or the server's grace period ends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

_T = TypeVar("_T")
_DONE = object()


class ClientDisconnected(Exception):
    pass


async def merge_streams(streams: Sequence[AsyncIterator[_T]]) -> AsyncIterator[_T]:
    """Items of all streams as they come; the first error ends it; closing cancels all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[_T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((None, e))
        else:
            queue.put_nowait((_DONE, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended (its result or error dropped): the caller
    may close the generators it iterates only then."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def run_unless(awaitable: Awaitable[_T], stop: Awaitable, error: type[Exception]) -> _T:
    """`awaitable`'s result, unless `stop` completes first: then `awaitable` is cancelled and
    `error()` raised. Cancelling the caller cancels `awaitable` too (and waits for it)."""
    work, stopper = asyncio.ensure_future(awaitable), asyncio.ensure_future(stop)
    try:
        await asyncio.wait((work, stopper), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await cancel_and_wait(work)
        raise
    finally:
        stopper.cancel()
    if not work.done():
        await cancel_and_wait(work)
        raise error()
    return work.result()


async def run_until_disconnect(receive, awaitable: Awaitable[_T]) -> _T:
    """Run `awaitable` unless the client disconnects first (then cancel it).

    Raises:
        ClientDisconnected: the client went away; the work was cancelled.
    """
    async def wait_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return await run_unless(awaitable, wait_disconnect(), ClientDisconnected)
