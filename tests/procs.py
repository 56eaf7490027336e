"""Real service processes for tests: `pdserve serve prefill|decode` on free loopback ports.

    with ServiceGroup(tmp_path) as group:
        prefill = group.start("prefill", model_path, "--kv-cache-memory", "256MiB")
        decode = group.start("decode", model_path)
        group.wait_serving()             # grpc.health SERVING for all, bounded
        decode.freeze(); decode.resume() # SIGSTOP / SIGCONT (a hung or partitioned peer)
        decode.kill()                    # kill -9
    # every process still running is killed here, also when the test failed

Each process logs to `<log_dir>/<role>-<port>.log` (shown in failure messages).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_DEFAULTS = ("--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                   "--num-threads", "1")
"""Small engines, one compute thread each: several share two cores in tests."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(address: str, timeout: float = 1.0) -> int | None:
    """grpc.health Check("") of `address`: the ServingStatus, None when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
        except grpc.RpcError:
            return None


@dataclass
class ServiceProcess:
    role: str
    port: int
    metrics_port: int
    log_path: Path
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def freeze(self) -> None:
        """SIGSTOP: the process stops answering, its sockets stay open (a hung or partitioned
        peer). `resume()` continues it; `kill()` works on a frozen process too."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a frozen process (no-op for a running one)."""
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (kill -9) and reap."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after `timeout` s; the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.proc.returncode


@dataclass
class ServiceGroup:
    """Starts service processes and always reaps them (a context manager)."""

    log_dir: Path
    processes: list[ServiceProcess] = field(default_factory=list)

    def start(self, role: str, model_path: str, *extra_args: str,
              env: dict[str, str] | None = None) -> ServiceProcess:
        """Launch `python -m services.cli serve <role>` on fresh ports (no Redis unless
        `extra_args` name one); ENGINE_DEFAULTS come first, so `extra_args` override them."""
        port, metrics_port = free_port(), free_port()
        log_path = Path(self.log_dir) / f"{role}-{port}.log"
        cmd = [sys.executable, "-m", "pdserve.services.cli", "serve", role, "--host", "127.0.0.1",
               "--port", str(port), "--metrics-port", str(metrics_port),
               "--model", model_path, *ENGINE_DEFAULTS, *extra_args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                     **(env or {})})
        service = ServiceProcess(role, port, metrics_port, log_path, proc)
        self.processes.append(service)
        return service

    def wait_serving(self, timeout: float = 240.0,
                     processes: list[ServiceProcess] | None = None) -> None:
        """Until every process answers SERVING. Raises AssertionError (with the log) when
        one exits or `timeout` s pass."""
        pending = list(self.processes if processes is None else processes)
        deadline = time.monotonic() + timeout
        while pending:
            for p in list(pending):
                assert p.alive, f"{p.role} on {p.address} exited:\n{p.log_tail()}"
                if health_status(p.address) == health_pb2.HealthCheckResponse.SERVING:
                    pending.remove(p)
            if pending:
                assert time.monotonic() < deadline, \
                    f"{pending[0].role} never became SERVING:\n{pending[0].log_tail()}"
                time.sleep(0.2)

    def close(self) -> None:
        for p in self.processes:
            try:
                p.kill()
            except Exception:  # keep reaping the others
                pass

    def __enter__(self) -> ServiceGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
