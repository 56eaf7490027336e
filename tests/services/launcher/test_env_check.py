"""Every PDSERVE_* value is checked before anything starts: a bad one is one line naming the
variable (and the flag it stands for) and exit 2, from `pdserve up` and from each service;
good values and variables that name no flag pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.services.cli import build_parser
from pdserve.services.common.env_check import check_environment, flag_actions

BAD = {
    "PDSERVE_PORT": ("abc", "expected an integer"),
    "PDSERVE_MAX_NUM_SEQS": ("many", "expected an integer (the environment form of "
                                     "--max-num-seqs)"),
    "PDSERVE_KV_CACHE_MEMORY": ("lots", "expected a size"),
    "PDSERVE_ENABLE_PREFIX_CACHING": ("maybe", "expected 1/0, true/false"),
    "PDSERVE_QUANTIZATION": ("int4", "expected one of none, int8"),
    "PDSERVE_GRPC_KEEPALIVE_S": ("-1", "expected a number > 0"),
    "PDSERVE_REQUEST_TIMEOUT": ("nan", "expected a finite number"),
    "PDSERVE_METRICS_PORT": ("70000", "expected a port in 0..65535"),
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.parametrize("name", list(BAD)[:6])
def test_pdserve_up_refuses_a_bad_value_in_one_line(name):
    value, why = BAD[name]
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "up", "--port", "1"],
                          capture_output=True, text=True, timeout=120,
                          env=_clean_env(**{name: value}))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {name}={value!r}: {why}"), done.stderr


@pytest.mark.parametrize("command", [["serve", "prefill"], ["serve", "decode"],
                                     ["serve", "gateway"]])
def test_each_service_refuses_a_bad_value_in_one_line(command):
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", *command],
                          capture_output=True, text=True, timeout=120,
                          env=_clean_env(PDSERVE_BLOCK_SIZE="16x"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: PDSERVE_BLOCK_SIZE='16x': expected an integer")


def test_every_listed_value_is_refused_and_good_values_pass():
    for name, (value, why) in BAD.items():
        line = check_environment({name: value}, build_parser)
        assert line is not None and line.startswith(f"{name}={value!r}: {why}"), line
    good = {"PDSERVE_PORT": "8001", "PDSERVE_MAX_NUM_SEQS": "8", "PDSERVE_KV_CACHE_MEMORY": "1GiB",
            "PDSERVE_ENABLE_PREFIX_CACHING": "false", "PDSERVE_QUANTIZATION": "int8",
            "PDSERVE_GRPC_KEEPALIVE_S": "2.5", "PDSERVE_METRICS_PORT": "-1",
            "PDSERVE_ALLOWED_ORIGINS": '["http://a"]', "PDSERVE_CPU_CORES": "0-1",
            "PDSERVE_PUBLISH": "0.0.0.0:8000", "PDSERVE_API_KEY": "k1,k2"}
    assert check_environment(good, build_parser) is None


def test_the_variables_are_the_flags_of_every_subcommand():
    names = flag_actions(build_parser())
    for name in ("PDSERVE_PORT", "PDSERVE_MAX_NUM_SEQS", "PDSERVE_STALL_TIMEOUT",
                 "PDSERVE_REQUEST_TIMEOUT", "PDSERVE_ADMIN_API_KEY", "PDSERVE_KV_PIN_TTL",
                 "PDSERVE_MAX_WAITING_REQUESTS", "PDSERVE_NUM_DECODE"):
        assert name in names, name
