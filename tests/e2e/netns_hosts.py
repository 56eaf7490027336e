"""Separate "hosts" on one machine for tests: Linux network namespaces on a private bridge.

    reason = cannot_make_hosts()             # None, or why not (a skip reason)
    net = HostNetwork.create(tmp_dir)        # bridge pdmh<pid>b, 10.77.<k>.1/24 (the test's side)
    h = net.add_host("da", 21)               # namespace pdmh<pid>-da, veth onto the bridge,
                                             # 10.77.<k>.21 on its eth0, its own HOME and TMPDIR
    p = h.start(["redis-server", ...])       # runs inside the namespace under its own UTS
                                             # hostname ("da"); logs to <home>/../<name>.log
    h.cut(); h.restore()                     # the bridge side of its link down / up
    leftovers = net.close()                  # every process killed, namespaces, veths and the
                                             # bridge removed; returns what could not be removed

Each host's HOME is its own directory (copy what it needs into it: nothing is shared through
the filesystem but the code). Namespaces and bridges left behind by a run that was killed
(their pid is gone) are removed by the next `create`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "pdmh"
_STALE = re.compile(rf"^{PREFIX}(\d+)(?:-|b$)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def cannot_make_hosts() -> str | None:
    """Why network namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces and a bridge need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


def remove_stale() -> None:
    """Remove namespaces and bridges of earlier runs whose test process is gone."""
    for ns in _namespaces():
        m = _STALE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace(ns)
    for link in _links():
        m = _STALE.match(link)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", link, check=False)


@dataclass
class HostProcess:
    host: Host
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM (the graceful stop); `wait()` for the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    veth: str
    """The bridge side of its link (in the test's namespace): `cut` takes it down."""
    home: Path
    processes: list[HostProcess] = field(default_factory=list)

    def start(self, argv: list[str], env: dict[str, str] | None = None,
              log_name: str | None = None) -> HostProcess:
        """Run `argv` inside the namespace, under the UTS hostname `name`, with HOME and
        TMPDIR in this host's directory (plus `env`; no proxy variables)."""
        log_path = self.home.parent / f"{log_name or self.name}.log"
        base = {k: v for k, v in os.environ.items()
                if not k.lower().endswith("_proxy") and not k.startswith("PDSERVE_")}
        base.update(HOME=str(self.home), TMPDIR=str(self.home / "tmp"))
        base.pop("XDG_CACHE_HOME", None)
        cmd = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c",
               'hostname "$0" && exec "$@"', self.name, *argv]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.home,
                                    env={**base, **(env or {})})
        p = HostProcess(self, argv, log_path, proc)
        self.processes.append(p)
        return p

    def cut(self) -> None:
        """Partition the host: its link to the bridge goes down (no RST, no FIN)."""
        _ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        _ip("link", "set", self.veth, "up")


@dataclass
class HostNetwork:
    tag: str
    subnet: str
    """The first three octets, e.g. "10.77.42"."""
    bridge: str
    root: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    _iptables_rule: list[str] | None = None

    @classmethod
    def create(cls, root: Path) -> HostNetwork:
        remove_stale()
        pid = os.getpid()
        tag = f"{PREFIX}{pid}"
        routes = _ip("route", "show", check=False).stdout
        octet = 20 + pid % 200
        while f"10.77.{octet}.0/24" in routes:
            octet = 20 + (octet - 19) % 200
        net = cls(tag, f"10.77.{octet}", f"{tag}b", Path(root))
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.subnet}.1/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            net._allow_bridged_traffic()
        except BaseException:
            net.close()
            raise
        return net

    @property
    def gateway_address(self) -> str:
        """The test's own address on the bridge."""
        return f"{self.subnet}.1"

    def _allow_bridged_traffic(self) -> None:
        """Where bridged frames pass iptables (br_netfilter, e.g. after dockerd set FORWARD
        to DROP), accept ours."""
        knob = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if knob.exists() and knob.read_text().strip() == "1" and shutil.which("iptables"):
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
                self._iptables_rule = rule

    def add_host(self, name: str, last_octet: int) -> Host:
        i = len(self.hosts)
        ns, veth, peer = f"{self.tag}-{name}", f"{self.tag}v{i}", f"{self.tag}p{i}"
        address = f"{self.subnet}.{last_octet}"
        home = self.root / name / "home"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        host = self.hosts[name] = Host(name, ns, address, veth, home)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        for args in (("link", "set", peer, "name", "eth0"),
                     ("addr", "add", f"{address}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
            _ip("-n", ns, *args)
        return host

    def close(self) -> list[str]:
        """Kill every process, remove the namespaces, veths and bridge; what is left over."""
        for host in self.hosts.values():
            for p in host.processes:
                p.kill()
            _kill_namespace(host.namespace)
            _ip("link", "del", host.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._iptables_rule:
            subprocess.run(["iptables", "-D", *self._iptables_rule], capture_output=True)
            self._iptables_rule = None
        deadline = time.monotonic() + 10
        while True:
            left = [n for n in _namespaces() if n.startswith(self.tag + "-")]
            left += [link for link in _links() if link.startswith(self.tag)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)
