"""The real Launcher supervising small HTTP servers in place of the services: a decode killed
with SIGKILL is reaped and started again (its lines still prefixed, still tied to the
launcher's life), a SIGTERM during the backoff starts nothing, and the gateway's death stops
everything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; PR_SET_PDEATHSIG is Linux")

SERVER = textwrap.dedent("""
    import http.server, os, signal, sys
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    marker = os.environ.get("CRASH_ONCE_" + sys.argv[1])
    if marker and not os.path.exists(marker):  # the first start dies before it is ready
        open(marker, "w").close()
        print("cannot start: the test says so", flush=True)
        sys.exit(3)
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
    print("serving pid", os.getpid(), flush=True)
    server.serve_forever()
""")

LAUNCHER = textwrap.dedent("""
    import json, os, sys
    from pdserve.services.launcher.config import UpConfig
    from pdserve.services.launcher.plan import ChildSpec, Plan, Probe
    from pdserve.services.launcher.process import LogSink
    from pdserve.services.launcher.supervise import Backoff
    from pdserve.services.launcher.up import Launcher
    from pdserve.shared.engine_args import EngineArgs
    server, ports, initial = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    children = tuple(
        ChildSpec(name, (sys.executable, "-c", server, str(port)),
                  Probe("http", f"http://127.0.0.1:{port}/health"), stage=stage,
                  ports=(port,))
        for (name, port), stage in zip(ports.items(), (1, 0)))
    plan = Plan(children, f"http://127.0.0.1:{ports['gateway']}", "redis://unused", "m")
    config = UpConfig(engine_args=EngineArgs(), shutdown_timeout=10, startup_timeout=60)
    sys.exit(Launcher(plan, config, LogSink(sys.stdout, width=8),
                      Backoff(initial=initial)).run())
""")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie left unreaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(parent: int, needle: bytes) -> list[int]:
    """Pids of `parent`'s children whose command line contains `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def _reaped(pid: int, parent: int) -> bool:
    """No longer a process (nor a zombie) under `parent`."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return int(fields[1]) != parent


class Run:
    """One launcher subprocess; its output collected in `log`."""

    def __init__(self, tmp_path: Path, initial_backoff: float, crash_once: str = "") -> None:
        """`crash_once`: the child ("decode-0" or "gateway") whose first start fails."""
        decode, gateway = _free_ports(2)
        self.log = tmp_path / f"launcher-{decode}.log"
        env = dict(os.environ)
        if crash_once:
            port = decode if crash_once == "decode-0" else gateway
            env[f"CRASH_ONCE_{port}"] = str(tmp_path / f"crashed-{port}")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER, SERVER,
                 json.dumps({"decode-0": decode, "gateway": gateway}), str(initial_backoff)],
                stdout=out, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text()

    def wait_line(self, needle: str, count: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.text().count(needle) < count:
            assert time.monotonic() < deadline, f"no {needle!r}:\n{self.text()}"
            time.sleep(0.05)

    def pids(self, name: str) -> list[int]:
        return [int(line.split()[-1]) for line in self.text().splitlines()
                if line.startswith(f"[{name}]") and "serving pid" in line]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def runs(tmp_path):
    started: list[Run] = []
    yield lambda initial, crash_once="": started.append(
        Run(tmp_path, initial, crash_once)) or started[-1]
    for run in started:
        run.close()


def test_a_killed_decode_is_reaped_and_started_again(runs):
    run = runs(0.5)
    run.wait_line("Stop with Ctrl-C.")
    [old] = run.pids("decode-0")
    [gateway] = run.pids("gateway")
    subprocess.run(["kill", "-9", str(old)], check=True)
    run.wait_line("[decode-0] serving pid", count=2)  # the new decode's line, with its prefix
    [_, new] = run.pids("decode-0")
    run.wait_line("[pdserve]  decode-0 is ready again")
    text = run.text()
    # Why it died, as far as its output tells: its last lines, quoted.
    assert f"[pdserve]  decode-0's last 1 log lines:\n[pdserve]    | serving pid {old}\n" \
        in text, text
    assert "[pdserve]  decode-0 exited unexpectedly with code -9; restarting it in 0.5 s " \
           "(restart 1 in a row)" in text, text
    assert "[pdserve]  restarting decode-0" in text
    assert new != old and _alive(new) and _alive(gateway) and run.proc.poll() is None
    assert _reaped(old, run.proc.pid)
    run.proc.kill()  # the restarted child was forked by the main thread: it dies too
    run.proc.wait(30)
    deadline = time.monotonic() + 30
    while _alive(new) or _alive(gateway):
        assert time.monotonic() < deadline, "children outlived their SIGKILLed launcher"
        time.sleep(0.05)


def test_sigterm_during_the_backoff_starts_nothing(runs):
    run = runs(30.0)
    run.wait_line("Stop with Ctrl-C.")
    [old] = run.pids("decode-0")
    [gateway] = run.pids("gateway")
    subprocess.run(["kill", "-9", str(old)], check=True)
    run.wait_line("restarting it in 30 s")
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(20) == 1  # decode-0 ended by SIGKILL: not a clean stop
    text = run.text()
    assert "restarting decode-0" not in text and len(run.pids("decode-0")) == 1, text
    assert "stopped: decode-0 ended by SIGKILL, gateway exit 0" in text, text
    assert not _alive(gateway)


def test_the_gateway_dying_stops_everything(runs):
    run = runs(0.5)
    run.wait_line("Stop with Ctrl-C.")
    [decode] = run.pids("decode-0")
    [gateway] = run.pids("gateway")
    subprocess.run(["kill", "-9", str(gateway)], check=True)
    assert run.proc.wait(20) == 1
    text = run.text()
    assert "gateway exited unexpectedly with code -9; stopping everything" in text, text
    assert "stopped: decode-0 exit 0, gateway ended by SIGKILL" in text, text
    assert not _alive(decode) and len(run.pids("gateway")) == 1


def test_a_decode_dying_before_it_was_ready_is_started_again(runs):
    """The same backoff as a later death; the launcher quotes the child's last lines."""
    run = runs(0.5, crash_once="decode-0")
    run.wait_line("Stop with Ctrl-C.")
    text = run.text()
    assert "[pdserve]  decode-0 exited unexpectedly with code 3 before it was ready; " \
           "restarting it in 0.5 s (restart 1 in a row)" in text, text
    assert "[pdserve]  decode-0's last 1 log lines:\n" \
           "[pdserve]    | cannot start: the test says so\n" in text, text
    assert len(run.pids("decode-0")) == 1 and "stopping everything" not in text
    assert text.index("restarting decode-0") < text.index("pdserve is ready")
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(20) == 0, run.text()


