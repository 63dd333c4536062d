"""A model's architecture: `ModelConfig` (and its `RopeScaling`), what the family modules
(`model/families/`) fill from a checkpoint's metadata. Frozen and hashable, so it can be a
static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

Dtype = Literal["float32", "bfloat16"]
DTYPES = typing.get_args(Dtype)


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")
MLP_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF's `rope_scaling` / `rope_parameters` defines it.

    rope_type: "llama3" (factor, low/high_freq_factor, original_max_position_embeddings),
        "linear" (every frequency / factor), "dynamic" (NTK: HF rescales only past
        max_position_embeddings, which the engine never runs, so the frequencies are the
        base ones), "yarn" (factor, beta_fast/slow, original_max_position_embeddings,
        truncate; cos and sin scaled by attention_factor), "longrope" (Phi-3: each frequency
        divided by its short_factor, cos and sin by attention_factor; long_factor is HF's past
        original_max_position_embeddings, where the engine does not run such a model)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type {self.rope_type!r} is not supported; "
                             f"supported: {list(ROPE_TYPES)}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
        if self.rope_type == "longrope" and not self.short_factor:
            raise ValueError("RopeScaling of type 'longrope' needs its short_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder of the Llama family and its relatives (Mistral, Qwen2/2.5,
    Qwen3, Gemma, Phi, and the mixtures of experts Qwen2/3-MoE and Mixtral). Hashable:
    usable as a static jit argument. Each family's module (`jaxpipe/model/families/`) says
    which of these switches it turns on and reads them from its checkpoints.

    qkv_bias: the q, k and v projections add a bias (Qwen2/2.5).
    qk_norm: q and k are RMS-normalised per head (a [head_dim] weight each) before RoPE
        (Qwen3).
    sliding_window: the layers in sliding_layers attend only over their last sliding_window
        keys (HF: key position > query position - sliding_window); the kernels read only
        the blocks inside each query's window.
    embed_scale: the embeddings' multiplier (Gemma: sqrt(hidden_size), rounded to the
        weights' dtype as HF does).
    sandwich_norms: the attention output and the MLP output are RMS-normalised before their
        residual adds too (Gemma 2/3: four norms per layer).
    mlp_act: the gated MLP's activation, "silu" or "gelu_tanh" (Gemma).
    attn_scale: the multiplier of q.k (None: 1/sqrt(head_dim); Gemma:
        query_pre_attn_scalar ** -0.5).
    attn_softcap, final_softcap: tanh soft-capping of the attention scores and of the
        logits, cap * tanh(x / cap) (Gemma 2); None: none.
    rotary_dim: how many of each head's leading dimensions RoPE rotates (Phi's
        partial_rotary_factor * head_dim); None: all of them.
    rope_local_theta: the RoPE base of the sliding-window layers (plain RoPE, no scaling),
        where it differs from the global layers' rope_theta / rope_scaling (Gemma 3's
        rope_local_base_freq); None: every layer uses rope_theta.
    num_experts: a mixture of experts (Qwen2/3-MoE, Mixtral) in every layer's MLP: this
        many experts, each a gated MLP moe_intermediate_size wide; 0: a dense model. Each
        token goes to its num_experts_per_tok experts of highest router probability (a
        softmax over all experts; exact ties to the lower expert index, where HF's
        torch.topk picks in an order of its own), weighted
        by those probabilities, renormalised to sum to 1 with norm_topk_prob (Mixtral's
        softmax over the top-k logits is the same thing).
    intermediate_size: the dense MLP's width; in an MoE model the shared expert's (Qwen2-MoE:
        a dense MLP beside the experts, its output times sigmoid(x . shared_gate)), 0 for
        none.
    dense_layers, dense_intermediate_size: in an MoE model, the layers whose MLP is a plain
        dense gated MLP dense_intermediate_size wide instead of the experts (Qwen2/3-MoE's
        mlp_only_layers and decoder_sparse_step); () and 0: every layer MoE. Such a model
        stores one uniform layer stack (`decoder.param_decls`): every layer holds the
        experts (zero in a dense layer) and a dense MLP `mlp_width` wide (zero-padded)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    mlp_act: str = "silu"
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_local_theta: float | None = None
    rotary_dim: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        self._check_mlp()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_layers and not (isinstance(self.sliding_window, int)
                                        and self.sliding_window >= 1):
            raise ValueError(f"ModelConfig.sliding_layers {self.sliding_layers} need a positive "
                             f"integer sliding_window, got {self.sliding_window!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ModelConfig.mlp_act {self.mlp_act!r} is not supported; "
                             f"supported: {list(MLP_ACTS)}")
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in [2, head_dim="
                             f"{self.head_dim}], got {self.rotary_dim!r}")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"ModelConfig.sliding_layers {bad} are not layers of "
                             f"0..{self.num_layers - 1}")

    def _check_mlp(self) -> None:
        """The dense MLP's width, and the experts' counts where the model has experts."""
        f, moe = self.intermediate_size, self.is_moe
        if not isinstance(f, int) or isinstance(f, bool) or f < (0 if moe else 1):
            raise ValueError(f"ModelConfig.intermediate_size must be a positive integer "
                             f"({'or 0 (no shared expert) ' if moe else ''}got {f!r})")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be an integer >= 0 (0: dense), "
                             f"got {self.num_experts!r}")
        if not moe:
            if (self.num_experts_per_tok or self.moe_intermediate_size or self.norm_topk_prob
                    or self.dense_layers or self.dense_intermediate_size):
                raise ValueError("ModelConfig.num_experts_per_tok, moe_intermediate_size, "
                                 "norm_topk_prob, dense_layers and dense_intermediate_size "
                                 "need num_experts >= 1 (got num_experts=0)")
            return
        k = self.num_experts_per_tok
        if not isinstance(k, int) or not 1 <= k <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                             f"{self.num_experts}], got {k!r}")
        if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig.moe_intermediate_size must be a positive integer "
                             f"in an MoE model, got {self.moe_intermediate_size!r}")
        if self.mlp_act != "silu":
            raise ValueError(f"ModelConfig.mlp_act {self.mlp_act!r} is not supported with "
                             "experts; supported: 'silu'")
        self._check_dense_layers()

    def _check_dense_layers(self) -> None:
        """An MoE model's dense layers: real layer indices, with a width (and a width only
        with them)."""
        layers, f = self.dense_layers, self.dense_intermediate_size
        bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"ModelConfig.dense_layers {bad} are not layers of "
                             f"0..{self.num_layers - 1}")
        if not isinstance(f, int) or isinstance(f, bool) or f < (1 if layers else 0):
            raise ValueError(f"ModelConfig.dense_intermediate_size must be a positive integer "
                             f"with dense_layers {list(layers)} (got {f!r})")
        if f and not layers:
            raise ValueError(f"ModelConfig.dense_intermediate_size={f} needs dense_layers "
                             "(the layers whose MLP is dense); got none")

    @property
    def is_moe(self) -> bool:
        """Whether the model has experts (in every layer but `dense_layers`)."""
        return self.num_experts > 0

    @property
    def mlp_width(self) -> int:
        """The width of the stacked dense MLP (`w_gate_up`, `w_down`): intermediate_size,
        or in a mixed dense/MoE model the wider of it (the shared expert's) and
        dense_intermediate_size (the narrower zero-padded: exact, silu(0) * 0 = 0)."""
        return max(self.intermediate_size, self.dense_intermediate_size)

    @property
    def context_limit(self) -> tuple[int, str]:
        """The longest sequence the engine runs this model at, and what sets it: its position
        embeddings, or LongRoPE's original_max_position_embeddings (HF switches every
        position's frequencies to long_factor once a forward pass passes it, which a batch
        engine whose sequences share steps cannot reproduce)."""
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            n = min(self.max_position_embeddings, s.original_max_position_embeddings)
            return n, (f"rope_scaling.original_max_position_embeddings={n} (LongRoPE: past it "
                       "HF changes every position's frequencies)")
        return self.max_position_embeddings, (
            f"max_position_embeddings={self.max_position_embeddings}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count as stored (the LM head counts separately only when untied; a mixed
        dense/MoE model's zero experts and zero-padded MLPs included)."""
        e, f, h, k, d = (self.hidden_size, self.mlp_width, self.num_heads,
                         self.num_kv_heads, self.head_dim)
        per_layer = e * (h * d) * 2 + e * (k * d) * 2 + 3 * e * f + 2 * e
        if self.is_moe:  # the router, the experts, the shared expert's gate
            per_layer += e * self.num_experts * (1 + 3 * self.moe_intermediate_size)
            per_layer += e if self.intermediate_size else 0
        per_layer += (h + 2 * k) * d if self.qkv_bias else 0
        per_layer += 2 * d if self.qk_norm else 0
        per_layer += 2 * e if self.sandwich_norms else 0
        total = self.num_layers * per_layer + e
        head = 0 if self.tie_embeddings else self.vocab_size * e
        return total + head + (self.vocab_size * e if include_embedding else 0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a plain dict (a preset's `[architecture]` table or saved JSON)."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; accepted: {sorted(known)}")
        if d.get("rope_scaling") is not None and not isinstance(d["rope_scaling"], RopeScaling):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for name in ("eos_token_ids", "sliding_layers", "dense_layers"):
            if name in d:
                d[name] = tuple(d[name])
        rope = d.get("rope_scaling")
        if isinstance(rope, RopeScaling):
            d["rope_scaling"] = dataclasses.replace(
                rope, short_factor=tuple(rope.short_factor), long_factor=tuple(rope.long_factor))
        return cls(**d)

    def to_dict(self) -> dict:
        """Inverse of `from_dict` (JSON-serialisable)."""
        return dataclasses.asdict(self)


