"""--advertise-address: given, derived from a specific bind address, or (bind 0.0.0.0) this
host's address on its route to Redis, skipping loopback answers."""

from __future__ import annotations

import socket

import pytest

from pdserve.services.common import advertise
from pdserve.services.common.advertise import advertise_address, split_host_port
from pdserve.services.common.config import ServiceConfig


@pytest.mark.parametrize(("given", "expected"), [
    ("10.1.2.3", "10.1.2.3:50051"),
    ("10.1.2.3:7000", "10.1.2.3:7000"),
    ("decode-0.decode.svc", "decode-0.decode.svc:50051"),
    ("fd00::5", "[fd00::5]:50051"),
    ("[fd00::5]", "[fd00::5]:50051"),
    ("[fd00::5]:7000", "[fd00::5]:7000"),
])
def test_a_given_address_is_used_and_a_bare_host_gets_the_bound_port(given, expected):
    assert advertise_address(given, "0.0.0.0", 50051) == expected


def test_a_bad_port_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--advertise-address"):
        advertise_address("host:http", "0.0.0.0", 1)


def test_a_specific_bind_address_is_advertised_as_itself():
    assert advertise_address("", "10.0.0.7", 9) == "10.0.0.7:9"
    assert advertise_address("", "::1", 9) == "[::1]:9"


def test_wildcard_bind_takes_the_source_address_of_the_route_to_redis(monkeypatch):
    seen = []

    def route(target):
        seen.append(target)
        return "10.77.0.11" if target == ("redis.example", 6380) else None

    monkeypatch.setattr(advertise, "_route_source", route)
    config = ServiceConfig("decode", host="0.0.0.0",
                           redis_url="redis://redis.example:6380/0")
    assert config.resolve_address(50052) == "10.77.0.11:50052"
    assert seen[0] == ("redis.example", 6380)


def test_loopback_answers_are_skipped(monkeypatch):
    monkeypatch.setattr(advertise, "_route_source",
                        lambda target: "127.0.0.1" if target[0] == "localhost" else "192.168.5.5")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert advertise.reachable_host("redis://localhost:6379/0") == "192.168.5.5"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "172.18.0.4")
    assert advertise.reachable_host("redis://localhost:6379/0") == "172.18.0.4"
    monkeypatch.setattr(advertise, "_route_source", lambda target: None)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert advertise.reachable_host(None) == socket.gethostname()


def test_the_real_route_to_a_local_redis_is_loopback_and_skipped():
    """On this machine: whatever comes back is not a loopback address (or is the hostname)."""
    host = advertise.reachable_host("redis://127.0.0.1:6379/0")
    assert not host.startswith("127.") and host != "::1"


def test_split_host_port():
    assert split_host_port("a:1") == ("a", 1)
    assert split_host_port("a") == ("a", None)
    assert split_host_port("::1") == ("::1", None)
    assert split_host_port("[::1]:5") == ("::1", 5)
