"""--trace-file: a prefill and a decode process append one timeline (Chrome trace format).

Real processes on one core-share board: one request through the split; the file then holds
both engines' steps, the prefill's kv_send and the decode's kv_fetch, on one clock, in the
order the flow imposes."""

from __future__ import annotations

import grpc

from pdserve.services.proto import engine_pb2 as pb
from pdserve.services.proto import engine_pb2_grpc
from pdserve.shared.engine.trace import Tracer, read_trace
from tests.procs import ServiceGroup

PROMPT = list(range(100, 180))  # 80 tokens: 5 blocks of 16
MAX_TOKENS = 8


def _one_request(prefill: str, decode: str) -> list[int]:
    params = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(prefill) as pch, grpc.insecure_channel(decode) as dch:
        first = engine_pb2_grpc.PrefillServiceStub(pch).Prefill(
            pb.PrefillRequest(request_id="traced", prompt_token_ids=PROMPT,
                              sampling_params=params), timeout=120)
        chunks = engine_pb2_grpc.DecodeServiceStub(dch).Generate(
            pb.DecodeRequest(request_id="traced", prompt_token_ids=PROMPT,
                             output_token_ids=[first.first_token_id], sampling_params=params,
                             kv_transfer_params=first.kv_transfer_params), timeout=120)
        return [first.first_token_id] + [t for c in chunks for t in c.token_ids]


def test_a_split_request_leaves_one_timeline_of_both_engines(model_path, tmp_path):
    trace, board = tmp_path / "trace.json", tmp_path / "board"
    flags = ("--trace-file", str(trace), "--core-share", str(board))
    with ServiceGroup(tmp_path) as group:
        prefill = group.start("prefill", model_path, *flags)
        decode = group.start("decode", model_path, *flags)
        group.wait_serving()
        assert len(_one_request(prefill.address, decode.address)) == MAX_TOKENS
        assert prefill.terminate() == 0 and decode.terminate() == 0  # flushes the file

    events = read_trace(str(trace))
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    pids = {name.split(" ")[0]: pid for pid, name in names.items()}
    assert set(pids) == {"prefill-engine", "decode-engine"}, names
    p_pid, d_pid = pids["prefill-engine"], pids["decode-engine"]

    def spans(name: str, pid: int) -> list[dict]:
        return sorted((e for e in events if e["name"] == name and e["pid"] == pid
                       and e["ph"] == "X"), key=lambda e: e["ts"])

    p_steps, d_steps = spans("step", p_pid), spans("step", d_pid)
    assert sum(s["args"]["prefill_tokens"] for s in p_steps) == len(PROMPT)
    assert all(s["args"]["threads"] >= 1 for s in p_steps + d_steps)
    # The decode: the arrived request's first step (its KV is there: one token), then one
    # decode token per step until MAX_TOKENS - 1 more tokens are sampled.
    assert sum(s["args"]["decode_tokens"] for s in d_steps) == MAX_TOKENS - 1
    assert sum(s["args"]["prefill_tokens"] for s in d_steps) == 0
    (send,), (fetch,) = spans("kv_send", p_pid), spans("kv_fetch", d_pid)
    assert send["args"]["blocks"] == fetch["args"]["blocks"] == 5
    assert fetch["args"]["bytes"] > 0
    # One clock: prefill's steps end before the transfer starts, which ends before the
    # decode's first step.
    assert p_steps[-1]["ts"] + p_steps[-1]["dur"] <= fetch["ts"] + fetch["dur"]
    assert fetch["ts"] + fetch["dur"] <= d_steps[0]["ts"]


def test_processes_append_whole_lines_to_one_file(tmp_path):
    import multiprocessing as mp

    path = str(tmp_path / "t.json")

    def write(name: str) -> None:
        tracer = Tracer(path, name)
        for i in range(2000):
            tracer.complete("step", "engine", i, i + 1, {"i": i, "pad": "x" * 50})
        tracer.close()

    procs = [mp.get_context("fork").Process(target=write, args=(f"p{k}",)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events = read_trace(path)
    steps = [e for e in events if e["name"] == "step"]
    assert len(steps) == 3 * 2000
    for pid in {e["pid"] for e in steps}:
        assert sorted(e["args"]["i"] for e in steps if e["pid"] == pid) == list(range(2000))
    assert open(path).read().startswith("[\n")
