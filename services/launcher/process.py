"""ChildProcess: one supervised child in its own process group, with prefixed log lines.

    spawn:  start_new_session (own session and process group, so a terminal's Ctrl-C reaches
            only the launcher, which then stops the children in order) + PR_SET_PDEATHSIG
            (Linux: the kernel SIGKILLs the child if the launcher dies, even by SIGKILL)
    logs:   a thread copies the child's stdout+stderr to ours, each line as `[name] line`
    stop:   terminate() = SIGTERM to the group; kill() = SIGKILL to the group
    again:  start() after the previous run exited: the same argv and env, a new process
            (reaped by poll/wait as before), its lines under the same prefix

NOTE: the death signal belongs to the thread that forked the child: spawn from the main
thread, which lives as long as the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

_PR_SET_PDEATHSIG = 1
_COLORS = ("36", "32", "33", "35", "34", "31", "96", "92", "93", "95")
LAST_LINES = 12
"""Lines of a child's output kept to say why it died (`ChildProcess.last_lines`)."""


def _death_signal_setup() -> Callable[[], None] | None:
    """A preexec_fn arming PR_SET_PDEATHSIG (Linux only; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill)
        # NOTE: the launcher may have died between fork and prctl: then nobody would ever
        # deliver the signal, so leave now.
        if os.getppid() != parent:
            os._exit(1)
    return setup


class LogSink:
    """Writes `[name] line` to a stream, one whole line at a time, colored on a terminal."""

    def __init__(self, stream: TextIO, width: int = 0, color: bool | None = None) -> None:
        self.stream = stream
        self.width = width
        if color is None:
            color = stream.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self._lock = threading.Lock()
        self._colors: dict[str, str] = {}

    def raw(self, text: str) -> None:
        """Unprefixed lines (the ready banner: its curl line must paste as is)."""
        with self._lock:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass  # our stdout is gone (closed pipe): the children still get stopped

    def write(self, name: str, line: str) -> None:
        prefix = f"[{name}]".ljust(self.width + 2)
        if self.color:
            code = self._colors.setdefault(name, _COLORS[len(self._colors) % len(_COLORS)])
            prefix = f"\x1b[{code}m{prefix}\x1b[0m"
        self.raw(f"{prefix} {line}")


class ChildProcess:
    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str],
                 sink: LogSink) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.sink = sink
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._last: deque[str] = deque(maxlen=LAST_LINES)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Start (or, once the previous run has exited, start again). Raises OSError if the
        program cannot be run, RuntimeError if the previous run is still going."""
        if self.proc is not None:
            if self.proc.poll() is None:
                raise RuntimeError(f"{self.name} is still running")
            self.join_output()  # its last lines first
        self._last.clear()
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_death_signal_setup())
        self._pump = threading.Thread(target=self._copy_output, name=f"log-{self.name}",
                                      daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            # A progress bar redraws with \r: show its latest state only.
            line = raw.decode("utf-8", "replace").rstrip("\r\n").rsplit("\r", 1)[-1]
            self._last.append(line)
            self.sink.write(self.name, line)
        self.proc.stdout.close()

    def last_lines(self) -> list[str]:
        """The last LAST_LINES lines the current (or last) run wrote, oldest first; waits
        briefly for the output of a run that has exited to be read to its end."""
        if self.proc is not None and self.proc.poll() is not None:
            self.join_output(1.0)
        return list(self._last)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to the whole group: the service drains and exits."""
        if self.running:
            self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole group, leader or not (stragglers of an exited leader too)."""
        self._signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if still running after `timeout` seconds."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def join_output(self, timeout: float = 2.0) -> None:
        if self._pump is not None:
            self._pump.join(timeout)
