"""Supervisor decisions with fake children and a fake clock: which deaths restart a child,
after which backoff, when ports are still taken, and which deaths stop everything."""

from __future__ import annotations

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.launcher.config import config_from_args
from pdserve.services.launcher.supervise import RESTARTABLE_ROLES, Backoff, Supervisor


def _config(*argv: str):
    return config_from_args(build_parser().parse_args(["up", *argv]))


class FakeChild:
    def __init__(self, name: str) -> None:
        self.name = name
        self.code: int | None = None
        self.starts = 0
        self.kills = 0
        self.fail_start = False

    def poll(self) -> int | None:
        return self.code

    def start(self) -> None:
        if self.fail_start:
            raise OSError("no such file")
        self.starts += 1
        self.code = None

    def kill(self) -> None:
        self.kills += 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(*names: str, restart: bool = True, busy=None, healthy=None):
    clock, said = Clock(), []
    children = {n: FakeChild(n) for n in names}
    sup = Supervisor([(c, (1000 + i,), n.split("-")[0] in RESTARTABLE_ROLES)
                      for i, (n, c) in enumerate(children.items())],
                     said.append, restart=restart, backoff=Backoff(),
                     busy_ports=busy or (lambda ports: []),
                     healthy=healthy or (lambda child: True), clock=clock)
    return sup, children, clock, said


def test_backoff_doubles_up_to_its_cap():
    assert [Backoff().delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert Backoff(initial=0.5, cap=3).delay(4) == 3


def test_a_dead_decode_is_restarted_after_its_backoff_and_reported_ready():
    health = {"ok": False}
    sup, kids, clock, said = _supervisor("redis", "decode-0", "gateway",
                                         healthy=lambda child: health["ok"])
    decode = kids["decode-0"]
    clock.now = 10.0
    decode.code = -9
    assert sup.tick() is None
    assert said == ["decode-0 exited unexpectedly with code -9; restarting it in 1 s "
                    "(restart 1 in a row)"]
    assert decode.kills == 1  # stragglers of its group
    clock.now = 10.9
    assert sup.tick() is None and decode.starts == 0
    clock.now = 11.0
    assert sup.tick() is None
    assert decode.starts == 1 and said[-1] == "restarting decode-0" and sup.restarts == 1
    clock.now = 30.0
    assert sup.tick() is None and len(said) == 2  # running, not healthy yet
    health["ok"] = True
    clock.now = 31.5
    assert sup.tick() is None
    assert said[-1] == "decode-0 is ready again, 21.5 s after it exited"
    assert sup.tick() is None and len(said) == 3
    assert kids["redis"].starts == kids["gateway"].starts == 0


def test_a_child_that_keeps_dying_backs_off_and_a_long_run_resets_it():
    sup, kids, clock, said = _supervisor("prefill-0")
    prefill = kids["prefill-0"]
    delays = []
    for _ in range(7):
        prefill.code = 1
        sup.tick()
        delays.append(said[-1].split("restarting it in ")[1].split(" s")[0])
        clock.now += 100  # far past the backoff, but the child ran 0 s
        sup.tick()
        assert prefill.code is None
    assert delays == ["1", "2", "4", "8", "16", "30", "30"]
    assert prefill.starts == 7
    clock.now += 60  # up for 60 s: the next death starts the backoff over
    prefill.code = 1
    sup.tick()
    assert said[-1].endswith("restarting it in 1 s (restart 1 in a row)")


@pytest.mark.parametrize("code", [0, -9])
def test_the_gateways_death_stops_everything(code):
    sup, kids, clock, said = _supervisor("redis", "prefill-0", "decode-0", "gateway")
    kids["gateway"].code = code
    assert sup.tick() == f"gateway exited unexpectedly with code {code}; stopping everything"
    assert kids["gateway"].starts == 0


def test_a_dead_redis_is_restarted_like_an_engine():
    """Issue 37: Redis holds a cache; its death must not stop the stack."""
    sup, kids, clock, said = _supervisor("redis", "prefill-0", "decode-0", "gateway")
    kids["redis"].code = -9
    assert sup.tick() is None
    assert said == ["redis exited unexpectedly with code -9; restarting it in 1 s "
                    "(restart 1 in a row)"]
    clock.now = 1.0
    assert sup.tick() is None and kids["redis"].starts == 1
    assert sup.tick() is None
    assert said[-1] == "redis is ready again, 1.0 s after it exited"
    assert [k.starts for k in kids.values()] == [1, 0, 0, 0]


def test_without_restarts_an_engine_death_stops_everything():
    sup, kids, clock, said = _supervisor("decode-0", "decode-1", restart=False)
    kids["decode-1"].code = -9
    assert sup.tick() == "decode-1 exited unexpectedly with code -9; stopping everything"
    clock.now = 100
    assert kids["decode-1"].starts == 0 and said == []


def test_ports_still_in_use_postpone_the_restart():
    busy = {1000: True}
    sup, kids, clock, said = _supervisor(
        "decode-0", busy=lambda ports: [p for p in ports if busy.get(p)])
    decode = kids["decode-0"]
    decode.code = -9
    sup.tick()
    clock.now = 1.0
    sup.tick()
    assert decode.starts == 0
    assert said[-1] == "decode-0: port 1000 still in use; restarting it in 2 s (restart 2 in " \
                       "a row)"
    busy[1000] = False
    clock.now = 2.9
    sup.tick()
    assert decode.starts == 0
    clock.now = 3.0
    sup.tick()
    assert decode.starts == 1


def test_a_child_that_cannot_be_started_is_tried_again():
    sup, kids, clock, said = _supervisor("decode-0")
    decode = kids["decode-0"]
    decode.code = 1
    decode.fail_start = True
    sup.tick()
    clock.now = 1.0
    assert sup.tick() is None
    assert said[-1] == "decode-0 did not start (no such file); restarting it in 2 s " \
                       "(restart 2 in a row)"
    decode.fail_start = False
    clock.now = 3.0
    sup.tick()
    assert decode.starts == 1 and sup.restarts == 1


def test_restart_engines_flag():
    assert _config().restart_engines is True
    assert _config("--no-restart-engines").restart_engines is False
    assert _config("--restart-engines").restart_engines is True
