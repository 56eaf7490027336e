"""Issue 6 fuzz: hypothesis bodies for /v1/completions and /v1/chat/completions (built on the
request models' fields, mixing valid values, wrong types, out-of-range numbers, NaN/inf,
huge ints, junk JSON and malformed bytes) against a REAL gateway (uvicorn, its own thread and
event loop) in front of the fake engines.

Per body: no 5xx, every non-200 is an OpenAI error object, a stream ends with [DONE] and no
error event, and the connection never drops (httpx raises). Afterwards a normal request
succeeds and the waiting queue and the engines hold nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.gateway.conftest import SERVED_MODEL, running_gateway
from tests.services.gateway.fake_engine import start_fake_cluster
from tests.services.gateway.helpers import CHAT, COMPLETIONS, parse_sse

EXAMPLES_PER_ROUTE = 1050
VOCAB = 49152
TALLY: Counter = Counter()
"""status code -> bodies answered with it; "sent" -> bodies sent."""
TIMES: Counter = Counter()
"""status code -> seconds spent on its requests."""
PARAMS: Counter = Counter()
"""error param -> refusals naming it."""


# ---- strategies

_EXTREME_INTS = st.sampled_from([-1, 0, 2**31, 2**31 - 1, 2**63, 2**63 - 1, -2**63 - 1,
                                 2**64, 10**30, -10**30, 10**300])
_EXTREME_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308,
                                   5e-324, 3.5e38, -0.0])
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | _EXTREME_INTS | st.floats() | _EXTREME_FLOATS
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6)
TEXT = st.text(max_size=40)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16)

SAMPLING_FIELDS = {
    "model": st.sampled_from([SERVED_MODEL] * 4 + [None, "other-model"]),
    "n": st.integers(1, 3),
    "best_of": st.none() | st.just(1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.none() | st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=5),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "logit_bias": st.none() | st.dictionaries(st.sampled_from(["1", "2"]), st.floats(-5, 5)),
    "cache_salt": st.none() | TEXT,
    "response_format": st.none() | st.just({"type": "text"}) | st.just({"type": "json"}),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "echo": st.booleans(),
    "logprobs": st.none() | st.integers(0, 5),
    "suffix": st.none() | TEXT,
    "add_special_tokens": st.booleans(),
}
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": TEXT | st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": TEXT}), max_size=2)},
    optional={"name": st.text(max_size=8)})
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "logprobs": st.booleans(),
    "top_logprobs": st.none() | st.integers(0, 5),
    "max_completion_tokens": st.integers(1, 8),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.none() | st.dictionaries(st.text(max_size=8), JUNK, max_size=2),
    "tools": st.none() | st.just([]),
    "tool_choice": st.none() | st.just("none") | st.just("auto"),
}
REQUIRED = {
    COMPLETIONS: ("prompt", TEXT.filter(bool) | TOKEN_IDS
                  | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)
                  | st.lists(TOKEN_IDS, min_size=1, max_size=2)),
    CHAT: ("messages", st.lists(_MESSAGE, min_size=1, max_size=4)),
}


@st.composite
def bodies(draw, path: str) -> bytes:
    """One request body: mostly objects whose fields are each absent, valid or junk."""
    fields = COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS
    kind = draw(st.integers(0, 99))
    if kind < 4:  # not an object, or not JSON at all
        return draw(st.sampled_from([b"", b"null", b"[]", b"123", b'"text"', b"{", b"\xff\xfe",
                                     b'{"a": "\\ud800"}', b"[" * 300 + b"]" * 300,
                                     b'{"prompt": 1e99999, "messages": NaN}']))
    body: dict = {}
    name, required = REQUIRED[path]
    if draw(st.integers(0, 99)) < 92:
        body[name] = draw(required)
    elif draw(st.booleans()):
        body[name] = draw(JUNK)
    junk_rate = draw(st.sampled_from([0, 0, 0, 4, 10, 30]))
    for field, valid in fields.items():
        roll = draw(st.integers(0, 99))
        if roll < junk_rate // 2:
            body[field] = draw(JUNK)
        elif roll < junk_rate // 2 + 30:
            body[field] = draw(valid)
    if "stream_options" in body and draw(st.integers(0, 9)):
        body["stream"] = True
    if body.get("ignore_eos") is True:  # keep the fake engine's answers short
        body["max_tokens"] = 8
        body.pop("max_completion_tokens", None)
    if draw(st.integers(0, 99)) < 3:
        body[draw(st.text(min_size=1, max_size=10))] = draw(JUNK)  # unknown field
    data = json.dumps(body).encode()  # NaN / Infinity as the literals Python writes
    if kind < 7:  # truncated
        data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    return data


# ---- the server (its own thread and event loop)


@pytest.fixture(scope="module")
def fuzz_url(model_path, fake_model):
    # NOTE: uvloop, as `python -m services.gateway` runs: its sockets are TCP_NODELAY, while
    # asyncio's (under uvicorn's h11) hold each response body ~40 ms for a delayed ACK.
    loop = uvloop.new_event_loop()
    started = threading.Event()
    box: dict = {}

    async def serve() -> None:
        box["stop"] = asyncio.Event()
        cluster = await start_fake_cluster(fake_model)
        try:
            async with running_gateway(model_path, cluster, max_num_queued_requests=64) as gw:
                box["gw"] = gw
                started.set()
                await box["stop"].wait()
        finally:
            await cluster.stop()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as e:  # shown by the fixture below
            box["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=run, name="fuzz-gateway", daemon=True)
    thread.start()
    assert started.wait(60) and "gw" in box, box.get("error")
    yield box["gw"]
    loop.call_soon_threadsafe(box["stop"].set)
    thread.join(30)
    assert not thread.is_alive()
    loop.close()


@pytest.fixture(scope="module")
def http(fuzz_url):
    with httpx.Client(base_url=fuzz_url.url, timeout=30) as client:
        yield client


def _check(http: httpx.Client, path: str, data: bytes) -> None:
    t0 = time.perf_counter()
    r = http.post(path, content=data, headers={"content-type": "application/json"})
    TIMES[r.status_code] += time.perf_counter() - t0
    TALLY["sent"] += 1
    TALLY[r.status_code] += 1
    assert r.status_code < 500, (data, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        assert isinstance(err["type"], str) and err["code"] == r.status_code, r.text
        assert err["param"] is None or isinstance(err["param"], str), r.text
        PARAMS[err["param"]] += 1
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]", r.text
        assert not any("error" in e for e in events[:-1]), r.text
        TALLY["streams"] += 1
    else:
        assert r.json()["choices"], r.text


FUZZ = settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(data=bodies(COMPLETIONS))
def test_fuzz_completions(http, data):
    _check(http, COMPLETIONS, data)


@FUZZ
@given(data=bodies(CHAT))
def test_fuzz_chat_completions(http, data):
    _check(http, CHAT, data)


def test_fuzz_left_the_gateway_serving_and_empty(fuzz_url, http):
    print(f"fuzz tally: {dict(TALLY)}; seconds by status: {dict(TIMES)}; "
          f"refusals by param: {PARAMS.most_common()}")
    assert TALLY["sent"] >= 2 * EXAMPLES_PER_ROUTE
    assert TALLY[200] > 0 and TALLY[400] > 0  # both valid and invalid bodies were sent
    assert not [s for s in TALLY if isinstance(s, int) and s >= 500]
    # greedy: a sampled reply may be an immediate end of turn (empty content)
    r = http.post(CHAT, json={"model": SERVED_MODEL, "max_tokens": 4, "temperature": 0,
                              "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    queue = fuzz_url.app.state.gateway.completion.admission
    assert (queue.num_waiting, queue.num_running, queue.queued_tokens) == (0, 0, 0)
    cluster = fuzz_url.cluster
    # NOTE: the fake engines drop a finished stream from `active` when its server-side
    # handler returns, which may come a moment after the client has the whole response.
    deadline = time.monotonic() + 5.0
    while (cluster.decodes[0].rec.active or cluster.prefills[0].rec.active) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster.decodes[0].rec.active and not cluster.prefills[0].rec.active
