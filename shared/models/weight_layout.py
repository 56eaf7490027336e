"""The layout a Llama-family model's fp32 CPU weights are held in, and what they cost.

On a CPU with the panel kernels (`kernels.cpu_gemv`: AVX-512 and a C compiler) every linear
layer and the LM head are held once, as K-major panels in the model's dtype (fp32 or bf16),
and run from them at every batch size; a tied embedding table is read from the LM head's
panels (`layers.PanelEmbedding`).
The plain weights are dropped, so an engine holds each parameter once (issue 38: before, the
plain, oneDNN-prepacked and panel copies made 2-3x). Without the panel kernel the layers run
from oneDNN-prepacked copies (`kernels.cpu_linear`) beside the plain weights, as before.

The panel layout is also what `shared.models.weight_cache` writes to a host file once and
every engine of the host maps read-only: `pack_weights` gives the tensors by name,
`install_packed` puts them (packed here or mapped) into a model built on the meta device.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import cpu_gemv, cpu_int8, cpu_linear
from pdserve.shared.models.layers import Int8Embedding, Linear, PanelEmbedding

LAYOUT_VERSION = 2
"""Bumped whenever `pack_weights`' names or tensors change (the weight cache's key)."""
_WPACKED, _BIAS = ".wpacked", ".bias_padded"
LM_HEAD = "lm_head"


def head_weight(model) -> torch.Tensor:
    """The LM head weight [vocab_size, hidden_size] in the model's dtype, wherever it is
    held: the untied weight, the panels (unpacked: a copy) or the embedding table."""
    if model.lm_head_weight is not None:
        return model.lm_head_weight
    if model.lm_head_gemv is not None:
        return cpu_gemv.unpack_weight(model.lm_head_gemv)
    return model.embed_tokens.weight


def panels_available(dtype: torch.dtype = torch.float32) -> bool:
    """The panel kernels for `dtype` weights (float32, bfloat16) run here and are not
    switched off (PDSERVE_CPU_GEMV=0)."""
    return cpu_gemv.is_enabled() and cpu_gemv.load_kernel(dtype) is not None


def panels_fit(model, dtype: torch.dtype) -> bool:
    """The model's layers can be held as `dtype` panels: bf16 panels pair the input features,
    so every linear layer's K (and the LM head's, hidden_size) must be even."""
    if dtype != torch.bfloat16:
        return True
    return model.args.hidden_size % 2 == 0 and all(
        m.in_features % 2 == 0 for m in model.modules() if isinstance(m, Linear))


def set_packed_linear(model, enabled: bool) -> None:
    """See `LlamaForCausalLM.set_packed_linear`."""
    weight = model.norm.weight
    enabled = enabled and weight.device.type == "cpu"
    unpack(model)
    if enabled and panels_available(weight.dtype) and panels_fit(model, weight.dtype):
        install_packed(model, pack_weights(model))
    elif enabled and weight.dtype == torch.float32 and cpu_linear.is_available():
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed = cpu_linear.pack_weight(module.weight)
        model.lm_head_packed = cpu_linear.pack_weight(head_weight(model))


def pack_weights(model) -> dict[str, torch.Tensor]:
    """The tensors of a loaded fp32 or bf16 CPU model (plain weights) in the panel layout,
    by name: "<linear>.wpacked" ([ceil(N/64), K, 64] in the model's dtype) and
    "<linear>.bias_padded" ([64 * ceil(N/64)] float32) for every
    linear layer, "lm_head.wpacked" for the LM head (tied or not), and every other parameter
    (norms, biases, an untied embedding) under its own name. Copies: about the model's
    parameter bytes."""
    out: dict[str, torch.Tensor] = {}
    dtype = model.norm.weight.dtype
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            gemv = cpu_gemv.pack_weight(module.weight.detach(), module.bias, dtype)
            out[name + _WPACKED] = gemv.wpacked
            if gemv.bias is not None:
                out[name + _BIAS] = gemv.bias
    out[LM_HEAD + _WPACKED] = cpu_gemv.pack_weight(head_weight(model).detach(), None,
                                                   dtype).wpacked
    tied = model.args.tie_word_embeddings
    for name, param in model.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if ((isinstance(owner, Linear) and attr == "weight") or name == "lm_head_weight"
                or (tied and name == "embed_tokens.weight")):
            continue  # held as panels
        out[name] = param.detach()
    return out


def install_packed(model, tensors: dict[str, torch.Tensor]) -> None:
    """Put `pack_weights`' tensors (made here, or mapped from the weight cache) into `model`,
    built on any device (meta included): each linear layer and the LM head run from their
    panels, a tied embedding reads the LM head's, the other parameters take the tensors as
    they are (no copy). Raises ValueError when a tensor is missing or one is left over, or a
    parameter stays unset."""
    tensors = dict(tensors)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            wpacked = tensors.pop(name + _WPACKED, None)
            if wpacked is None:
                raise ValueError(f"packed weights lack {name + _WPACKED}")
            module.gemv = cpu_gemv.GemvWeight(wpacked, tensors.pop(name + _BIAS, None),
                                              module.out_features)
            module.packed = None
            module.weight = None
    if LM_HEAD + _WPACKED not in tensors:
        raise ValueError(f"packed weights lack {LM_HEAD + _WPACKED}")
    head = cpu_gemv.GemvWeight(tensors.pop(LM_HEAD + _WPACKED), None, model.args.vocab_size)
    model.lm_head_gemv, model.lm_head_packed, model.lm_head_weight = head, None, None
    if model.args.tie_word_embeddings:
        model.embed_tokens = PanelEmbedding(head)
    _assign_parameters(model, tensors)


def _assign_parameters(model, tensors: dict[str, torch.Tensor]) -> None:
    """Every remaining tensor becomes the parameter of its name, as it is (no copy)."""
    for name, tensor in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if not isinstance(getattr(owner, attr, None), torch.Tensor):
            raise ValueError(f"packed weights hold {name}, which this model does not have")
        setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
    unset = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if unset:
        raise ValueError(f"packed weights lack {unset[:3]}")


def pack_int8_weights(model) -> dict[str, torch.Tensor]:
    """The tensors of a model after `quantize_int8`, by name, for the weight cache: each
    int8 layer's "<name>.qpacked", ".scale", ".bias" and ".int8_meta" ([out_features, w8a8,
    a16] int64), "lm_head.*", an untied embedding's "embed_tokens.*", the other parameters
    (norms) under their names, and "weight_bytes_saved" ([1] int64). No copy."""
    out: dict[str, torch.Tensor] = {}

    def put(prefix: str, w: cpu_int8.Int8Weight) -> None:
        out[prefix + ".qpacked"], out[prefix + ".scale"], out[prefix + ".bias"] = (
            w.qpacked, w.scale, w.bias)
        out[prefix + ".int8_meta"] = torch.tensor([w.out_features, w.w8a8, w.a16])

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            put(name, module.int8_weight)
    put(LM_HEAD, model.lm_head_int8)
    if not model.args.tie_word_embeddings:
        put("embed_tokens", model.embed_tokens.int8_weight)
    out.update((name, p.detach()) for name, p in model.named_parameters())
    out["weight_bytes_saved"] = torch.tensor([model.weight_bytes_saved])
    return out


def install_int8(model, tensors: dict[str, torch.Tensor]) -> None:
    """Put `pack_int8_weights`' tensors (mapped from the weight cache) into `model` built on
    the meta device: the model is then as `quantize_int8` leaves it. Raises ValueError for
    a missing or left-over tensor."""
    tensors = dict(tensors)

    def take(prefix: str) -> cpu_int8.Int8Weight:
        try:
            meta = tensors.pop(prefix + ".int8_meta").tolist()
            return cpu_int8.Int8Weight(tensors.pop(prefix + ".qpacked"),
                                       tensors.pop(prefix + ".scale"),
                                       tensors.pop(prefix + ".bias"), int(meta[0]),
                                       bool(meta[1]), bool(meta[2]))
        except KeyError as e:
            raise ValueError(f"int8 weights lack {e}") from None

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.int8_weight = take(name)
            module.weight = module.bias = module.packed = module.gemv = None
    model.lm_head_int8 = take(LM_HEAD)
    model.lm_head_weight = model.lm_head_packed = model.lm_head_gemv = None
    model.embed_tokens = Int8Embedding(model.lm_head_int8 if model.args.tie_word_embeddings
                                       else take("embed_tokens"))
    model.quantization = "int8"
    model.weight_bytes_saved = int(tensors.pop("weight_bytes_saved")[0])
    _assign_parameters(model, tensors)


def unpack(model) -> None:
    """Back to plain weights (no packed copy, F.linear everywhere)."""
    for module in model.modules():
        if isinstance(module, Linear):
            if module.weight is None and module.gemv is not None:
                module.weight = nn.Parameter(module.full_weight().contiguous(),
                                             requires_grad=False)
            module.gemv = module.packed = None
    if model.lm_head_gemv is not None:
        head = cpu_gemv.unpack_weight(model.lm_head_gemv).contiguous()
        if model.args.tie_word_embeddings:
            model.embed_tokens = nn.Embedding(head.shape[0], head.shape[1], _weight=head)
            model.embed_tokens.weight.requires_grad_(False)
        else:
            model.lm_head_weight = nn.Parameter(head, requires_grad=False)
    model.lm_head_gemv = model.lm_head_packed = None


def parameter_bytes(model) -> int:
    """Bytes of the model's parameters in their checkpoint dtype, however they are held (fp32
    panels count their unpadded size; int8 layers are not counted)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is None and module.gemv is not None:
            gemv = module.gemv
            total += (gemv.out_features * cpu_gemv.in_features(gemv)
                      * gemv.wpacked.element_size())
    if model.lm_head_gemv is not None:
        total += (model.args.vocab_size * model.args.hidden_size
                  * model.lm_head_gemv.wpacked.element_size())
    return total


