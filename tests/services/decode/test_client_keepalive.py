"""Keepalive from the server side (issue 13, item 4): a client that freezes mid-stream (a
SIGSTOPped gateway: TCP up, nobody answering) has its decode stream cancelled by the
decode's own keepalive pings, so its request is aborted and its KV blocks freed within
10 s, not at the call's deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.config import SERVER_KEEPALIVE_S, SERVER_KEEPALIVE_TIMEOUT_S
from tests.services.helpers import RPC_TIMEOUT

pytestmark = [pytest.mark.asyncio(loop_scope="session"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP")]

ROOT = Path(__file__).resolve().parents[3]
FREE_BOUND_S = 10.0
CLIENT = """
import sys, grpc
from pdserve.services.proto import engine_pb2 as pb, engine_pb2_grpc
stub = engine_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(sys.argv[1]))
call = stub.Generate(pb.DecodeRequest(
    request_id="frozen-client", prompt_token_ids=list(range(600, 680)),
    sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)))
for chunk in call:
    print("chunk", flush=True)
"""


async def _state(cluster) -> pb.EngineState:
    return await cluster.decode_stub.GetState(pb.GetStateRequest(), timeout=RPC_TIMEOUT)


async def test_a_frozen_client_frees_its_decode_blocks(cluster):
    assert SERVER_KEEPALIVE_S + SERVER_KEEPALIVE_TIMEOUT_S < FREE_BOUND_S
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, cluster.decode.identity.address],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(3):  # streaming: a few chunks have arrived
            assert await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120) \
                == "chunk\n"
        state = await _state(cluster)
        assert state.num_running == 1 and state.num_used_blocks > 0
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while (state := await _state(cluster)).num_used_blocks or state.num_running:
            assert time.monotonic() - stopped < FREE_BOUND_S, state
            await asyncio.sleep(0.1)
        freed_s = time.monotonic() - stopped
        assert freed_s <= FREE_BOUND_S
    finally:
        proc.kill()
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(30)
    assert (await cluster.decode_stub.GetState(pb.GetStateRequest(check_invariants=True),
                                               timeout=RPC_TIMEOUT)).invariants_ok
    print(f"\nfrozen client: decode blocks freed {freed_s:.1f} s after SIGSTOP "
          f"(server keepalive {SERVER_KEEPALIVE_S:g} s + {SERVER_KEEPALIVE_TIMEOUT_S:g} s)")
