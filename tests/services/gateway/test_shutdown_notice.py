"""ShutdownNotice.race / until_cut: a consumer cancelled mid-item (a client that left) must
leave the source stream closable at once, so the engine requests behind it are aborted."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.gateway.shutdown import ServerShutdown, ShutdownNotice


async def _source(events: list[str], started: asyncio.Event):
    try:
        yield "first"
        started.set()
        await asyncio.Event().wait()  # the next item never comes: a long decode
        yield "never"
    finally:
        events.append("closed")


async def test_cancelled_consumer_leaves_the_source_closable():
    notice, events, started = ShutdownNotice(), [], asyncio.Event()
    source = _source(events, started)
    got: list[str] = []

    async def consume():  # as the gateway's SSE body does: close the run in `finally`
        try:
            async for item in notice.until_cut(source):
                got.append(item)
        finally:
            # Before the fix this raised "aclose(): asynchronous generator is already
            # running", and the source's cleanup (the engine aborts) ran only later,
            # whenever the orphaned anext task got to it.
            await source.aclose()
            events.append(f"aclosed with {events}")

    consumer = asyncio.ensure_future(consume())
    await asyncio.wait_for(started.wait(), 5)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert got == ["first"]
    assert events == ["closed", "aclosed with ['closed']"]


async def test_race_cancelled_mid_await_ends_the_inner_task_first():
    notice, events, started = ShutdownNotice(), [], asyncio.Event()
    source = _source(events, started)
    assert await anext(source) == "first"

    async def race_then_close():
        try:
            await notice.race(anext(source))
        finally:
            await source.aclose()
            events.append("aclosed")

    racer = asyncio.ensure_future(race_then_close())
    await asyncio.wait_for(started.wait(), 5)
    racer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await racer
    assert events == ["closed", "aclosed"]


async def test_until_cut_raises_server_shutdown_when_cut():
    notice, events, started = ShutdownNotice(), [], asyncio.Event()
    source = _source(events, started)
    got: list[str] = []
    with pytest.raises(ServerShutdown):
        async for item in notice.until_cut(source):
            got.append(item)
            asyncio.get_running_loop().call_soon(notice.cut)
    await source.aclose()
    assert got == ["first"] and events == ["closed"]
