"""LoRAModelManager: the adapters an engine knows, their weights in memory, and the
`max_loras` slots of the model's LoRA layers (vLLM's `LRUCacheLoRAModelManager`).

Three levels, as vLLM's:

    registered    every adapter `add_lora` accepted (its LoRARequest), until `remove_lora`
    loaded        weights in memory: those unfinished requests use, plus, of the others, the
                  most recently used up to `max_cpu_loras` in all (LRU eviction; an evicted
                  adapter is read again from its path when a request names it)
    slots         `max_loras` adapters in the layers' stacked weights; a step's adapters
                  (at most max_loras: the scheduler's rule, `admission.py`) are activated
                  into slots before its forward, replacing the least recently used others

NOTE: `max_cpu_loras` is a soft cap: adapters that unfinished requests use stay loaded even
past it (refusing their requests instead would fail traffic the slots could serve).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pdserve.shared.config import LoRAConfig
from pdserve.shared.lora.layers import LinearWithLoRA, LoRAContext
from pdserve.shared.lora.mapping import build_lora_mapping
from pdserve.shared.lora.peft_loader import LoRAModel, fused_linear_shapes, load_peft_adapter
from pdserve.shared.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAModelManager:
    def __init__(self, model: torch.nn.Module, lora_config: LoRAConfig,
                 device: torch.device) -> None:
        """Replace the decoder's fused linears (qkv, o, gate_up, down) by `LinearWithLoRA`."""
        self.lora_config = lora_config
        self.device = device
        self.max_cpu_loras = lora_config.max_cpu_loras or lora_config.max_loras
        self.shapes = fused_linear_shapes(model)
        self.num_layers = len(model.layers)
        self.context = LoRAContext()
        self.layers: list[dict[str, LinearWithLoRA]] = []
        for layer in model.layers:
            wrapped = {}
            for name, shape in self.shapes.items():
                parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
                wrapped[name] = LinearWithLoRA(getattr(parent, name), shape,
                                               lora_config.max_loras, lora_config.max_lora_rank,
                                               self.context)
                setattr(parent, name, wrapped[name])
            self.layers.append(wrapped)
        self.registered: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAModel] = OrderedDict()
        """Adapters in memory, least recently used first."""
        self.slot_ids: list[int | None] = [None] * lora_config.max_loras
        self._slot_last_used = [0] * lora_config.max_loras
        self._num_steps = 0

    # -- registration ------------------------------------------------------------------------

    def add_adapter(self, lora_request: LoRARequest, in_use: set[int]) -> None:
        """Validate and load an adapter (see `EngineCore.add_lora`). Adding one already
        registered with the same name and path does nothing.

        Raises:
            ValueError: one line; nothing registered or loaded before is changed.
        """
        lora_id, name = lora_request.lora_int_id, lora_request.lora_name
        known = self.registered.get(lora_id)
        if known is not None:
            if (known.lora_name, known.lora_path) == (name, lora_request.lora_path):
                return
            raise ValueError(f"lora_int_id {lora_id} is already loaded as {known.lora_name!r} "
                             f"from {known.lora_path}")
        other = next((r for r in self.registered.values() if r.lora_name == name), None)
        if other is not None:
            raise ValueError(f"LoRA adapter name {name!r} is already loaded "
                             f"(lora_int_id {other.lora_int_id})")
        lora_model = self._read(lora_request)
        self.registered[lora_id] = lora_request
        self._keep_loaded(lora_model, in_use)
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %.1f MiB", name, lora_id,
                    lora_request.lora_path, lora_model.rank, lora_model.num_bytes / 2**20)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (the caller checked no request uses it); False: unknown id."""
        if self.registered.pop(lora_int_id, None) is None:
            return False
        self.loaded.pop(lora_int_id, None)
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = None
                self._set_slot(slot, None)
        return True

    def check_request(self, lora_request: LoRARequest, in_use: set[int]) -> None:
        """A request's adapter must be registered under that id and name; its weights are
        read again if they were evicted.

        Raises:
            ValueError: an adapter not loaded (or another name for the id), or unreadable now.
        """
        known = self.registered.get(lora_request.lora_int_id)
        if known is None or known.lora_name != lora_request.lora_name:
            raise ValueError(f"lora_request: LoRA adapter {lora_request.lora_name!r} (id "
                             f"{lora_request.lora_int_id}) is not loaded (add_lora first)")
        if lora_request.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora_request.lora_int_id)
        else:
            self._keep_loaded(self._read(known), in_use)

    def _read(self, lora_request: LoRARequest) -> LoRAModel:
        return load_peft_adapter(lora_request, self.shapes, self.num_layers,
                                 self.lora_config.max_lora_rank)

    def _keep_loaded(self, lora_model: LoRAModel, in_use: set[int]) -> None:
        lora_id = lora_model.lora_request.lora_int_id
        self.loaded[lora_id] = lora_model
        for old in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if old != lora_id and old not in in_use:
                del self.loaded[old]  # its slot (if any) keeps its weights until reused

    # -- steps -------------------------------------------------------------------------------

    @contextmanager
    def step(self, scheduled: list) -> Iterator[None]:
        """Activate the step's adapters into slots and install its `LoRAMapping` for one
        forward over `scheduled` (`ScheduledRequest`s in batch order).

        Raises:
            RuntimeError: more adapters than slots (the scheduler's rule was broken).
        """
        self._num_steps += 1
        slot_of: dict[int, int] = {}
        request_slots = []
        for s in scheduled:
            lora = s.request.lora_request
            if lora is None:
                request_slots.append(-1)
                continue
            slot = slot_of.get(lora.lora_int_id)
            if slot is None:
                slot = slot_of[lora.lora_int_id] = self._activate(lora.lora_int_id, slot_of)
            request_slots.append(slot)
        q_lens = np.fromiter((s.num_scheduled_tokens for s in scheduled), np.int64,
                             len(scheduled))
        mapping = build_lora_mapping(request_slots, q_lens, self.device, len(self.slot_ids))
        with self.context.step(mapping):
            yield

    def _activate(self, lora_int_id: int, taken: dict[int, int]) -> int:
        """The slot holding the adapter, loading it into the least recently used slot that
        this step does not use when it is not resident."""
        used = set(taken.values())
        if lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora_int_id)
        else:
            free = [s for s in range(len(self.slot_ids)) if s not in used]
            if not free:
                raise RuntimeError(f"a step uses more LoRA adapters than max_loras="
                                   f"{len(self.slot_ids)}")
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None,
                                             self._slot_last_used[s]))
            lora_model = self.loaded.get(lora_int_id)
            if lora_model is None:  # evicted since its request arrived: read it again
                lora_model = self._read(self.registered[lora_int_id])
                self.loaded[lora_int_id] = lora_model
            self.slot_ids[slot] = lora_int_id
            self._set_slot(slot, lora_model)
        self._slot_last_used[slot] = self._num_steps
        return slot

    def _set_slot(self, slot: int, lora_model: LoRAModel | None) -> None:
        for i, wrapped in enumerate(self.layers):
            for name, layer in wrapped.items():
                layer.set_slot(slot, None if lora_model is None else
                               lora_model.layers[i].get(name))
