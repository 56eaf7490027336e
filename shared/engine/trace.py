"""A timeline of what an engine does, viewable in Perfetto (ui.perfetto.dev) or chrome://tracing.

Opt-in (`--trace-file PATH`). Every process of a host that is given the same PATH appends
its events to that one file, one JSON object per line, in the Chrome trace event format's
JSON-array form (the closing `]` is optional there, so the file is valid while it grows and
after a crash). Each `os.write` of an O_APPEND file is appended whole, so lines of
different processes never interleave. Timestamps are CLOCK_MONOTONIC microseconds, one clock
for every process of a Linux host: the prefill's steps, the decode's steps and waits, and
the KV transfers line up on one time axis. Engines on other hosts write their own files.

What is recorded (`pid` = the process, `tid` = a track within it):

    track "engine"   step        one per model step: requests, prefill and decode tokens,
                                 threads used (complete event, "X")
                     wait_cores  time parked on the host's core share (`core_share.py`)
                                 while another engine had a shorter prefill or a due decode
    track "kv"       kv_fetch    decode: one request's KV pulled from a prefill instance
                     kv_send     prefill: one FetchKV stream served
    track "loop"     loop_lag    the event loop was late by more than 5 ms (instant, "i")

Cost when off: one `is None` test per step. When on: a dict and a json.dumps per event,
written in batches of ~64 KiB or every 0.5 s.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_FLUSH_BYTES = 64 * 1024
_FLUSH_S = 0.5


def now_us() -> int:
    """CLOCK_MONOTONIC in microseconds (the trace's time base)."""
    return time.monotonic_ns() // 1000


class Tracer:
    """Appends this process's events to a shared Chrome-trace file.

    Args:
        path: the trace file (created with its opening `[` by whichever process is first).
        process_name: how this process is labelled in the viewer (e.g. "decode-0").

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str, process_name: str) -> None:
        self.path = path
        self.pid = os.getpid()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            os.write(fd, b"[\n")
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._fd = fd
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._size = 0
        self._last_flush = time.monotonic()
        self._tids: dict[str, int] = {}
        self._meta("process_name", 0, {"name": process_name})

    def complete(self, name: str, track: str, start_us: int, end_us: int,
                 args: dict[str, Any] | None = None) -> None:
        """A span `[start_us, end_us)` on `track` ("X" event)."""
        self._emit({"name": name, "ph": "X", "ts": start_us, "dur": max(0, end_us - start_us),
                    "pid": self.pid, "tid": self._tid(track)}, args)

    def instant(self, name: str, track: str, args: dict[str, Any] | None = None) -> None:
        """A point in time on `track` ("i" event), now."""
        self._emit({"name": name, "ph": "i", "s": "t", "ts": now_us(), "pid": self.pid,
                    "tid": self._tid(track)}, args)

    def flush(self) -> None:
        """Append what is buffered (one write; safe to call from any thread)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush and close (idempotent)."""
        with self._lock:
            if self._fd < 0:
                return
            self._flush_locked()
            os.close(self._fd)
            self._fd = -1

    # -- internals --------------------------------------------------------------------------

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self._meta("thread_name", tid, {"name": track})
        return tid

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._emit({"name": name, "ph": "M", "pid": self.pid, "tid": tid, "args": args})

    def _emit(self, event: dict[str, Any], args: dict[str, Any] | None = None) -> None:
        if args:
            event["args"] = args
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self._lock:
            if self._fd < 0:
                return
            self._buffer.append(line)
            self._size += len(line)
            if self._size >= _FLUSH_BYTES or time.monotonic() - self._last_flush >= _FLUSH_S:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._buffer and self._fd >= 0:
            os.write(self._fd, "".join(self._buffer).encode())
        self._buffer.clear()
        self._size = 0
        self._last_flush = time.monotonic()


def read_trace(path: str) -> list[dict[str, Any]]:
    """The events of a trace file (the format above), for tests and analysis scripts."""
    text = open(path).read().strip()
    if text.endswith(","):
        text = text[:-1]
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)
