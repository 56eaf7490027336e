"""The scheduler's LoRA rule (vLLM's `max_loras`), and the running / waiting adapters that
metrics report (vLLM's `vllm:lora_requests_info`).

A step's requests use at most `max_loras` distinct adapters (the base model is free): the
running requests' adapters hold their slots, and a waiting request is admitted only if its
adapter is one of them or a slot is free. A request that must wait for a slot is skipped,
not a barrier: requests behind it (of resident adapters, or of the base model) still go.
No running request ever loses its adapter's slot (a preempted one gives it up).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pdserve.shared.request import Request, RequestStatus


class LoRAStats(NamedTuple):
    running_lora_adapters: list[str]
    """Names of the adapters running requests use (sorted)."""
    waiting_lora_adapters: list[str]
    """Names of the adapters waiting (and preempted) requests use (sorted)."""
    max_lora: int
    """max_loras: adapters one step can serve."""


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def __call__(self, order: list[Request], running: Iterable[Request]) -> list[Request]:
        """`order` (the waiting requests in admission order) less those whose adapter
        could get no slot this step: starting from the running requests' adapters, each
        request kept may bring one adapter more while fewer than max_loras are taken.

        NOTE: equal to checking each request as the scheduler admits it: the scheduler stops
        at the first request it cannot admit, so an adapter counted for a request kept here
        but not admitted only affects requests that are not admitted either. Requests
        waiting for remote KV pass (they do not run until it arrives, then they wait again).
        """
        active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        kept = []
        for request in order:
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in active and \
                    request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                if len(active) >= self.max_loras:
                    continue
                active.add(lora.lora_int_id)
            kept.append(request)
        return kept


def lora_stats(running: Iterable[Request], waiting: Iterable[Request], max_loras: int
               ) -> LoRAStats:
    def names(requests: Iterable[Request]) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request})

    return LoRAStats(names(running), names(waiting), max_loras)
