"""What `pdserve up` does before it starts anything: redis-server present (installed when
root, else the exact command printed) and the model resolved without importing torch."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.services.launcher import prereqs
from pdserve.services.launcher.prereqs import SetupError, ensure_model, ensure_redis_server


@pytest.fixture
def no_redis(monkeypatch):
    installed = {"redis-server": None, "apt-get": "/usr/bin/apt-get"}
    monkeypatch.setattr(prereqs.shutil, "which", lambda name: installed.get(name))
    return installed


def test_present_redis_is_used_as_is(monkeypatch):
    monkeypatch.setattr(prereqs.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert ensure_redis_server(print) == "/usr/bin/redis-server"


def test_without_root_the_exact_command_is_printed(no_redis, monkeypatch):
    monkeypatch.setattr(prereqs.os, "geteuid", lambda: 1000)
    with pytest.raises(SetupError, match=r"sudo apt-get install -y redis-server"):
        ensure_redis_server(print)


def test_as_root_debians_package_is_installed(no_redis, monkeypatch):
    monkeypatch.setattr(prereqs.os, "geteuid", lambda: 0)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[:2] == ["apt-get", "install"] and len(calls) > 1:  # works after an update
            no_redis["redis-server"] = "/usr/bin/redis-server"
        return subprocess.CompletedProcess(cmd, 0 if len(calls) > 1 else 100)

    monkeypatch.setattr(prereqs.subprocess, "run", run)
    said: list[str] = []
    assert ensure_redis_server(said.append) == "/usr/bin/redis-server"
    assert calls == [prereqs.INSTALL_REDIS, ["apt-get", "update", "-q"], prereqs.INSTALL_REDIS]
    assert said and "apt-get install -y -q redis-server" in said[0]


def test_model_directory_and_unknown_names(model_path):
    assert ensure_model(model_path, print) == model_path
    with pytest.raises(SetupError, match="not an HF directory"):
        ensure_model("no-such-model", print)
    with pytest.raises(SetupError, match="no such file"):
        ensure_model("/nowhere/x.gguf", print)


def test_served_model_name():
    assert prereqs.served_model_name("SmolLM2-135M-Instruct", "/c/SmolLM2-135M-Instruct",
                                     None) == "SmolLM2-135M-Instruct"
    assert prereqs.served_model_name("/m/llama/", "/m/llama/", None) == "llama"
    assert prereqs.served_model_name("/m/llama", "/m/llama", "mine") == "mine"
