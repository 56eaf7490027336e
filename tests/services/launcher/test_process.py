"""ChildProcess: prefixed output, stopping a whole process group, and children that die with
a launcher killed by SIGKILL (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.services.launcher.process import ChildProcess, LogSink


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        # NOTE: ProcessLookupError when the process is reaped between open() and read().
        return True


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_output_lines_are_prefixed():
    out = io.StringIO()
    child = ChildProcess("decode-0", [sys.executable, "-c", (
        "import sys; print('hello'); print('oops', file=sys.stderr); "
        "sys.stdout.write('10%\\r50%\\r100%\\n')")], os.environ, LogSink(out, width=9))
    child.start()
    assert child.wait(60) == 0
    child.join_output()
    lines = out.getvalue().splitlines()
    assert sorted(lines) == sorted(["[decode-0]  hello", "[decode-0]  oops",
                                    "[decode-0]  100%"])


def test_start_again_after_an_exit_only():
    out = io.StringIO()
    child = ChildProcess("prefill-0", [sys.executable, "-c", (
        "import os, sys, time; print('run', os.getpid(), flush=True); "
        "time.sleep(float(os.environ['NAP']))")], {**os.environ, "NAP": "300"}, LogSink(out))

    def wait_lines(n: int) -> None:
        deadline = time.monotonic() + 60
        while len(out.getvalue().splitlines()) < n:
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.05)

    child.start()
    first = child.pid
    try:
        wait_lines(1)
        with pytest.raises(RuntimeError, match="prefill-0 is still running"):
            child.start()
        child.kill()
        assert child.wait(30) == -signal.SIGKILL
        child.start()  # same argv and env: sleeps 300 s again
        wait_lines(2)
        assert child.pid != first and child.wait(0.1) is None
    finally:
        child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.join_output()
    assert out.getvalue().splitlines() == [f"[prefill-0] run {first}",
                                           f"[prefill-0] run {child.pid}"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_terminate_and_kill_reach_the_whole_group():
    out = io.StringIO()
    # `sleep` starts before the trap (ignored signals are inherited); the shell ignores TERM.
    script = "sleep 300 & trap '' TERM; echo $!; wait; while :; do sleep 0.2; done"
    child = ChildProcess("x", ["sh", "-c", script], os.environ, LogSink(out))
    child.start()
    deadline = time.monotonic() + 30
    while "]" not in out.getvalue():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(out.getvalue().split()[-1])
    try:
        child.terminate()  # reaches `sleep` although the shell ignores it
        assert _wait_gone(grandchild)
        assert child.wait(0.5) is None
    finally:
        child.kill()
    assert child.wait(30) == -signal.SIGKILL


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_children_die_with_a_killed_launcher(tmp_path):
    launcher = textwrap.dedent("""
        import os, sys, time
        from pdserve.services.launcher.process import ChildProcess, LogSink
        child = ChildProcess("sleep", ["sleep", "300"], os.environ, LogSink(sys.stderr))
        child.start()
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE,
                            text=True)
    try:
        pid = int(proc.stdout.readline())
        assert not _gone(pid)
        proc.kill()
        proc.wait(30)
        assert _wait_gone(pid), "the child outlived its SIGKILLed launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
