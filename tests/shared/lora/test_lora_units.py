"""LoRA bookkeeping without a model: the scheduler's max_loras rule, the adapter's extra key
in block hashes (non-LoRA hashes unchanged), the flags' validation, metrics' names."""

from __future__ import annotations

import pytest

from pdserve.shared.engine_args import EngineArgs
from pdserve.shared.kv_cache.prefix_hash import block_extra_keys, hash_request_tokens
from pdserve.shared.lora.admission import LoRAAdmission, lora_stats
from pdserve.shared.lora.args import create_lora_config
from pdserve.shared.lora.request import LoRARequest
from pdserve.shared.request import Request, RequestStatus
from pdserve.shared.sampling_params import SamplingParams


def req(rid: str, lora_id: int | None) -> Request:
    lora = LoRARequest(f"lora{lora_id}", lora_id, "/x") if lora_id else None
    return Request(rid, [1, 2, 3], SamplingParams(), lora_request=lora)


def test_a_request_waits_for_a_slot_without_blocking_those_behind_it():
    admit = LoRAAdmission(max_loras=2)
    running = [req("r1", 1), req("r0", None)]
    order = [req("a", 2), req("b", 3), req("c", None), req("d", 1), req("e", 2), req("f", 3)]
    assert [r.request_id for r in admit(order, running)] == ["a", "c", "d", "e"]
    remote = req("g", 4)
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # not running until its KV is in
    assert [r.request_id for r in admit([remote, req("h", 2)], running)] == ["g", "h"]


def test_lora_stats_name_running_and_waiting_adapters():
    stats = lora_stats([req("a", 2), req("b", 1), req("c", None)], [req("d", 3)], 4)
    assert stats == (["lora1", "lora2"], ["lora3"], 4)


def test_the_adapter_enters_the_first_block_hash_only_when_given():
    tokens = list(range(40))
    plain = hash_request_tokens(tokens, 16, block_extra_keys("m", None))
    assert hash_request_tokens(tokens, 16, block_extra_keys("m", None, lora_name=None)) == plain
    a = hash_request_tokens(tokens, 16, block_extra_keys("m", None, lora_name="a"))
    b = hash_request_tokens(tokens, 16, block_extra_keys("m", None, lora_name="b"))
    assert len({a[0], b[0], plain[0]}) == 3 and not set(a) & set(b)
    assert block_extra_keys("m", "salt", "int8", True, "a")[-1] == b"lora=a"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_loras": 0}, "max_loras must be >= 1"),
    ({"max_lora_rank": 128}, r"max_lora_rank must be in \[1, 64\]"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
])
def test_bad_lora_flags_are_refused(kwargs, message):
    args = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None,
            **kwargs}
    with pytest.raises(ValueError, match=message):
        create_lora_config(**args)


def test_lora_off_by_default_and_flags_as_vllm():
    assert EngineArgs().create_lora_config() is None
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                            "--max-cpu-loras", "8"])
    config = EngineArgs.from_cli_args(ns).create_lora_config()
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (4, 64, 8)
