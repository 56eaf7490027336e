"""StreamBacklog (services/gateway/backpressure.py) without sockets: a writer that keeps up
gets every event in order; one that stops taking them is cut once the backlog passes the
limit (events() closed, so its run's engine requests are aborted; backlog dropped; the
`slow_client` error event and [DONE] queued)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.backpressure import StreamBacklog

pytestmark = pytest.mark.asyncio


def _events(n: int, closed: list[str]):
    async def gen():
        try:
            for i in range(n):
                yield f"data: {{\"i\": {i}, \"pad\": \"{'x' * 100}\"}}\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"
        finally:
            closed.append("closed")
    return gen()


async def test_a_writer_that_keeps_up_gets_everything_in_order():
    closed: list[str] = []
    cuts: list[int] = []
    backlog = StreamBacklog(_events(200, closed), 1024, lambda: cuts.append(1))
    backlog.start()
    out = b"".join([c async for c in backlog.chunks()])
    await backlog.close()
    events = [e for e in out.decode().split("\n\n") if e]
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(200))
    assert events[-1] == "data: [DONE]" and closed == ["closed"] and not cuts
    assert not backlog.cut


async def test_a_writer_that_stops_reading_is_cut_with_an_error_event():
    closed: list[str] = []
    cuts: list[int] = []
    backlog = StreamBacklog(_events(10_000, closed), 1024, lambda: cuts.append(1))
    backlog.start()
    chunks = backlog.chunks()
    first = await anext(chunks)  # then the writer is "blocked in send" and takes nothing
    for _ in range(200):
        if backlog.cut:
            break
        await asyncio.sleep(0)
    assert backlog.cut and cuts == [1] and closed == ["closed"]  # events() closed at once
    rest = b"".join([c async for c in chunks]).decode()
    await backlog.close()
    assert first.startswith(b"data: {\"i\": 0")
    error, done = [e for e in rest.split("\n\n") if e]
    assert json.loads(error[6:])["error"]["type"] == "slow_client" and done == "data: [DONE]"


async def test_no_limit_never_cuts_and_close_stops_the_producer():
    closed: list[str] = []
    backlog = StreamBacklog(_events(10_000, closed), 0, lambda: None)
    backlog.start()
    for _ in range(500):
        await asyncio.sleep(0)
    assert not backlog.cut and backlog.size > 1024
    await backlog.close()  # the client left: events() is closed (its run aborted)
    assert closed == ["closed"]
