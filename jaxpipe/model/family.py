"""What a model family is: one `Family` record per module of `jaxpipe/model/families/`.

A family says, for both file formats jaxpipe reads weights from (HF safetensors directories,
GGUF files):
- its names: HF `architectures` / `model_type`, GGUF `general.architecture`;
- its config: the `ModelConfig` switches it always turns on (`features`), HF's defaults for
  the keys a config.json may leave out, and hooks that read what varies per checkpoint;
- its tensors: a table from each checkpoint name to jaxpipe's (`model/tensors.py`) and the
  value fixes the format needs (llama.cpp's Q/K row order, Gemma's 1 + w norms).

The format loaders (`hf_dir.py`, `gguf_file.py`) read the format and ask the family for the
rest; the rules here are the ones several families share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from jaxpipe.config.model import ModelConfig
    from jaxpipe.model.gguf_file import GGUFMetadata

# A hook's config fields: ModelConfig keyword arguments.
Fields = dict[str, Any]
# (config, jaxpipe tensor name, value) -> the value in jaxpipe's layout.
ValueFix = Callable[["ModelConfig", str, "np.ndarray"], "np.ndarray"]


def no_fields(_source) -> Fields:
    """A hook for a family that reads nothing more."""
    return {}


def keep_value(_cfg, _name: str, value):
    """A value fix for a format whose values are already in jaxpipe's layout."""
    return value


def one_rope(c: dict) -> dict:
    """Every layer's RoPE from `rope_scaling` / `rope_parameters` (no per-layer-type one)."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:
        raise ValueError(f"config.json rope_parameters per layer type {nested} are not "
                         f"supported for {c.get('architectures')}; supported: one RoPE for "
                         "every layer (Gemma 3: one per layer type)")
    return rope


def sliding_layers(c: dict, window, default_types: Callable[[int], list[str]]
                   ) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to) as HF builds `layer_types`: config.json's own, or
    `default_types(layers)`; no window, no sliding layer."""
    if window is None:
        return None, ()
    types = c.get("layer_types")
    if types is None:
        types = default_types(c["num_hidden_layers"])
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ValueError(f"config.json layer_types {bad} are not supported; supported: "
                         "'full_attention', 'sliding_attention'")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (int(window) if sliding else None), sliding


def window_on_every_layer(c: dict) -> tuple[int | None, tuple[int, ...]]:
    """HF's rule for Llama, Mistral, Phi-3, Mixtral: `sliding_window` on every layer."""
    return sliding_layers(c, c.get("sliding_window"),
                          lambda layers: ["sliding_attention"] * layers)


def expert_count(c: dict, default: int) -> int:
    """An HF MoE config's expert count: transformers writes `num_experts` or
    `num_local_experts` (its attribute map aliases them), by version; `default` where neither
    is set (the config class's)."""
    return c.get("num_experts") or c.get("num_local_experts") or default


