"""StreamBacklog (services/gateway/backpressure.py) without sockets: a writer that keeps up
gets every event in order; one that stops taking them is cut once the backlog passes the
limit (events() closed, so its run's engine requests are aborted; backlog dropped; the
`slow_client` error event and [DONE] queued)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.services.gateway.backpressure import StreamBacklog

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


async def test_a_stream_behind_is_paused_then_resumed_when_the_writer_catches_up(monkeypatch):
    monkeypatch.setattr("pdserve.services.gateway.backpressure.PAUSE_POLL_S", 0.005)
    monkeypatch.setattr("pdserve.services.gateway.backpressure.PAUSE_POLL_MAX_S", 0.005)
    closed: list[str] = []
    calls: list[bool] = []
    pauses: list[int] = []
    running = asyncio.Event()
    running.set()

    async def set_paused(paused: bool) -> bool:  # an engine that honours it
        calls.append(paused)
        running.clear() if paused else running.set()
        return True

    async def engine():
        try:
            for i in range(10_000):
                await running.wait()
                yield f"data: {{\"i\": {i}, \"pad\": \"{'x' * 100}\"}}\n\n"
                await asyncio.sleep(0)
        finally:
            closed.append("closed")
    backlog = StreamBacklog(engine(), 1 << 20, lambda: None, pause=dict(
        set_paused=set_paused, pause_at=2048, resume_at=512, max_pause_s=0,
        on_pause=lambda: pauses.append(1)))
    backlog.start()
    chunks = backlog.chunks()
    await anext(chunks)  # then the writer is blocked: the backlog grows past pause_at
    for _ in range(500):
        if calls:
            break
        await asyncio.sleep(0)
    assert calls == [True] and pauses == [1] and backlog.size > 2048
    await asyncio.sleep(0.02)
    assert backlog.pauser.paused and calls == [True]  # still behind: stays paused
    await anext(chunks)  # the writer takes everything: caught up
    for _ in range(100):
        if len(calls) >= 2:
            break
        await asyncio.sleep(0.005)
    assert calls[:2] == [True, False]  # (and paused again: the writer stays blocked)
    await backlog.close()
    assert closed == ["closed"] and not backlog.cut


async def test_a_stream_paused_too_long_is_cut_and_its_run_closed(monkeypatch):
    monkeypatch.setattr("pdserve.services.gateway.backpressure.PAUSE_POLL_S", 0.005)
    monkeypatch.setattr("pdserve.services.gateway.backpressure.PAUSE_POLL_MAX_S", 0.005)
    closed: list[str] = []
    cuts: list[int] = []
    calls: list[bool] = []

    async def set_paused(paused: bool) -> bool:
        calls.append(paused)
        return True

    async def engine_that_pauses():  # like a paused engine request: no event after 20
        try:
            for i in range(20):
                yield f"data: {{\"i\": {i}, \"pad\": \"{'x' * 200}\"}}\n\n"
                await asyncio.sleep(0)
            await asyncio.Event().wait()
        finally:
            closed.append("closed")
    backlog = StreamBacklog(engine_that_pauses(), 1 << 20, lambda: cuts.append(1), pause=dict(
        set_paused=set_paused, pause_at=1024, resume_at=0, max_pause_s=0.05,
        on_pause=lambda: None))
    backlog.start()
    chunks = backlog.chunks()
    await anext(chunks)
    rest = await asyncio.wait_for(_drain_after_cut(backlog, chunks), 5)
    await backlog.close()
    assert calls == [True] and cuts == [1] and closed == ["closed"] and backlog.cut
    error, done = [e for e in rest.split("\n\n") if e][-2:]
    error = json.loads(error[6:])["error"]
    assert error["type"] == "slow_client" and "paused" in error["message"]
    assert done == "data: [DONE]"


async def _drain_after_cut(backlog: StreamBacklog, chunks) -> str:
    while not backlog.cut:
        await asyncio.sleep(0.005)
    return b"".join([c async for c in chunks]).decode()


async def test_a_pause_that_finds_no_request_is_asked_again():
    calls: list[bool] = []

    async def set_paused(paused: bool) -> bool:
        calls.append(paused)
        return len(calls) >= 3  # not on the decode instance for the first two events
    closed: list[str] = []
    backlog = StreamBacklog(_events(10_000, closed), 1 << 20, lambda: None, pause=dict(
        set_paused=set_paused, pause_at=256, resume_at=0, max_pause_s=0,
        on_pause=lambda: None))
    backlog.start()
    chunks = backlog.chunks()
    await anext(chunks)
    for _ in range(500):
        if backlog.pauser.paused:
            break
        await asyncio.sleep(0)
    assert backlog.pauser.paused and calls == [True, True, True]
    await backlog.close()


async def test_decode_calls_are_indexed_by_the_prefix_their_caller_gives():
    """ChannelPool.generate files each Generate call under the engine prefix handed in (no
    id is parsed): every choice and retry of one HTTP request under its prefix, until the
    call is done."""
    from types import SimpleNamespace

    from pdserve.services.gateway.channel_pool import ChannelPool
    from pdserve.services.proto import engine_pb2

    class FakeCall:
        def __init__(self) -> None:
            self.callbacks = []

        def add_done_callback(self, fn) -> None:
            self.callbacks.append(fn)

        def finish(self) -> None:
            for fn in self.callbacks:
                fn(self)

    calls: list[FakeCall] = []

    def fake_generate(request, timeout, metadata):
        calls.append(FakeCall())
        return calls[-1]

    pool = ChannelPool()
    pool._get = lambda address: SimpleNamespace(decode=SimpleNamespace(Generate=fake_generate))
    for rid, address in (("c1-ab12-0", "d1:1"), ("c1-ab12-1-retry2", "d2:1"),
                         ("other-7", "d1:1")):
        prefix = None if rid == "other-7" else "c1-ab12"
        pool.generate(address, engine_pb2.DecodeRequest(request_id=rid), "http-1", prefix)
    assert pool._decode_calls == {"c1-ab12": {"c1-ab12-0": "d1:1", "c1-ab12-1-retry2": "d2:1"},
                                  "other-7": {"other-7": "d1:1"}}
    assert (pool.in_flight["d1:1"], pool.in_flight["d2:1"]) == (2, 1)
    calls[0].finish()
    assert pool._decode_calls["c1-ab12"] == {"c1-ab12-1-retry2": "d2:1"}
    calls[1].finish()
    calls[2].finish()
    assert pool._decode_calls == {} and pool.in_flight["d1:1"] == pool.in_flight["d2:1"] == 0
