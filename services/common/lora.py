"""LoRA adapters on a prefill or decode instance: the adapter table behind LoadLoRAAdapter /
UnloadLoRAAdapter / ListLoRAAdapters, and the checks of a request's adapter.

A request names its adapter by (name, id) (services/common/lora_modules.py: the id is the
same on every instance); the instance serves it with the adapter it loaded under that name
(NOT_FOUND when it has none), never another one, and a decode takes KV only from a prefill
of the same adapter.
"""

from __future__ import annotations

import grpc

from pdserve.services.common.errors import ServiceError
from pdserve.services.proto import engine_pb2 as pb
from pdserve.shared.lora.request import LoRARequest


def lora_stats_op(engine) -> tuple[set[str], set[str], int] | None:
    """(running adapter names, waiting adapter names, max_loras) for vLLM's
    lora_requests_info; None when the engine serves no LoRA (an engine-thread op)."""
    running, waiting, max_loras = engine.lora_stats()
    return None if not max_loras else (set(running), set(waiting), int(max_loras))


class LoRATable:
    """The adapters an instance has loaded, by name (read on the event loop; written only by
    `load` / `unload` after the engine op succeeded)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.adapters: dict[str, LoRARequest] = {}

    def listed(self) -> list[LoRARequest]:
        return sorted(self.adapters.values(), key=lambda a: a.lora_name)

    def check_new(self, lora: LoRARequest) -> bool:
        """Whether `lora` still needs loading (False: the same adapter is loaded already).

        Raises:
            ServiceError: ALREADY_EXISTS, the name is loaded from another path;
                INVALID_ARGUMENT, it adapts another model than this instance's.
        """
        if lora.base_model_name not in (None, self.model_name):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"LoRA adapter {lora.lora_name!r} is for base model "
                               f"{lora.base_model_name!r}; this instance serves "
                               f"{self.model_name!r}")
        loaded = self.adapters.get(lora.lora_name)
        if loaded is None:
            return True
        if loaded.lora_path != lora.lora_path:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"The lora adapter '{lora.lora_name}' has already been loaded "
                               f"from {loaded.lora_path!r}; unload it first")
        return False

    def resolve(self, p: pb.LoRAAdapter | None) -> LoRARequest | None:
        """The loaded adapter a request names (None: the base model).

        Raises:
            ServiceError: NOT_FOUND, no adapter of that name is loaded here;
                FAILED_PRECONDITION, the request's id is not the loaded adapter's.
        """
        if p is None or not p.lora_name:
            return None
        loaded = self.adapters.get(p.lora_name)
        if loaded is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"LoRA adapter {p.lora_name!r} is not loaded on this instance")
        if p.lora_int_id and p.lora_int_id != loaded.lora_int_id:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"LoRA adapter {p.lora_name!r}: the request names id "
                               f"{p.lora_int_id}, this instance loaded it as "
                               f"{loaded.lora_int_id}")
        return loaded


def check_kv_adapter(handle_lora_name: str, handle_lora_int_id: int,
                     lora: LoRARequest | None) -> None:
    """A decode takes KV only from the adapter its request runs under.

    Raises:
        ServiceError: FAILED_PRECONDITION naming both adapters.
    """
    want = ("", 0) if lora is None else (lora.lora_name, lora.lora_int_id)
    if (handle_lora_name, handle_lora_int_id) != want:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"kv_transfer_params: the KV was computed under "
                           f"{_describe(handle_lora_name, handle_lora_int_id)}, this request "
                           f"runs under {_describe(*want)}; KV of another adapter cannot be "
                           "used")


def _describe(name: str, int_id: int) -> str:
    return f"LoRA adapter {name!r} (id {int_id})" if name else "the base model (no adapter)"
