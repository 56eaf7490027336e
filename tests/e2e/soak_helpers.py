"""Helpers of the soak tests: a random OpenAI workload (valid requests, invalid ones, client
disconnects, operator aborts), one raw-HTTP sender, the outcome tally and the pool audit.

Requests go over real HTTP (httpx, not the `openai` client: invalid bodies and cancelled
streams must reach the gateway exactly as sent). Each request carries `x-request-id:
soak<i>`; the gateway derives its engine request ids from it (`soak<i>-<hex>-<choice>`), which
is how an operator abort finds the engine requests of one HTTP request.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from dataclasses import dataclass, field

import httpx

from pdserve.services.proto import engine_pb2 as pb
from tests.services.helpers import RPC_TIMEOUT, Cluster, index_matches, wait_leak_free

WORDS = ("river mountain lantern violet copper harbor meadow silent orange falcon thunder "
         "garden pencil winter marble candle shadow forest bridge ocean velvet engine "
         "planet whisper ladder compass saddle mirror basket cobalt tunnel village").split()
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FINISH_REASONS = ("stop", "length")


def shared_prefixes(seed: int, count: int = 4, words: int = 24) -> list[str]:
    """Texts of ~`words` tokens that many prompts start with (prefix-cache hits)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def random_prompt(rng: random.Random, prefixes: list[str]) -> str:
    """5-60 tokens: half of them a shared prefix plus a random tail."""
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 30)))
    return f"{rng.choice(prefixes)} {tail}" if rng.random() < 0.5 else tail


# Each makes a valid body invalid in one way the gateway must answer with 400.
INVALID_EDITS = (
    lambda b: b.update(max_tokens=-1),
    lambda b: b.update(max_tokens="many"),
    lambda b: b.update(max_tokens=10**6),
    lambda b: b.update(temperature=-0.5),
    lambda b: b.update(top_p=1.5),
    lambda b: b.update(n=0),
    lambda b: b.update(n=10_000),
    lambda b: b.update(stop=[""]),
    lambda b: b.update(logit_bias={"-11": 5.0}),
    lambda b: b.update(stream="yes"),
    lambda b: b.update(stream_options={"include_usage": True}, stream=False),
    lambda b: b.pop("messages" if "messages" in b else "prompt"),
)


@dataclass
class Plan:
    index: int
    route: str
    body: dict | bytes
    stream: bool
    n: int
    max_tokens: int
    fault: str
    """"none" | "invalid" | "disconnect" | "abort"."""
    delay: float
    """Seconds after sending (disconnect) or after `abort_stage` was reached (abort)."""
    abort_stage: str = "prefill"
    """"prefill" | "decode": the call the gateway must have made before the abort."""

    @property
    def request_id(self) -> str:
        return f"soak{self.index}"


def make_plan(index: int, rng: random.Random, model: str, prefixes: list[str],
              fault_rates: dict[str, float], max_tokens_range: tuple[int, int] = (1, 8),
              max_delay: float = 0.6) -> Plan:
    """One request: route, stream, n (1 or 2), max_tokens (in the closed range `max_tokens_range`)
    and its fault, drawn from `fault_rates` (fault -> probability; the rest: "none")."""
    route = rng.choice((COMPLETIONS, CHAT))
    stream, n = rng.random() < 0.5, 1 if rng.random() < 0.75 else 2
    max_tokens = rng.randint(*max_tokens_range)
    prompt = random_prompt(rng, prefixes)
    body: dict = {"model": model, "max_tokens": max_tokens, "n": n, "stream": stream}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    draw, fault = rng.random(), "none"
    for name, rate in fault_rates.items():
        if draw < rate:
            fault = name
            break
        draw -= rate
    payload: dict | bytes = body
    if fault == "invalid":
        if rng.random() < 0.1:
            payload = b'{"model": "' + model.encode() + b'", "prompt": '  # truncated JSON
        else:
            rng.choice(INVALID_EDITS)(body)
    return Plan(index, route, payload, stream, n, max_tokens, fault,
                rng.uniform(0, max_delay if fault == "disconnect" else 0.15),
                rng.choice(("prefill", "decode")))


