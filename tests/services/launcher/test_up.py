"""`pdserve up` as a user runs it: a subprocess on free ports that becomes healthy, answers a
greedy chat completion through the official `openai` client, survives a decode process
killed with SIGKILL (the launcher starts it again; the gateway answers meanwhile), and on
SIGTERM stops every child process it started and closes every port it opened."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

STARTUP_TIMEOUT = 400.0
"""Generous: the machine is shared, and two engines load the model at once on 2 cores."""
RESTART_BOUND = 120.0
"""Seconds from kill -9 of decode-0 until the gateway's /health is 200 again."""
API_KEY = "sk-launcher-test"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server is not installed (apt-get install redis-server)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (tells a live process from a reused pid); None if gone
    or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of `root`."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        start = _proc_start_time(pid)
        if start is not None:
            out[pid] = start
        todo.extend(parents.get(pid, []))
    return out


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _wait_for(predicate, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not predicate():
        assert proc.poll() is None, f"pdserve up exited early:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"{what} timed out:\n{log.read_text()[-6000:]}"
        time.sleep(0.5)


def _health_ok(url: str) -> bool:
    return _health_status(url) == 200


def _health_status(url: str) -> int | None:
    """The HTTP status, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _child_running(parent: int, needle: str) -> int:
    """The pid of `parent`'s one child whose command line contains `needle`."""
    found = []
    for pid in _descendants(parent):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == parent and needle in cmdline:
            found.append(pid)
    assert len(found) == 1, (needle, found)
    return found[0]


def _chat(client) -> str:
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    return resp.choices[0].message.content


def _kill_decode_and_recover(proc: subprocess.Popen, log: Path, url: str, client) -> float:
    """SIGKILL decode-0; the launcher must keep running and start it again, the gateway must
    answer /health all along (503 while no decode serves) and serve a chat afterwards.
    Returns seconds from the kill until /health is 200 again."""
    decode = _child_running(proc.pid, "serve decode")
    os.kill(decode, signal.SIGKILL)
    killed = time.monotonic()
    seen: set[int | None] = set()
    while True:
        ready = "decode-0 is ready again" in log.read_text()
        status = _health_status(url + "/health")
        seen.add(status)
        if ready and status == 200:
            break
        assert proc.poll() is None, f"pdserve up exited:\n{log.read_text()[-6000:]}"
        assert time.monotonic() - killed < RESTART_BOUND, \
            f"/health not 200 {RESTART_BOUND:g} s after the kill:\n{log.read_text()[-6000:]}"
        time.sleep(0.2)
    took = time.monotonic() - killed
    assert None not in seen, f"the gateway stopped answering: {seen}"
    assert seen <= {200, 503}, seen
    text = log.read_text()
    assert "decode-0 exited unexpectedly with code -9; restarting it in 1 s" in text, text
    assert "stopping everything" not in text, text
    new = _child_running(proc.pid, "serve decode")
    assert new != decode
    answer = _chat(client)
    assert "Paris" in answer, answer
    return took


def test_up_serves_openai_chat_survives_a_decode_kill_and_stops_cleanly(model_path, tmp_path):
    import openai

    port = _free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve.services.cli", "up", "--port", str(port),
           "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--max-num-seqs", "8",
           "--api-key", API_KEY, "--shutdown-timeout", "60",
           "--startup-timeout", str(STARTUP_TIMEOUT)]
    # The prefill dies on its first start (a test hook): `up` starts it again and comes up.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
           "PDSERVE_TEST_CRASH_ONCE": f"prefill:{tmp_path / 'prefill-crashed'}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _health_ok(url + "/health"), proc, log, "gateway /health")
        _wait_for(lambda: "Stop with Ctrl-C." in log.read_text(), proc, log, "ready banner")
        text = log.read_text()
        assert "prefill-0 exited unexpectedly with code 3 before it was ready; restarting " \
               "it in 1 s (restart 1 in a row)" in text, text
        assert "| test hook PDSERVE_TEST_CRASH_ONCE: this prefill exits" in text, text
        banner = text[text.index("pdserve is ready"):]
        ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", banner)}
        assert port in ports and len(ports) == 6, banner  # gateway, redis, 2 gRPC, 2 metrics
        assert f"curl {url}/v1/chat/completions" in banner
        children = _descendants(proc.pid)
        assert len(children) >= 4, children  # redis, prefill-0, decode-0, gateway

        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=300,
                               max_retries=0)
        answer = _chat(client)
        assert "Paris" in answer, answer
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0,
                          timeout=60).models.list()

        took = _kill_decode_and_recover(proc, log, url, client)
        print(f"decode-0 kill -9 -> /health 200 in {took:.1f} s")
        children.update(_descendants(proc.pid))

        # SIGTERM drains: a stream in flight finishes, a new request gets 503 (vLLM's
        # --shutdown-timeout drain: the port stays open, not refused), then everything exits
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Count from one to one hundred."}])
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 20
        while refused is None and time.monotonic() < deadline:
            try:
                client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", max_tokens=1,
                    messages=[{"role": "user", "content": "Hi"}])
            except openai.APIStatusError as e:
                refused = e
            time.sleep(0.05)
        assert refused is not None and refused.status_code == 503, refused
        assert refused.body["type"] == "server_shutdown", refused.body
        assert refused.response.headers["connection"] == "close"
        chunks = [first, *stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks
                   if c.choices) >= 40
        assert proc.wait(timeout=180) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
            proc.wait()
    left = {pid for pid, start in children.items() if _proc_start_time(pid) == start}
    assert not left, f"still running after pdserve up exited: {sorted(left)}"
    still_open = sorted(p for p in ports if _port_open(p))
    assert not still_open, f"ports still open: {still_open}"
    stopped = [line for line in log.read_text().splitlines() if "stopped:" in line]
    assert stopped and "redis exit 0" in stopped[-1] and "prefill-0 exit 0" in stopped[-1] \
        and "decode-0 exit 0" in stopped[-1], stopped


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "100000"],
     "error: max_model_len=100000 exceeds the model's max_position_embeddings"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "error: speculative_config.num_speculative_tokens"),
    (["--speculative-config", '{"model": "/nonexistent/draft", "num_speculative_tokens": 2}'],
     "error: speculative_config.model: cannot read the draft '/nonexistent/draft'"),
    (["--kv-cache-memory", "4TiB"], "error: this plan needs about"),
    (["--kv-cache-memory=-1G"], "error: kv_cache_memory: '-1G' is not a size in bytes > 0"),
    (["--kv-cache-memory", "inf"], "error: kv_cache_memory: 'inf' is not a size in bytes > 0"),
], ids=["max_model_len", "spec_k_0", "spec_no_draft", "kv_past_the_machine", "kv_negative",
        "kv_infinite"])
def test_up_refuses_a_bad_engine_flag_before_starting_anything(model_path, flags, message):
    """The engines' own configuration check runs in the launcher first (the speculative
    config and its draft's config.json too): one line and exit 2, with no child started and
    no traceback (a decode restarted forever on a bad --speculative-config before)."""
    port = _free_port()
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "up",
                           "--model", model_path, "--port", str(port), *flags],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert message in out, out
    assert "Traceback" not in out and "[gateway]" not in out and "[redis]" not in out
