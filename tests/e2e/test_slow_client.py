"""Issue 13 item 8: a client that stops reading is cut, its engine request aborted, and a
normal stream beside it is unharmed (real gateway on uvicorn, real prefill and decode).

The slow client is a raw socket with a small receive buffer that sends a long streamed
completion (n 8 with logprobs 5: about 8 x 500 bytes of events per engine step) and then
reads nothing. The gateway, run with --max-stream-backlog 4096 and --socket-send-buffer 4096
(small, so the buffers fill in a few seconds of CPU decoding), must cut that stream (metric
and error event), abort its 8 engine requests (no block in use or pinned while they would
still be generating), and meanwhile stream a normal greedy chat to the end with the same
answer it gives alone. Then the slow client reads what was left for it: its last
events are the `slow_client` error object and `data: [DONE]`. (That gateway runs without
engine-side backpressure, --stream-pause-bytes 0, to test the last resort alone.)

The second test runs a gateway with engine-side backpressure (--stream-pause-bytes 8192,
--max-stream-pause-s 3): two clients that stop reading are paused on the decode instance
(its num_paused, and its generated-token count stops growing) while a normal chat beside
them gets its answer; one then reads everything (resumed, it completes), the other never
does (cut after 3 s paused, its request aborted); nothing is left in either pool.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import pytest_asyncio

from tests.e2e.conftest import E2E_ENGINE, Urls
from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.helpers import start_cluster, wait_leak_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

BACKLOG = 4096
SLOW_MAX_TOKENS = 1500
SLOW_N = 8
NORMAL = [{"role": "user", "content": "Name three colours."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(model_path):
    cluster = await start_cluster(model_path, None, **E2E_ENGINE)
    try:
        urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
        async with running_gateway(model_path, urls, rpc_timeout=10.0,  # type: ignore[arg-type]
                                   max_stream_backlog=BACKLOG,
                                   socket_send_buffer=BACKLOG, stream_pause_bytes=0) as gw:
            gw.client = gw.client.with_options(timeout=120)
            yield gw, cluster
    finally:
        await cluster.close()


def _open_slow_client(url: str, max_tokens: int = SLOW_MAX_TOKENS,
                      n: int = SLOW_N) -> socket.socket:
    """A connection with a ~4 KiB receive window that has sent its request and reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, int(port)))
    body = json.dumps({"model": SERVED_MODEL, "prompt": "Once upon a time", "stream": True,
                       "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 5,
                       "n": n, "temperature": 1.0})
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                 f"{body}".encode())
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


async def _normal_chat(client) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model=SERVED_MODEL, messages=NORMAL, max_tokens=24, temperature=0, stream=True)
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def test_slow_reader_is_cut_aborted_and_others_unharmed(stack):
    gw, cluster = stack
    alone = await _normal_chat(gw.client)
    assert alone[0] and alone[1] in ("stop", "length")
    cuts = gw.app.state.gateway.metrics.streams_cut_slow_client

    sock = await asyncio.to_thread(_open_slow_client, gw.url)
    try:
        beside = asyncio.ensure_future(_normal_chat(gw.client))
        t0 = time.monotonic()
        while cuts._value.get() < 1:
            assert time.monotonic() - t0 < 120, "the slow client was never cut"
            await asyncio.sleep(0.05)
        cut_after = time.monotonic() - t0
        # The slow request is aborted: both pools empty although it asked for 8 x 1,500 tokens.
        prefill, decode = await wait_leak_free(cluster, timeout=30.0)
        assert await beside == alone  # the normal stream beside it: same greedy answer
        for s in (prefill, decode):
            assert s.invariants_ok, s.invariants_error
            assert (s.num_used_blocks, s.num_pinned_blocks, s.num_running) == (0, 0, 0), s
        raw = await asyncio.to_thread(_read_all, sock)
    finally:
        sock.close()
    events = [line[6:] for line in raw.decode(errors="replace").split("\n")
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-500:]
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("slow_client", 408), error
    tokens = [json.loads(e) for e in events[:-2]]
    assert tokens and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    print(f"\nslow client cut after {cut_after:.1f} s; it had been sent {len(tokens)} of "
          f"{SLOW_N} x {SLOW_MAX_TOKENS} tokens' events")
    assert cuts._value.get() == 1


def _events_of(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode(errors="replace").split("\n")
            if line.startswith("data: ")]


async def test_slow_readers_are_paused_then_resumed_or_cut_and_nothing_leaks(stack,
                                                                              model_path):
    _, cluster = stack
    decode = cluster.decode.worker
    urls = Urls((cluster.prefill.identity.address,), (cluster.decode.identity.address,))
    async with running_gateway(
            model_path, urls, rpc_timeout=10.0, socket_send_buffer=BACKLOG,  # type: ignore[arg-type]
            stream_pause_bytes=8192, stream_resume_bytes=2048, max_stream_pause_s=3.0) as gw:
        gw.client = gw.client.with_options(timeout=120)
        metrics = gw.app.state.gateway.metrics
        alone = await _normal_chat(gw.client)
        never = await asyncio.to_thread(_open_slow_client, gw.url, SLOW_MAX_TOKENS, 1)
        later = await asyncio.to_thread(_open_slow_client, gw.url, 96, 1)
        try:
            t0 = time.monotonic()
            while (await decode.get_state()).num_paused < 2 or \
                    metrics.streams_paused._value.get() < 2:  # (the reply comes after)
                assert time.monotonic() - t0 < 60, "the slow readers were never paused"
                await asyncio.sleep(0.05)
            assert await _normal_chat(gw.client) == alone  # served beside them
            generated = decode.metrics.value("generation_tokens_total")
            await asyncio.sleep(0.5)
            state = await decode.get_state()
            if state.num_paused == 2:  # (not yet cut): paused requests generate nothing
                assert decode.metrics.value("generation_tokens_total") == generated
                assert state.num_running == 0 and state.num_used_blocks > 0  # KV kept
            raw_later = await asyncio.to_thread(_read_all, later)  # resumed, runs to the end
            # Read only once cut (paused 3 s): read earlier, it would be resumed and run to
            # its end (int8 decodes `later` well within those 3 s).
            t0 = time.monotonic()
            while metrics.streams_cut_slow_client._value.get() < 1:
                assert time.monotonic() - t0 < 30, "the paused reader was never cut"
                await asyncio.sleep(0.05)
            raw_never = await asyncio.to_thread(_read_all, never)
        finally:
            never.close()
            later.close()
        done = [json.loads(e) for e in _events_of(raw_later)[:-1]]
        assert _events_of(raw_later)[-1] == "[DONE]" and done[-1]["choices"][0][
            "finish_reason"] == "length", raw_later[-300:]
        assert sum(len(d["choices"][0]["logprobs"]["tokens"]) for d in done) == 96
        events = _events_of(raw_never)
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["type"] == "slow_client", error
        assert "paused" in error["message"], error
        assert metrics.streams_cut_slow_client._value.get() == 1
        prefill, decode_state = await wait_leak_free(cluster, timeout=30.0)
        for s in (prefill, decode_state):
            assert s.invariants_ok, s.invariants_error
            assert (s.num_used_blocks, s.num_pinned_blocks, s.num_running) == (0, 0, 0), s
        assert decode_state.num_paused == 0
