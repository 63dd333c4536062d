"""HF checkpoint directories: `config.json` and `*.safetensors` -> (`ModelConfig`, the
decoder's parameters). What differs by family (which switches, which defaults, which tensor
names) is the family module's (`model/families/`); this module reads the format."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxpipe.config.model import ModelConfig
from jaxpipe.model import families, rope_config, tensors
from jaxpipe.model.family import Family, rename

# config.json's activation names -> ModelConfig.mlp_act.
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Tensors a checkpoint may hold that are not weights: older Llama checkpoints' RoPE
# frequencies (jaxpipe computes them from the config, as HF does).
_NOT_WEIGHTS = ("rotary_emb.inv_freq",)


def hf_config(config_json: dict) -> ModelConfig:
    """Architecture from an HF `config.json` of a family of `families.all_families()`: the
    fields every family has, then the family's switches and its own fields. Any value of a
    field jaxpipe does not implement fails, naming the field and what is supported."""
    family = families.for_hf_config(config_json)
    c = {**family.hf_defaults, **config_json}
    _refuse_unsupported(c, family)
    rope = family.hf_rope(c)
    window, sliding = family.hf_window(c)
    fields = _common_fields(c) | dict(
        rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
        rope_scaling=rope_config.rope_scaling(rope, c), mlp_act=_activation(c, family),
        sliding_window=window, sliding_layers=sliding)
    head_dim = fields["head_dim"]
    rotary = int(head_dim * float(rope.get("partial_rotary_factor")
                                   or c.get("partial_rotary_factor") or 1.0))
    fields["rotary_dim"] = rotary if rotary != head_dim else None
    return ModelConfig(**fields | dict(family.features) | family.hf_fields(c))


def _common_fields(c: dict) -> dict:
    """The fields every family reads alike."""
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c.get("intermediate_size"), num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))


def _activation(c: dict, family: Family) -> str:
    act = c.get(family.hf_act_key, "silu")
    if act not in _ACTS:
        raise ValueError(f"config.json {family.hf_act_key}={act!r} is not supported; "
                         f"supported: {sorted(_ACTS)}")
    return _ACTS[act]


def _refuse_unsupported(c: dict, family: Family) -> None:
    """The config.json switches no family of jaxpipe's runs: MLP biases, attention biases
    outside the families whose q/k/v have them, bidirectional attention."""
    if c.get("attention_bias") and not family.features.get("qkv_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {family.name} "
                         "(biases only on Qwen2's q/k/v projections)")
    if c.get("mlp_bias"):
        raise ValueError(f"config.json mlp_bias=true is not supported for {family.name}")
    if c.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true is not supported; "
                         "supported: causal attention")


def load_hf_dir(path: Path, dtype=np.float32) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read config.json and the *.safetensors files of an HF checkpoint directory into
    parameters of `dtype`, one tensor at a time as `tensors.stack` asks for it."""
    config = json.loads((path / "config.json").read_text())
    family, cfg = families.for_hf_config(config), hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has config.json but no *.safetensors files")
    with ExitStack() as opened:  # each file opened once (mapped), closed after the load
        handles = {file: opened.enter_context(safe_open(str(file), framework="np"))
                   for file in files}
        where: dict[str, tuple[Path, str]] = {}
        for file, handle in handles.items():
            where |= _names_in(file, handle, family)

        def read(ours: str) -> np.ndarray:
            file, name = where[ours]
            value = np.asarray(handles[file].get_tensor(name), dtype=np.float32)
            return family.hf_value(cfg, ours, value)

        lazy = tensors.Lazy(where, read)
        return cfg, tensors.stack(cfg, tensors.split_fused(cfg, lazy), dtype=dtype)


def _names_in(file: Path, handle, family: Family) -> dict[str, tuple[Path, str]]:
    """One safetensors file's tensors (`handle`: the file opened) by jaxpipe's name ->
    (the file, the checkpoint's name)."""
    out = {}
    for name in handle.keys():
        ours = rename(family.hf_names, name)
        if ours is None and name.endswith(_NOT_WEIGHTS):
            continue
        if ours is None:
            raise ValueError(f"{file}: tensor {name!r} is not one of {family.name}'s "
                             "(model/families/) that jaxpipe runs")
        out[ours] = (file, name)
    return out