@dataclass(frozen=True, eq=False)
class Family:
    """Everything jaxpipe knows about one model family (see the module docstring).

    name: the family's one name in jaxpipe (e.g. "qwen2_moe"; GGUF's "qwen2moe" is only
        `gguf_architectures` data).
    hf_architectures, hf_model_types: config.json's `architectures` entries it reads, and
        the `model_type`s that identify it when a config.json has no `architectures`.
    gguf_architectures: the GGUF `general.architecture` values it reads. Two families may
        share one (Mixtral is written as `llama` with experts): `has_experts` tells them apart.
    hf_names, gguf_names: a checkpoint's tensor names -> jaxpipe's (`model/tensors.py`),
        `{i}` standing for the layer index and `{x}` for the expert index. A tensor the
        table lacks fails the load naming it.
    features: the ModelConfig switches the family always turns on (e.g. qk_norm=True).
    has_experts: a mixture of experts (a GGUF of it has `{arch}.expert_count`).
    hf_defaults: the values HF's config class assumes for keys config.json leaves out.
    hf_act_key: config.json's key of the MLP's activation.
    hf_rope: config.json -> the RoPE dict (`rope_config.rope_scaling`'s) of its global layers.
    hf_window: config.json -> (sliding window, the layers it applies to).
    hf_fields, gguf_fields: the ModelConfig fields the family reads from config.json / GGUF
        metadata beyond the ones every family has (`hf_dir.hf_config`, `gguf_file.gguf_config`).
    hf_value, gguf_value: each tensor's value fix, by jaxpipe name.
    gguf_config_tensors: GGUF tensors read into the config, not weights (LongRoPE's factors).
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    hf_names: Mapping[str, str]
    gguf_names: Mapping[str, str]
    features: Mapping[str, Any] = field(default_factory=dict)
    has_experts: bool = False
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    hf_act_key: str = "hidden_act"
    hf_rope: Callable[[dict], dict] = one_rope
    hf_window: Callable[[dict], tuple[int | None, tuple[int, ...]]] = window_on_every_layer
    hf_fields: Callable[[dict], Fields] = no_fields
    gguf_fields: Callable[[GGUFMetadata], Fields] = no_fields
    hf_value: ValueFix = keep_value
    gguf_value: ValueFix = keep_value
    gguf_config_tensors: tuple[str, ...] = ()


def per_layer(prefix: str, table: Mapping[str, str]) -> dict[str, str]:
    """A layer's names: `prefix + name` -> `layers.{i}.` + jaxpipe's name."""
    return {prefix + name: "layers.{i}." + ours for name, ours in table.items()}


# A checkpoint name's layer and expert indices: the first and second `.<digits>.` parts.
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def rename(names: Mapping[str, str], name: str) -> str | None:
    """`name`'s jaxpipe name under `names` (a `Family.hf_names` / `gguf_names` table), or
    None where the table has no entry for it."""
    indices: list[str] = []

    def mark(match: re.Match) -> str:  # the first index is the layer's, the second the expert's
        indices.append(match.group())
        return "{" + "ix"[len(indices) - 1] + "}"

    target = names.get(_INDEX.sub(mark, name, count=2))
    return None if target is None else target.format(**dict(zip("ix", indices, strict=False)))


def gguf_experts(meta: GGUFMetadata, norm_topk: bool) -> Fields:
    """The experts' fields of a GGUF mixture of experts, as llama.cpp stores them: its count
    `{arch}.expert_count`, their width `expert_feed_forward_length` (Mixtral as `llama`:
    `feed_forward_length`), Qwen2-MoE's shared expert `expert_shared_feed_forward_length`
    (the dense MLP's width; 0: none). `norm_topk`: whether llama.cpp renormalises the top-k
    router weights, fixed per architecture there (its build_moe_ffn's norm_w), not a key."""
    dense = [i for i in range(meta.layers)
             if f"blk.{i}.ffn_gate_exps.weight" not in meta.tensor_names]
    if dense:  # gguf's qwen2moe/qwen3moe tensor maps have no dense ffn_gate/up/down either
        raise ValueError(f"GGUF {meta.arch} layer {dense[0]} has no experts (no blk.{dense[0]}."
                         "ffn_gate_exps.weight): dense layers among the MoE ones are not "
                         "supported from GGUF (llama.cpp's MoE architectures need experts in "
                         "every layer); load the HF checkpoint instead")
    width = meta.key("expert_feed_forward_length") or meta.key("feed_forward_length")
    shared = 0
    if "blk.0.ffn_gate_shexp.weight" in meta.tensor_names:
        shared = int(meta.key("expert_shared_feed_forward_length", 0)) or int(
            meta.tensor_shape("blk.0.ffn_gate_shexp.weight")[0])  # [F, E]
    return dict(num_experts=int(meta.key("expert_count")),
                num_experts_per_tok=int(meta.key("expert_used_count")),
                moe_intermediate_size=int(width), norm_topk_prob=norm_topk,
                intermediate_size=shared)
