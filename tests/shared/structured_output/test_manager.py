"""StructuredOutputManager with a fake backend: the compile cache (LRU, off the caller's
thread, failures), matcher replay, bitmask rows, token acceptance and termination."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.shared.request import Request
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.structured_output.manager import StructuredOutputManager
from pdserve.shared.structured_output.params import StructuredOutputsParams

VOCAB = 8
EOS = 7


class FakeMatcher:
    """Accepts exactly the token sequence `target`, then EOS (which terminates it)."""

    def __init__(self, target: list[int]) -> None:
        self.target = target
        self.pos = 0
        self.terminated = False

    def allowed(self) -> set[int]:
        return {self.target[self.pos]} if self.pos < len(self.target) else {EOS}

    def accept_token(self, token_id: int) -> bool:
        if self.terminated or token_id not in self.allowed():
            return False
        if token_id == EOS:
            self.terminated = True
        self.pos += 1
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = False
        bitmask[row, list(self.allowed())] = True

    def is_terminated(self) -> bool:
        return self.terminated


class FakeBackend:
    """A "regex" is a comma-separated token sequence; "bad" does not compile."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.compiled: list[str] = []
        self.threads: set[str] = set()

    def compile(self, params: StructuredOutputsParams) -> list[int]:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        self.compiled.append(params.spec)
        if params.spec == "bad":
            raise ValueError("invalid regex: bad")
        return [int(t) for t in params.spec.split(",")]

    def new_matcher(self, compiled: list[int]) -> FakeMatcher:
        return FakeMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.ones(num_rows, VOCAB, dtype=torch.bool)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(~bitmask[index], float("-inf"))


def regex(spec: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=spec)


def request(rid: str, spec: str | None, output: list[int] | None = None) -> Request:
    params = SamplingParams(max_tokens=8, structured_outputs=regex(spec) if spec else None)
    return Request(rid, [1, 2], params, eos_token_id=EOS, output_token_ids=list(output or []))


@pytest.fixture
def manager():
    m = StructuredOutputManager(FakeBackend(), cache_size=2)
    yield m
    m.close()


def test_compiles_once_per_spec_in_a_pool_thread(manager):
    a = manager.grammar(regex("1,2")).result(5)
    b = manager.grammar(regex(" 1,2".strip())).result(5)
    assert a is b and manager.num_compiles == 1 and manager.num_cache_hits == 1
    assert manager.backend.threads == {t for t in manager.backend.threads
                                       if t.startswith("grammar-compile")}
    assert len(manager.compile_seconds) == 1


def test_cache_is_lru_and_bounded(manager):
    for spec in ("1", "2", "1", "3"):  # "2" is the least recently used when "3" arrives
        manager.grammar(regex(spec)).result(5)
    manager.grammar(regex("1")).result(5)
    assert manager.backend.compiled == ["1", "2", "3"]
    manager.grammar(regex("2")).result(5)
    assert manager.backend.compiled == ["1", "2", "3", "2"]


def test_a_slow_compile_does_not_block_the_caller():
    gate = threading.Event()
    m = StructuredOutputManager(FakeBackend(gate))
    try:
        future = m.grammar(regex("4"))  # returns at once, the compile waits for the gate
        assert not future.done()
        gate.set()
        assert future.result(5) == [4]
    finally:
        m.close()


def test_compile_failure_is_a_value_error(manager):
    with pytest.raises(ValueError, match="invalid regex"):
        manager.init_request(request("r", "bad"))
    with pytest.raises(ValueError, match="invalid regex"):
        asyncio.run(manager.wait_for_grammar(regex("bad")))


def test_wait_for_grammar_times_out_without_cancelling_the_compile():
    gate = threading.Event()
    m = StructuredOutputManager(FakeBackend(gate), compile_timeout=0.05)
    try:
        with pytest.raises(ValueError, match="did not compile within"):
            asyncio.run(m.wait_for_grammar(regex("5")))
        gate.set()
        assert m.grammar(regex("5")).result(5) == [5]  # the cached compile went on
    finally:
        m.close()


def test_replay_rebuilds_the_state_and_refuses_a_foreign_token(manager):
    r = request("r", "3,4,5", output=[3, 4])
    manager.init_request(r)
    assert r.structured_output.matcher.pos == 2
    with pytest.raises(ValueError, match="output_token_ids: token 6 at position 1"):
        manager.init_request(request("s", "3,4,5", output=[3, 6]))
    unguided = request("u", None)
    manager.init_request(unguided)
    assert unguided.structured_output is None


def test_bitmask_touches_only_guided_rows_then_tokens_advance_to_termination(manager):
    guided, plain = request("g", "3"), request("p", None)
    for r in (guided, plain):
        manager.init_request(r)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    manager.apply_bitmask(logits, [plain, guided])
    assert torch.equal(logits[0], before[0])
    assert torch.isfinite(logits[1]).tolist() == [i == 3 for i in range(VOCAB)]
    manager.accept_tokens([plain, guided], [5, 3])
    assert not guided.structured_output.is_terminated
    manager.accept_tokens([guided], [EOS])
    assert guided.structured_output.is_terminated
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    manager.apply_bitmask(logits, [guided])  # a terminated matcher masks nothing
    assert torch.equal(logits, before)


def test_a_refused_sample_stops_the_request(manager):
    r = request("r", "3,4")
    manager.init_request(r)
    manager.accept_tokens([r], [6])
    assert r.structured_output.is_failed and r.structured_output.is_terminated