def weight_bytes_by_kind(model) -> dict[str, int]:
    """See `LlamaForCausalLM.weight_bytes_by_kind`."""
    kinds: dict[str, list] = {"weights": [*model.parameters(), *model.buffers()],
                              "packed_weights": [], "int8_weights": []}
    for module in model.modules():
        if isinstance(module, Linear):
            kinds["packed_weights"] += [module.packed, *(module.gemv or ())]
            kinds["int8_weights"] += list(module.int8_weight or ())
    kinds["packed_weights"] += [model.lm_head_packed, *(model.lm_head_gemv or ())]
    kinds["int8_weights"] += list(model.lm_head_int8 or ())
    if isinstance(model.embed_tokens, Int8Embedding):
        kinds["int8_weights"] += list(model.embed_tokens.int8_weight)
    mapping = model.weight_mapping
    seen: set[int] = set()
    totals = dict.fromkeys(kinds, 0)
    totals["mapped_weights"] = 0
    for kind, tensors in kinds.items():
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.data_ptr() if t.layout == torch.strided else id(t)
            if key in seen:
                continue
            seen.add(key)
            nbytes = t.numel() * t.element_size()
            if mapping is not None and t.layout == torch.strided and mapping.holds(t):
                totals["mapped_weights"] += nbytes
            else:
                totals[kind] += nbytes
    return totals

