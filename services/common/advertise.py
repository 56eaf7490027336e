"""The address other hosts reach an instance at: what it registers in Redis and puts in KV
handles (`--advertise-address`), resolved once at start.

    --advertise-address HOST[:PORT]   as given (a bare HOST gets the bound port; in a pod:
                                      PDSERVE_ADVERTISE_ADDRESS=$(POD_IP))
    --host 10.0.0.5                   a specific bind address is reachable as itself
    --host 0.0.0.0 (every interface)  this host's address on the network others share:
       1. the source address of this host's route to Redis (the registry every instance
          and gateway reaches, so its network is theirs: a pod or container IP);
       2. the address the hostname resolves to (/etc/hosts in containers and pods);
       3. the source address of the default route;
       4. the hostname itself.
       Loopback answers are skipped: 127.x would send a peer back to itself.

No packet is sent: a connected UDP socket only asks the kernel which source address its
route would use.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
_DEFAULT_ROUTE_PROBES = (("192.0.2.1", 9), ("2001:db8::1", 9))
"""TEST-NET-1 / documentation addresses: only the routing table is consulted."""


def join_host_port(host: str, port: int) -> str:
    """host:port, with an IPv6 literal in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int | None]:
    """("host", port or None) of `host`, `host:port`, `[v6]`, `[v6]:port` or a bare v6."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, None


def advertise_address(advertise: str, bind_host: str, bound_port: int,
                      redis_url: str | None = None) -> str:
    """host:port other hosts reach this instance at (the module docstring's order).

    Raises:
        ValueError: `advertise` has a port that is not a number.
    """
    if advertise:
        try:
            host, port = split_host_port(advertise.strip())
        except ValueError:
            raise ValueError(f"--advertise-address {advertise!r}: expected HOST or HOST:PORT "
                             "(a number)") from None
        return join_host_port(host, bound_port if port is None else port)
    if bind_host not in WILDCARD_HOSTS:
        return join_host_port(bind_host, bound_port)
    return join_host_port(reachable_host(redis_url), bound_port)


def reachable_host(redis_url: str | None = None) -> str:
    """This host's address on the network it shares with Redis (steps 1-4 above)."""
    target = _redis_target(redis_url)
    candidates = [_route_source(target) if target else None, _hostname_address(),
                  *(_route_source(probe) for probe in _DEFAULT_ROUTE_PROBES)]
    for address in candidates:
        if address and not is_loopback(address):
            return address
    return socket.gethostname()


def _redis_target(redis_url: str | None) -> tuple[str, int] | None:
    if not redis_url:
        return None
    parts = urlsplit(redis_url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return None  # unix:// and the like: Redis is on this host
    try:
        return parts.hostname, parts.port or 6379
    except ValueError:
        return None


def _route_source(target: tuple[str, int]) -> str | None:
    """The source address of this host's route to `target` (None when there is none)."""
    try:
        infos = socket.getaddrinfo(target[0], target[1], type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def _hostname_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or with a zone too) or localhost: only this machine."""
    host = host.strip("[]").split("%")[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
