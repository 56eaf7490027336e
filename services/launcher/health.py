"""Health probes of the launched children: Redis PING, gRPC health (SERVING), HTTP 200.

Each probe answers True / False within about `timeout` seconds and never raises.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from pdserve.services.launcher.plan import Probe


def redis_ping(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


class Prober:
    """Runs a Probe of any kind; gRPC health checks (the standard grpc.health.v1 service)
    go over one channel per address, reused across polls."""

    def __init__(self) -> None:
        self._channels: dict = {}

    def check(self, probe: Probe) -> bool:
        if probe.kind == "redis":
            return redis_ping(probe.target)
        if probe.kind == "grpc":
            return self.grpc_serving(probe.target)
        return http_ok(probe.target)

    def grpc_serving(self, address: str, timeout: float = 2.0) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from pdserve.services.common.auth import internal_sync_channel

        channel = self._channels.get(address)
        if channel is None:  # its reconnect backoff finds a restarted engine within ~2 s
            channel = self._channels[address] = internal_sync_channel(address)
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