def test_a_gateway_dying_before_it_was_ready_stops_everything(runs):
    run = runs(0.5, crash_once="gateway")
    assert run.proc.wait(30) == 1
    text = run.text()
    assert "[pdserve]  gateway exited unexpectedly with code 3 before it was ready; " \
           "stopping everything" in text, text
    assert "[pdserve]    | cannot start: the test says so" in text, text
    assert "pdserve is ready" not in text


LAUNCHER_WITH_REDIS = textwrap.dedent("""
    import sys
    from pdserve.services.launcher.config import UpConfig
    from pdserve.services.launcher.plan import ChildSpec, Plan, Probe
    from pdserve.services.launcher.process import LogSink
    from pdserve.services.launcher.supervise import Backoff
    from pdserve.services.launcher.up import Launcher
    from pdserve.shared.engine_args import EngineArgs
    server, redis_port, gateway_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    children = (
        ChildSpec("redis", ("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no"),
                  Probe("redis", f"127.0.0.1:{redis_port}"), stage=2, ports=(redis_port,)),
        ChildSpec("gateway", (sys.executable, "-c", server, str(gateway_port)),
                  Probe("http", f"http://127.0.0.1:{gateway_port}/health"), stage=0,
                  ports=(gateway_port,)))
    plan = Plan(children, f"http://127.0.0.1:{gateway_port}",
                f"redis://127.0.0.1:{redis_port}/0", "m")
    config = UpConfig(engine_args=EngineArgs(), shutdown_timeout=10, startup_timeout=60)
    sys.exit(Launcher(plan, config, LogSink(sys.stdout, width=8), Backoff()).run())
""")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_killed_redis_is_started_again_on_its_port(tmp_path):
    """Issue 37: Redis is a cache; SIGKILL restarts it (1 s backoff), the stack goes on."""
    from pdserve.services.launcher.health import redis_ping

    redis_port, gateway_port = _free_ports(2)
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER_WITH_REDIS, SERVER,
                                 str(redis_port), str(gateway_port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "Stop with Ctrl-C." not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        [redis] = _children(proc.pid, b"redis-server")
        os.kill(redis, signal.SIGKILL)
        killed = time.monotonic()
        while not redis_ping(f"127.0.0.1:{redis_port}", 0.2):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - killed < 30, log.read_text()
            time.sleep(0.05)
        back_after = time.monotonic() - killed
        while "redis is ready again" not in log.read_text():
            assert time.monotonic() - killed < 30, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        assert "redis exited unexpectedly with code -9; restarting it in 1 s (restart 1 in " \
               "a row)" in text, text
        assert "stopping everything" not in text and proc.poll() is None
        assert back_after < 5.0, f"Redis answered again {back_after:.1f} s after the kill"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
        assert "stopped: redis exit 0, gateway exit 0" in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