@dataclass
class Result:
    status: int
    body: dict | None = None
    """The JSON answer (non-streamed) or the error object (any non-200)."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    usage: dict | None = None
    error_event: dict | None = None
    done: bool = False
    """A stream ended with `data: [DONE]`."""


async def send(http: httpx.AsyncClient, plan: Plan) -> Result:
    """POST the plan's body; parse the JSON answer or the whole SSE stream."""
    content = plan.body if isinstance(plan.body, bytes) else json.dumps(plan.body).encode()
    headers = {"x-request-id": plan.request_id, "content-type": "application/json"}
    if not plan.stream:
        resp = await http.post(plan.route, content=content, headers=headers)
        body = resp.json()
        result = Result(resp.status_code, body, usage=body.get("usage"))
        for c in body.get("choices", []):
            if c.get("finish_reason") is not None:
                result.finish_reasons[c["index"]] = c["finish_reason"]
        return result
    async with http.stream("POST", plan.route, content=content, headers=headers) as resp:
        if resp.status_code != 200:
            return Result(resp.status_code, json.loads(await resp.aread()))
        result = Result(200)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error_event = event
                continue
            if event.get("usage"):
                result.usage = event["usage"]
            for c in event.get("choices", []):
                if c.get("finish_reason") is not None:
                    result.finish_reasons[c["index"]] = c["finish_reason"]
        return result


def is_error_object(body: dict | None, status: int) -> bool:
    err = (body or {}).get("error")
    return (isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
            and bool(err["message"]) and err["code"] == status)


def complete_problems(plan: Plan, r: Result) -> list[str]:
    """Why `r` is not a complete answer to a valid request (empty: it is)."""
    problems = []
    if r.status != 200:
        problems.append(f"status {r.status}: {r.body}")
        return problems
    if r.error_event is not None:
        problems.append(f"error event {r.error_event}")
    if plan.stream and not r.done:
        problems.append("no [DONE]")
    if sorted(r.finish_reasons) != list(range(plan.n)):
        problems.append(f"finish reasons {r.finish_reasons} for n={plan.n}")
    if any(f not in FINISH_REASONS for f in r.finish_reasons.values()):
        problems.append(f"finish reasons {r.finish_reasons}")
    u = r.usage or {}
    if not (u.get("prompt_tokens", 0) > 0
            and 1 <= u.get("completion_tokens", 0) <= plan.n * plan.max_tokens
            and u.get("total_tokens") == u["prompt_tokens"] + u["completion_tokens"]):
        problems.append(f"usage {r.usage}")
    return problems


class EngineIdSpy:
    """Records the engine request ids the gateway sends to Prefill ("prefill") and Generate
    ("decode"), per HTTP request id (a pass-through wrapper around the gateway's real gRPC
    backend)."""

    def __init__(self, backend) -> None:
        self.ids: dict[str, list[str]] = collections.defaultdict(list)
        self.stages: dict[str, set[str]] = collections.defaultdict(set)
        prefill, generate = backend.prefill, backend.generate

        def record(stage: str, args, kwargs) -> None:
            for a in (*args, *kwargs.values()):
                rid = getattr(a, "request_id", None)
                if isinstance(rid, str) and not isinstance(a, str):
                    key = rid.split("-", 1)[0]
                    self.stages[key].add(stage)
                    if rid not in self.ids[key]:
                        self.ids[key].append(rid)

        async def spy_prefill(*args, **kwargs):
            record("prefill", args, kwargs)
            return await prefill(*args, **kwargs)

        def spy_generate(*args, **kwargs):
            record("decode", args, kwargs)
            return generate(*args, **kwargs)

        backend.prefill, backend.generate = spy_prefill, spy_generate

    def num_retried(self) -> int:
        """HTTP requests with an engine request re-submitted by the gateway's failover."""
        return sum(any("-retry" in i for i in ids) for ids in self.ids.values())


async def operator_abort(cluster: Cluster, engine_ids: list[str]) -> None:
    """Abort RPCs to both services (an id a service does not know is ignored there)."""
    req = pb.AbortRequest(request_ids=engine_ids)
    await asyncio.gather(cluster.prefill_stub.Abort(req, timeout=RPC_TIMEOUT),
                         cluster.decode_stub.Abort(req, timeout=RPC_TIMEOUT))


@dataclass
class PoolAudit:
    states: tuple
    index_ok: bool | None

    @property
    def blocks_leaked(self) -> int:
        return sum(s.num_used_blocks + s.num_pinned_blocks for s in self.states)

    def problems(self) -> list[str]:
        out = []
        for s in self.states:
            if s.num_used_blocks or s.num_pinned_blocks or s.num_running or s.num_waiting:
                out.append(f"{s.role}: used {s.num_used_blocks} pinned {s.num_pinned_blocks} "
                           f"running {s.num_running} waiting {s.num_waiting}")
            if not s.invariants_ok:
                out.append(f"{s.role}: invariants broken: {s.invariants_error}")
        if self.index_ok is False:
            out.append("Redis does not match the instances' caches")
        return out


async def audit_pools(cluster: Cluster, timeout: float = 30.0) -> PoolAudit:
    """Wait (bounded) for both pools to drain, then check invariants and the Redis index."""
    states = await wait_leak_free(cluster, timeout)
    index_ok = await index_matches(cluster, timeout) if cluster.index is not None else None
    return PoolAudit(states, index_ok)
