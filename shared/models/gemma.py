"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache, built from llama.py's parts.

What differs from Llama (transformers' modeling_gemma2.py / modeling_gemma3.py):
- RMSNorm scales by (1 + w): the loader stores 1 + w (`_plus_one`), so the plain RMSNorm and
  its fused C path compute transformers' `norm(x) * (1 + w)` bit for bit in fp32.
- The embeddings are multiplied by sqrt(hidden_size), rounded to the hidden dtype first as
  transformers' `embed_scale` tensor is.
- The MLP is GeGLU: gelu_tanh(gate) * up.
- Four norms per layer, around both sublayers ("sandwich"):
      h = x + post_attention_layernorm(attn(input_layernorm(x)))
      out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
- Attention scale query_pre_attn_scalar ** -0.5; head_dim is independent of hidden / heads.
- Gemma 2 soft-caps the attention scores (attn_logit_softcapping; transformers' Gemma 3
  ignores the field, so this does too) and, both, the final logits (final_logit_softcapping).
- Local layers attend within `sliding_window`; Gemma 3's local layers have their own rope
  (base 10^4) and its global layers another (base 10^6, possibly linear-scaled); Gemma 3
  norms each head's q and k.

Source: Gemma Team 2024 (Gemma 2), 2025 (Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.shared.models import gemma_config
from pdserve.shared.models.architectures import check_hf_config
from pdserve.shared.models.layers import RMSNorm
from pdserve.shared.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pdserve.shared.models.rotary import RotaryEmbedding, RotaryInputs


@dataclass(frozen=True, slots=True)
class GemmaArgs:
    """The architecture numbers read from a Gemma 2 / 3 config.json. The fields the engine
    reads (vocab_size, num_hidden_layers, num_kv_heads, head_dim) carry LlamaArgs' names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    """Gemma 2 only: scores c * tanh(s / c); None: off."""
    final_logit_softcapping: float | None
    qk_norm: bool
    """Gemma 3: a (1 + w) RMSNorm over each head's q and k before the rotary."""
    layer_types: tuple[str, ...]
    """Each layer's kind: `gemma_config.SLIDING` (local: its window and the local rope) or
    `gemma_config.FULL` (global)."""
    sliding_windows: tuple[int | None, ...]
    """Each layer's attention window in tokens; None: full attention."""
    rope_local: dict
    """The local layers' rope parameters (`rope_theta`, `rope_type`, scaling fields)."""
    rope_global: dict

    @property
    def o_proj_bias(self) -> bool:
        """As LlamaArgs' (Gemma biases o_proj with q/k/v)."""
        return self.attention_bias

    @classmethod
    def from_hf_config(cls, cfg: dict) -> GemmaArgs:
        """Raises ValueError for a part this file does not implement (`check_hf_config`)."""
        check_hf_config(cfg)
        num_heads = cfg["num_attention_heads"]
        is_gemma2 = not gemma_config.is_gemma3(cfg)
        ropes = gemma_config.gemma_rope_parameters(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or 256,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
            attn_logit_softcapping=(cfg.get("attn_logit_softcapping") or None) if is_gemma2
            else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") or None,
            qk_norm=not is_gemma2,
            layer_types=gemma_config.gemma_layer_types(cfg),
            sliding_windows=gemma_config.gemma_sliding_windows(cfg),
            rope_local=ropes[gemma_config.SLIDING],
            rope_global=ropes[gemma_config.FULL],
        )


class GemmaAttention(LlamaAttention):
    """LlamaAttention's modules (o_proj biased as q/k/v), Gemma's scale and score soft cap."""

    def __init__(self, args: GemmaArgs, sliding_window: int | None) -> None:
        super().__init__(args, sliding_window)  # type: ignore[arg-type]
        self.scale = args.query_pre_attn_scalar ** -0.5
        self.logits_soft_cap = args.attn_logit_softcapping

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding, rotary_inputs: RotaryInputs,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm_torch(q), self.k_norm.norm_torch(k)  # new contiguous
        q, k = rotary.apply(q, k, rotary_inputs)
        out = attn.forward(q, k, v, kv_cache[0], kv_cache[1], self.scale,
                           sliding_window=self.sliding_window,
                           logits_soft_cap=self.logits_soft_cap)
        return self.o_proj(out.reshape(-1, self.q_size))


class GemmaMLP(LlamaMLP):
    """LlamaMLP's modules; GeGLU, always the torch ops (`use_fused_cpu_ops` is not read)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(args, sliding_window)
        self.mlp = GemmaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, rotary_inputs: RotaryInputs,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's normed MLP output, residual stream before adding
        it), as `LlamaDecoderLayer`: the layer's output is the returned hidden + residual."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, rotary_inputs, kv_cache, attn)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / 3 with `LlamaForCausalLM`'s interface; its weight-level methods
    (set_packed_linear, quantize_int8, parameter_bytes, resident_weight_bytes) run unchanged
    over these modules, which carry the same attribute names.

    NOTE: `__init__` builds its own modules instead of LlamaForCausalLM's; an attribute a
    future LlamaForCausalLM method reads must be set here too.
    """

    def __init__(self, args: GemmaArgs) -> None:
        nn.Module.__init__(self)
        self.args = args  # type: ignore[assignment]
        self.layer_types = args.layer_types
        self.final_logit_softcapping = args.final_logit_softcapping
        self.sliding_windows = args.sliding_windows
        """Each layer's attention window (None: full); the KV cache manager frees the blocks
        that fall out of every layer's window."""
        # NOTE: given its weight, nn.Embedding skips its normal_ init, which on the meta
        # device (the loader builds the model there) imports torch._dynamo: 1.5 s of start-up
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.embed_scale = {dtype: torch.tensor(args.hidden_size ** 0.5, device="cpu")
                            .to(dtype).item()
                            for dtype in (torch.float32, torch.bfloat16, torch.float16)}
        """hidden dtype -> sqrt(hidden_size) rounded to it, as a float (transformers multiplies
        by a tensor in the embeddings' dtype; a float of the same value gives the same
        product, and a CUDA graph can hold it)."""
        self.layers = nn.ModuleList(GemmaDecoderLayer(args, window)
                                    for window in args.sliding_windows)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        with torch.device("cpu"):  # real tables even when the loader builds on "meta"
            self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings,
                                          args.rope_global["rope_theta"], args.rope_global)
            """The global layers' rope."""
            self.rotary_local = self.rotary
            """The local layers' rope (Gemma 3's own; Gemma 2's is the global one)."""
            if args.rope_local != args.rope_global:
                self.rotary_local = RotaryEmbedding(
                    args.head_dim, args.max_position_embeddings, args.rope_local["rope_theta"],
                    args.rope_local)
        self._init_lm_head(args)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn) -> torch.Tensor:
        """As `LlamaForCausalLM.forward`: [num_tokens] ids and positions -> [num_tokens,
        hidden_size] hidden states before the final norm."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale[hidden.dtype]
        residual = None
        global_inputs = self.rotary.prepare(positions)
        local_inputs = (global_inputs if self.rotary_local is self.rotary
                        else self.rotary_local.prepare(positions))
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches):
            if kind == gemma_config.SLIDING:
                hidden, residual = layer(hidden, residual, self.rotary_local, local_inputs,
                                         kv_cache, attn)
            else:
                hidden, residual = layer(hidden, residual, self.rotary, global_inputs,
                                         kv_cache, attn)
        return hidden + residual

    def set_fused_cpu_ops(self, enabled: bool) -> None:
        """As LlamaForCausalLM's, for both ropes (the GeGLU MLP always runs the torch ops)."""
        super().set_fused_cpu_ops(enabled)
        self.rotary_local.use_fused_cpu_ops = self.rotary.use_fused_cpu_ops

    def move_rotary(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Both ropes' tables to `device` in `dtype` (`RotaryEmbedding.to`)."""
        self.rotary.to(device, dtype)
        if self.rotary_local is not self.rotary:
            self.rotary_local.to(device, dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 logits, soft-capped
        c * tanh(logits / c) when the config sets final_logit_softcapping c."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
