"""LoRA adapter names and `--lora-modules` (vLLM's flag), torch-free: the gateway, the
launcher and the engine services share them.

    --lora-modules name=path                 vLLM's two spellings (repeatable)
    --lora-modules '{"name": "a", "path": "/dir", "base_model_name": "m"}'

Every instance of a cluster names an adapter with the same `lora_int_id`,
`lora_int_id_of(lora_name)` (a fixed hash of the name): the gateway, the prefill and the
decode instances agree on it without asking each other, and so do the block hashes that
carry the adapter.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import xxhash

from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.lora.request import LoRARequest


def lora_int_id_of(lora_name: str) -> int:
    """The cluster-wide id of the adapter named `lora_name`: in [1, 2**31 - 1], stable across
    processes and machines (xxh3-64 of the UTF-8 name, seed 0)."""
    return xxhash.xxh3_64_intdigest(lora_name.encode("utf-8")) % (2**31 - 1) + 1


def make_lora_request(lora_name: str, lora_path: str,
                      base_model_name: str | None = None) -> LoRARequest:
    """A LoRARequest with the cluster-wide id. Raises ValueError for an empty name or path."""
    if not lora_path:
        raise ValueError(f"LoRA adapter {lora_name!r}: lora_path must not be empty")
    return LoRARequest(lora_name, lora_int_id_of(lora_name), lora_path, base_model_name or None)


def parse_lora_module(text: str) -> LoRARequest:
    """One `--lora-modules` value: `name=path` or vLLM's JSON object form.

    Raises:
        ValueError: one line naming the value and what is wrong.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: invalid JSON ({e.msg})") from None
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(obj.get("name"), str) or \
                not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: expected "
                             '{"name": str, "path": str, "base_model_name": str (optional)}')
        name, path, base = obj["name"], obj["path"], obj.get("base_model_name")
    else:
        name, eq, path = text.partition("=")
        if not eq:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
        base = None
    if not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: the name and the path must not be empty")
    return make_lora_request(name.strip(), path.strip(), base)


def parse_lora_modules(values: Iterable[str] | None) -> tuple[LoRARequest, ...]:
    """Every `--lora-modules` value (each may hold several, space-separated, as argparse's
    nargs gives them). Raises ValueError: a bad value, or one name given twice."""
    out: dict[str, LoRARequest] = {}
    for value in values or ():
        lora = parse_lora_module(value)
        if lora.lora_name in out:
            raise ValueError(f"--lora-modules: the name {lora.lora_name!r} is given twice")
        out[lora.lora_name] = lora
    return tuple(out.values())


def check_adapter_dir(lora: LoRARequest) -> None:
    """The cheap check before an instance serves: a PEFT directory with its config.

    Raises:
        ValueError: one line naming the adapter and the missing file.
    """
    config = os.path.join(lora.lora_path, "adapter_config.json")
    if not os.path.isfile(config):
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: no adapter_config.json in "
                         f"{lora.lora_path!r}")


def adapter_to_proto(lora: LoRARequest) -> pb.LoRAAdapter:
    return pb.LoRAAdapter(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id,
                          lora_path=lora.lora_path, base_model_name=lora.base_model_name or "")


def adapter_from_proto(p: pb.LoRAAdapter) -> LoRARequest:
    """Raises ValueError: empty name or path, or an id that is not the name's."""
    lora = make_lora_request(p.lora_name, p.lora_path, p.base_model_name or None)
    if p.lora_int_id and p.lora_int_id != lora.lora_int_id:
        raise ValueError(f"LoRA adapter {p.lora_name!r}: lora_int_id {p.lora_int_id} is not "
                         f"the name's ({lora.lora_int_id})")
    return lora
