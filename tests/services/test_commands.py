"""`python -m services.prefill` as a real process: health goes SERVING once loaded, the
Prometheus endpoint answers, SIGTERM drains and exits 0; `pdserve healthcheck` exit codes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from pdserve.services.cli import build_parser
from pdserve.services.cli import main as cli_main
from tests.services.helpers import free_port


def test_serve_commands_are_registered():
    parser = build_parser()
    ns = parser.parse_args(["serve", "decode", "--port", "1234", "--cpu-cores", "0-1",
                            "--max-waiting-requests", "8", "--redis-url", "redis://r:6379"])
    assert (ns.serve_role, ns.port, ns.cpu_cores, ns.max_waiting_requests) == \
        ("decode", 1234, "0-1", 8)
    ns = parser.parse_args(["serve", "prefill", "--kv-pin-ttl", "5"])
    assert ns.kv_pin_ttl == 5.0 and ns.port == 50051


def test_healthcheck_of_nothing_fails():
    assert cli_main(["healthcheck", "--address", f"127.0.0.1:{free_port()}",
                     "--timeout", "0.5"]) == 1


def test_prefill_process_serves_and_drains_on_sigterm(model_path, tmp_path):
    port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "prefill.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.prefill", "--host", "127.0.0.1",
         "--port", str(port),
         "--metrics-port", str(metrics_port), "--model", model_path,
         "--kv-cache-memory", "64MiB", "--grace-period", "5"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while cli_main(["healthcheck", "--address", f"127.0.0.1:{port}",
                        "--timeout", "1"]) != 0:
            assert proc.poll() is None, (tmp_path / "prefill.log").read_text()
            assert time.monotonic() < deadline, "never became SERVING"
            time.sleep(0.5)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert 'pdserve_kv_blocks{model_name="SmolLM2-135M-Instruct",state="free"}' in text
        # the memory it holds, by kind (issue 38): the 64 MiB pool, SmolLM2's 538 MB of
        # weights held once (mapped from the host's weight cache, or packed here)
        memory = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'pdserve_engine_memory_bytes\{kind="(\w+)",model_name="[^"]+"\} (\S+)', text)}
        assert 0.9 * 64 * 2**20 <= memory["kv_cache"] <= 64 * 2**20, memory
        weights = sum(n for kind, n in memory.items() if kind != "kv_cache")
        assert 530e6 < weights, memory
        if memory["mapped_weights"]:  # the panels (AVX-512): once, nothing beside them
            assert weights < 545e6, memory
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in (tmp_path / "prefill.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
