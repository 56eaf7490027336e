"""A fake split engine: real grpc.aio prefill and decode servers on port 0 with a scripted
"model", so the gateway's gRPC path runs for real in unit tests.

The model: output position p of a request is token `script[(offset + p) % len(script)]`,
where `script` is SCRIPT_TEXT tokenized by the real tokenizer followed by EOS; offset is 0
when greedy, derived from the seed when seeded, and from the request id otherwise. It honours
max_tokens (counting the prefill's first token), EOS (unless ignore_eos), stop_token_ids and
min_tokens by the engine's rules (shared/stop_rules.py), returns deterministic logprobs that
differ per position, records every call, Abort and cancelled stream, and can be told to fail
with a gRPC status (at once, or a decode stream after some tokens: `Recorder.break_after`).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.services.proto import engine_pb2, engine_pb2_grpc
from pdserve.shared.stop_rules import at_length_limit, check_stop_token

SCRIPT_TEXT = ("Hello there! Counting: 1 2 3 4 5 6 7 8 9 10. Café 🙂 and 你好世界, "
               "UNO DUE TRE. The end.")
MODEL = "fake-model"


@dataclass
class FakeModel:
    script: list[int]
    eos_token_id: int
    vocab_size: int
    max_model_len: int = 2048
    block_size: int = 16

    def _offset(self, request_id: str, params: engine_pb2.SamplingParams) -> int:
        if params.temperature == 0:
            return 0
        if params.HasField("seed"):
            return (params.seed * 7) % len(self.script)
        return random.Random(request_id).randrange(len(self.script))

    def token(self, request_id: str, params: engine_pb2.SamplingParams, p: int) -> int:
        seq = self.script if not params.ignore_eos else self.script[:-1]
        t = seq[(self._offset(request_id, params) + p) % len(seq)]
        if t == self.eos_token_id and p + 1 < params.min_tokens:
            t = self.script[0]
        return t

    def finish(self, params: engine_pb2.SamplingParams, num_prompt: int, token: int,
               count: int) -> int:
        if check_stop_token(params, token, count, self.eos_token_id)[0]:
            return engine_pb2.FINISH_REASON_STOP
        if at_length_limit(params, self.max_model_len, num_prompt, count):
            return engine_pb2.FINISH_REASON_LENGTH
        return engine_pb2.FINISH_REASON_UNSPECIFIED

    def stop_reason(self, params: engine_pb2.SamplingParams, token: int,
                    count: int) -> int | None:
        """The stop_token_ids entry that stops at `token` (None for EOS), as the engine."""
        return check_stop_token(params, token, count, self.eos_token_id)[1]

    def logprobs(self, token: int, p: int, k: int) -> engine_pb2.TokenLogprobs:
        lp = -0.01 - 0.05 * (p % 5)
        top, cand = [token], token
        while len(top) < k:
            cand = (cand + 7919 * (p + 1)) % self.vocab_size
            if cand not in top:
                top.append(cand)
        return engine_pb2.TokenLogprobs(token_id=token, logprob=lp, top_token_ids=top[:k],
                                        top_logprobs=[lp - 0.5 * i for i in range(k)])

    def prompt_logprobs(self, prompt, params: engine_pb2.SamplingParams
                        ) -> list[engine_pb2.TokenLogprobs]:
        """One per prompt token after the first when asked for (scripted as positions
        1000 + index)."""
        if not params.HasField("prompt_logprobs"):
            return []
        return [self.logprobs(t, 1000 + i, params.prompt_logprobs)
                for i, t in enumerate(prompt[1:])]

    def step(self, request_id: str, params: engine_pb2.SamplingParams, num_prompt: int,
             p: int) -> tuple[int, engine_pb2.TokenLogprobs | None, int]:
        t = self.token(request_id, params, p)
        lp = self.logprobs(t, p, params.logprobs) if params.HasField("logprobs") else None
        return t, lp, self.finish(params, num_prompt, t, p + 1)


@dataclass
class Recorder:
    """What one fake instance saw."""

    requests: list = field(default_factory=list)
    request_ids_metadata: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    fail_with: grpc.StatusCode | None = None
    break_after: int | None = None
    """Generate: fail each stream with `break_with` after this many tokens of its own."""
    break_with: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    delay: float = 0.0
    """Seconds before each generated token (Prefill: before answering)."""

    async def enter(self, request, context) -> dict:
        """Record the call; returns its state, where the handler sets "finished" when it
        completes. A call that ends unfinished was cancelled by the client.

        NOTE: `context.cancelled()` reads False in done callbacks (grpcio 1.85), hence the flag.
        """
        self.requests.append(request)
        rid = request.request_id
        call = {"finished": False}

        def on_done(_ctx) -> None:
            self.active.discard(rid)
            if not call["finished"]:
                self.cancelled.append(rid)

        context.add_done_callback(on_done)
        md = dict(context.invocation_metadata() or ())
        self.request_ids_metadata.append(md.get("x-request-id", ""))
        if self.fail_with is not None:
            call["finished"] = True
            await context.abort(self.fail_with, f"fake failure {self.fail_with.name}")
        return call


class FakePrefill(engine_pb2_grpc.PrefillServiceServicer):
    def __init__(self, model: FakeModel, instance_id: str) -> None:
        self.model, self.instance_id, self.address = model, instance_id, ""
        self.rec = Recorder()
        self._seen: set[tuple[int, ...]] = set()

    async def Prefill(self, request, context):
        call = await self.rec.enter(request, context)
        self.rec.active.add(request.request_id)
        await asyncio.sleep(self.rec.delay)
        prompt = tuple(request.prompt_token_ids)
        bs = self.model.block_size
        cached = (len(prompt) - 1) // bs * bs if prompt in self._seen else 0
        self._seen.add(prompt)
        t, lp, finish = self.model.step(request.request_id, request.sampling_params,
                                        len(prompt), 0)
        if finish:
            self.rec.active.discard(request.request_id)
        kv = engine_pb2.KVTransferParams(
            prefill_address=self.address, num_tokens=len(prompt), dtype="float32",
            block_size=bs, model=MODEL)
        call["finished"] = True
        return engine_pb2.PrefillResponse(
            request_id=request.request_id, first_token_id=t, first_logprobs=lp,
            kv_transfer_params=kv, num_cached_tokens=cached, finish_reason=finish,
            stop_reason=self.model.stop_reason(request.sampling_params, t, 1),
            prompt_logprobs=self.model.prompt_logprobs(prompt, request.sampling_params))

    async def ReleaseKV(self, request, context):
        self.rec.released.append(request.request_id)
        self.rec.active.discard(request.request_id)
        return engine_pb2.ReleaseKVResponse(released=True)

    async def Abort(self, request, context):
        self.rec.aborted.extend(request.request_ids)
        self.rec.active.difference_update(request.request_ids)
        return engine_pb2.AbortResponse(aborted_request_ids=list(request.request_ids))

    async def GetState(self, request, context):
        return _state(self.model, self.instance_id, "prefill", self.rec)


class FakeDecode(engine_pb2_grpc.DecodeServiceServicer):
    def __init__(self, model: FakeModel, instance_id: str) -> None:
        self.model, self.instance_id, self.address = model, instance_id, ""
        self.rec = Recorder()
        self.tokens_per_chunk = 1

    async def Generate(self, request, context):
        call = await self.rec.enter(request, context)
        rid, params = request.request_id, request.sampling_params
        self.rec.active.add(rid)
        p, n = len(request.output_token_ids), len(request.prompt_token_ids)
        first = True
        while True:
            chunk = engine_pb2.TokenChunk(request_id=rid)
            if first and not request.HasField("kv_transfer_params"):
                chunk.num_cached_tokens = 0
                chunk.prompt_logprobs.extend(
                    self.model.prompt_logprobs(request.prompt_token_ids, params))
            for _ in range(self.tokens_per_chunk):
                if self.rec.break_after is not None and \
                        p - len(request.output_token_ids) >= self.rec.break_after:
                    call["finished"] = True  # a failure, not a cancel by the client
                    await context.abort(self.rec.break_with, "fake stream broken")
                await asyncio.sleep(self.rec.delay)
                t, lp, finish = self.model.step(rid, params, n, p)
                p += 1
                chunk.token_ids.append(t)
                if lp is not None:
                    chunk.logprobs.append(lp)
                if finish:
                    chunk.finish_reason = finish
                    if (stop_reason := self.model.stop_reason(params, t, p)) is not None:
                        chunk.stop_reason = stop_reason
                    break
            first = False
            call["finished"] = bool(chunk.finish_reason)
            yield chunk
            if chunk.finish_reason:
                return

    async def Abort(self, request, context):
        self.rec.aborted.extend(request.request_ids)
        return engine_pb2.AbortResponse(aborted_request_ids=list(request.request_ids))

    async def SetPaused(self, request, context):  # acknowledged, not honoured
        held = [r for r in request.request_ids if r in self.rec.active]
        return engine_pb2.SetPausedResponse(request_ids=held)

    async def GetState(self, request, context):
        return _state(self.model, self.instance_id, "decode", self.rec)


def _state(model: FakeModel, instance_id: str, role: str, rec: Recorder):
    return engine_pb2.EngineState(instance_id=instance_id, role=role, model=MODEL,
                                  num_running=len(rec.active), max_model_len=model.max_model_len,
                                  block_size=model.block_size, invariants_ok=True)


@dataclass
class FakeCluster:
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    health: dict[str, health.aio.HealthServicer]
    servers: list[grpc.aio.Server]

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return tuple(p.address for p in self.prefills)

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.decodes)

    async def set_serving(self, address: str, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health[address].set("", status)

    async def reset(self) -> None:
        """Forget what was recorded and injected; everyone SERVING again."""
        for servicer in self.prefills + self.decodes:
            servicer.rec = Recorder()
        for p in self.prefills:
            p._seen.clear()
        for d in self.decodes:
            d.tokens_per_chunk = 1
        for address in self.health:
            await self.set_serving(address, True)

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop(None) for s in self.servers))


async def start_fake_cluster(model: FakeModel, num_prefill: int = 1,
                             num_decode: int = 1) -> FakeCluster:
    cluster = FakeCluster([], [], {}, [])
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            server = grpc.aio.server()
            if role == "prefill":
                servicer = FakePrefill(model, f"prefill-{i}")
                engine_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
                cluster.prefills.append(servicer)
            else:
                servicer = FakeDecode(model, f"decode-{i}")
                engine_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
                cluster.decodes.append(servicer)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            servicer.address = f"127.0.0.1:{port}"
            await server.start()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            cluster.health[servicer.address] = health_servicer
            cluster.servers.append(server)
    return cluster
