"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) over the paged KV cache.

gpt-fast-style single file: RMSNorm, rotary embeddings, GQA attention through
`kernels.store_kv_cache` / `kernels.paged_attention`, SwiGLU MLP. Inputs are the
flattened tokens of a whole mixed batch (prefill chunks and decodes together);
only the rows that sample a token go through the LM head.

Each decoder layer carries the residual stream separately, as vLLM's do:
layer(hidden, residual) -> (hidden, residual), so the residual add can be fused into the next
RMSNorm. On CPU in fp32 and bf16 the norms, rotary embeddings and SiLU-and-mul run as the
fused C ops of `kernels.cpu_fused` (bit-identical to the torch ops; chosen once, by
`set_fused_cpu_ops`); other devices and dtypes run the torch ops.

Source: Touvron et al. 2023 (Llama); Su et al. 2021 (RoPE); Kwon et al. 2023 (PagedAttention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_fused, cpu_gemv, cpu_int8, cpu_linear
from pdserve.shared.models import weight_layout
from pdserve.shared.models.architectures import check_hf_config, layer_sliding_windows
from pdserve.shared.models.layers import Int8Embedding, Linear, RMSNorm
from pdserve.shared.models.rotary import (
    RotaryEmbedding,
    RotaryInputs,
    rope_parameters,
    rope_theta_from_config,
)


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    """The architecture numbers read from an HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool = False
    """Llama and Qwen3 with `attention_bias`: o_proj has a bias too (Qwen2's never does)."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's q and k (weights [head_dim]) before the rotary."""
    fused_checkpoint: bool = False
    """Phi-3: the checkpoint stores `qkv_proj` and `gate_up_proj` already fused, in this
    model's order (q, k, v rows; gate, up rows)."""
    sliding_windows: tuple[int | None, ...] = ()
    """Each layer's attention window in tokens, None for full attention (Mistral: all
    layers; Qwen2/3 with use_sliding_window: from max_window_layers on); () = all full."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        """Raises ValueError for an architecture this file does not implement
        (`architectures.check_hf_config`)."""
        check_hf_config(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        is_qwen2 = cfg.get("model_type") == "qwen2"
        is_qwen3 = (cfg.get("architectures") or [""])[0] == "Qwen3ForCausalLM"
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_from_config(cfg),
            # NOTE: transformers 5 writes the scaling into `rope_parameters`, older versions
            # into `rope_scaling`: reading only the latter served llama3 scaling as default.
            rope_scaling=rope_parameters(cfg) or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
            o_proj_bias=bool(cfg.get("attention_bias", False)) and not is_qwen2,
            qk_norm=is_qwen3,
            fused_checkpoint=(cfg.get("architectures") or [""])[0] == "Phi3ForCausalLM",
            sliding_windows=layer_sliding_windows(cfg),
        )


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        """This layer's window in tokens (None: full attention)."""
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        # NOTE: q, k and v share one matmul (fewer, larger GEMMs on CPU); the loader
        # concatenates the checkpoint's q_proj / k_proj / v_proj rows in that order.
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        """Qwen3's per-head norms (None elsewhere); always the torch path (the fused C norm
        takes whole rows), which is bit-identical."""

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding, rotary_inputs: RotaryInputs,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views into qkv ([T, heads, head_dim], row stride q_size + 2 * kv_size).
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm_torch(q), self.k_norm.norm_torch(k)  # new contiguous
        q, k = rotary.apply(q, k, rotary_inputs)
        out = attn.forward(q, k, v, kv_cache[0], kv_cache[1], self.scale,
                           sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        # NOTE: gate and up share one matmul; the loader stacks gate_proj then up_proj.
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.use_fused_cpu_ops = False
        """True: silu(gate) * up by `kernels.cpu_fused.silu_and_mul` (see set_fused_cpu_ops)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate_size]
        if self.use_fused_cpu_ops:
            return self.down_proj(cpu_fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, sliding_window)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, rotary_inputs: RotaryInputs,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, residual stream before adding it).

        The first layer gets residual=None and hidden = the embeddings; the layer's output
        hidden state is the returned hidden + residual.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, rotary_inputs, kv_cache, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    `forward` takes the flattened batch; `compute_logits` projects only the rows that
    sample (one per scheduled request that reached its last known token).
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        # NOTE: given its weight, nn.Embedding skips its normal_ init, which on the meta
        # device (the loader builds the model there) imports torch._dynamo: 1.5 s of start-up
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.sliding_windows: tuple[int | None, ...] = (
            args.sliding_windows or (None,) * args.num_hidden_layers)
        """Each layer's attention window (None: full); the KV cache manager frees the blocks
        that fall out of every layer's window."""
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, window)
                                    for window in self.sliding_windows)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings,
                                      args.rope_theta, args.rope_scaling)
        self._init_lm_head(args)

    def _init_lm_head(self, args: LlamaArgs) -> None:
        """The LM head (None: tied to the embeddings) and its packed / int8 forms, unset."""
        self.lm_head_weight = None if args.tie_word_embeddings else nn.Parameter(
            torch.empty(args.vocab_size, args.hidden_size))
        self.lm_head_packed: torch.Tensor | None = None
        """The LM head weight prepacked for oneDNN (`set_packed_linear`)."""
        self.lm_head_gemv: cpu_gemv.GemvWeight | None = None
        """The LM head in K-major panels (`set_packed_linear`); set, `lm_head_weight` is None
        and a tied `embed_tokens` reads it (`layers.PanelEmbedding`)."""
        self.lm_head_int8: cpu_int8.Int8Weight | None = None
        """The LM head in int8 (`quantize_int8`); set, it wins over the others."""
        self.quantization = "none"
        """"none" (the checkpoint's dtype) or "int8" (after `quantize_int8`)."""
        self.weight_mapping = None
        """The host weight-cache file the packed weights are mapped from
        (`shared.models.weight_cache.Mapping`); None: held privately."""
        self.weight_bytes_saved = 0
        """Bytes `quantize_int8` freed (the checkpoint-dtype weights minus the int8 ones); the
        model runner adds them to the KV pool's budget."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn) -> torch.Tensor:
        """Run the decoder over one step's tokens.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64, each token's position in its sequence: its row of
                the rotary tables (read by nothing else), a long row for a longrope request
                rotated with the long factors (`RotaryEmbedding.long_rows`).
            kv_caches: per layer (k_cache, v_cache), each
                [num_blocks, block_size, num_kv_heads, head_dim].
            attn: the step's attention object (`shared.engine.attention.PagedAttention`),
                holding slot_mapping / block_table / seq_lens / query_start_loc.

        Returns:
            [num_tokens, hidden_size] hidden states before the final norm.
        """
        hidden = self.embed_tokens(input_ids)
        residual = None
        rotary_inputs = self.rotary.prepare(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, self.rotary, rotary_inputs, kv_cache,
                                     attn)
        return hidden + residual

    def set_packed_linear(self, enabled: bool) -> None:
        """Choose, once after the weights are loaded, how every linear layer and the LM head
        run on the CPU in fp32 (`shared.models.weight_layout`): from K-major panels
        (`kernels.cpu_gemv`, GEMV and GEMM), which replace the plain weights, a tied
        embedding included, so each parameter is held once; or, where that kernel cannot be
        built or PDSERVE_CPU_GEMV=0, from oneDNN-prepacked copies beside the plain weights
        (`kernels.cpu_linear`). Both differ from F.linear by fp32 rounding only.
        `enabled=False`, another device or dtype: plain weights and F.linear."""
        weight_layout.set_packed_linear(self, enabled)

    def quantize_int8(self) -> None:
        """Replace, once after the weights are loaded, the fp32 weights of every linear layer,
        the LM head and the embeddings by int8 ones, symmetric per output channel (row), and
        drop the fp32 copies (`kernels.cpu_int8`). All but `qkv_proj` also quantize their
        activations to int8 (W8A8 on VNNI, `kernels.cpu_int8_vnni`); `qkv_proj`, the most
        sensitive input (perplexity +2.72% in int8), takes 16-bit ones (+1.80% in all, +1.76%
        with fp32 ones). Norms, rotary tables and biases stay fp32.
        A tied LM head and embedding share one int8 tensor.

        Raises:
            ValueError: the weights are not on the CPU.
        """
        if self.norm.weight.device.type != "cpu":
            raise ValueError("--quantization int8 runs on the CPU only (--device cpu)")
        cpu_int8.load_kernel()  # compile once now, not in the first step
        before = self.resident_weight_bytes()
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                qkv = name.endswith("qkv_proj")
                module.int8_weight = cpu_int8.quantize_linear(
                    module.weight, module.bias, w8a8=not qkv, a16=qkv)
                module.packed = None
                module.gemv = None
                module.weight = None
                module.bias = None  # held by int8_weight
        self.lm_head_int8 = cpu_int8.quantize_linear(weight_layout.head_weight(self),
                                                     w8a8=True)
        self.lm_head_packed = None
        self.lm_head_gemv = None
        embedding = self.lm_head_int8
        if not self.args.tie_word_embeddings:
            self.lm_head_weight = None
            embedding = cpu_int8.quantize_linear(self.embed_tokens.weight)
        self.embed_tokens = Int8Embedding(embedding)
        self.quantization = "int8"
        self.weight_bytes_saved = max(0, before - self.resident_weight_bytes())

    def parameter_bytes(self) -> int:
        """Bytes of the model's parameters as loaded, however they are held
        (`weight_layout.parameter_bytes`; int8 layers are not counted)."""
        return weight_layout.parameter_bytes(self)

    def resident_weight_bytes(self) -> int:
        """Bytes of weights this model holds, all kinds together; a tensor shared by two
        owners (a tied int8 LM head and embedding) counts once."""
        return sum(self.weight_bytes_by_kind().values())

    def weight_bytes_by_kind(self) -> dict[str, int]:
        """Bytes of the weights this model holds, by kind: "weights" (parameters and buffers
        as loaded, rotary tables included), "packed_weights" (the panels or oneDNN copies of
        `set_packed_linear`), "int8_weights" (`quantize_int8`'s), "mapped_weights" (those
        mapped read-only from the host's weight cache, `shared.models.weight_cache`, held
        once per host whatever the number of engines). A tensor shared by two owners counts
        once, under the first kind that holds it."""
        return weight_layout.weight_bytes_by_kind(self)

    def set_fused_cpu_ops(self, enabled: bool) -> None:
        """Choose, once after the weights are loaded, between the fused CPU ops and the torch
        ops for every norm, MLP and the rotary embedding. Enabled needs fp32 or bf16 weights
        on CPU and a working C compiler (`kernels.cpu_fused.load_fused_kernels`); otherwise
        the torch ops stay. Both give bit-identical results."""
        weight = self.norm.weight
        enabled = (enabled and weight.device.type == "cpu"
                   and weight.dtype in (torch.float32, torch.bfloat16)
                   and cpu_fused.load_fused_kernels() is not None)
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.use_fused_cpu_ops = enabled
        self.rotary.use_fused_cpu_ops = enabled

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 logits."""
        hidden = self.norm(hidden)
        if self.lm_head_int8 is not None:
            return cpu_int8.linear(hidden, self.lm_head_int8)
        if self.lm_head_gemv is not None:
            logits = cpu_gemv.linear(hidden, self.lm_head_gemv, torch.float32)
            if logits is not None:
                return logits
        if self.lm_head_packed is not None:
            return cpu_linear.linear(hidden, self.lm_head_packed).float()
        return F.linear(hidden, weight_layout.head_weight(self)).float()
