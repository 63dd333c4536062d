"""jaxpipe's checkpoint tensor names, and how they stack into the decoder's parameters.

Every loader renames a checkpoint's tensors to these names (the family's `hf_names` /
`gguf_names` tables), fixes their values where its format differs (`Family.hf_value`,
`gguf_value`), splits the fused ones (`split_fused`) and calls `stack`. Matrices are [out, in],
as HF's and GGUF's (read in NumPy order) are:

    embed [V, E], final_norm [E], lm_head [V, E]
    layers.{i}.attn_norm, mlp_norm [E]; post_attn_norm, post_mlp_norm [E] (Gemma's sandwich)
    layers.{i}.q [H*D, E], k, v [Hkv*D, E], o [E, H*D]; q_bias [H*D], k_bias, v_bias [Hkv*D]
    layers.{i}.q_norm, k_norm [D]
    layers.{i}.gate, up [F, E], down [E, F]: the dense MLP (Qwen2-MoE's shared expert)
    layers.{i}.router [X, E], shared_gate [E] or [1, E]
    layers.{i}.experts.{x}.gate, up [F', E], down [E, F']

and the fused ones `split_fused` splits: layers.{i}.qkv [(H + 2 Hkv) D, E] (Phi-3),
gate_up [2F, E] (Phi-3, gate first), experts.gate_up [X, 2F', E] (transformers' in-memory
experts), experts.gate, experts.up [X, F', E] and experts.down [X, E, F'] (stacked experts:
GGUF's, transformers' in-memory down).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from jaxpipe.config.model import ModelConfig

_FUSED = re.compile(r"layers\.(\d+)\.(qkv|gate_up|experts\.(?:gate_up|gate|up|down))")


class Lazy(Mapping):
    """Tensors by name, each read by `read(name)` when it is looked up (a loader's file read
    one tensor at a time, and only the tensors `stack` asks for)."""

    def __init__(self, names: Iterable[str], read: Callable[[str], np.ndarray]):
        self._names, self._read = dict.fromkeys(names), read

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def split_fused(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """`tensors` with every fused tensor replaced by its parts (see the module docstring).
    The others are not read here: a `Lazy` mapping stays lazy for them."""
    fused = {name: match for name in tensors if (match := _FUSED.fullmatch(name)) is not None}
    parts = {}
    for name, match in fused.items():
        pre = f"layers.{match[1]}."
        parts |= {pre + n: v for n, v in _split(cfg, match[2], tensors[name]).items()}
    kept = [name for name in tensors if name not in fused]
    return Lazy(kept + list(parts), lambda name: parts[name] if name in parts else tensors[name])


def _split(cfg: ModelConfig, part: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """One fused tensor's parts, under their names inside the layer."""
    if part == "qkv":
        q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return dict(zip(("q", "k", "v"), np.split(value, [q, q + k]), strict=True))
    if part == "gate_up":
        return dict(zip(("gate", "up"), np.split(value, 2), strict=True))
    if part == "experts.gate_up":  # [X, 2F', E]
        gate, up = np.split(value, 2, axis=1)
        return {f"experts.{x}.{n}": w[x] for x in range(len(value))
                for n, w in (("gate", gate), ("up", up))}
    kind = part.removeprefix("experts.")  # stacked [X, ...]
    return {f"experts.{x}.{kind}": w for x, w in enumerate(value)}


def stack(cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
          skip: frozenset[str] = frozenset(), dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxpipe-named [out, in] tensors -> the decoder's stacked parameters
    (`decoder.param_decls`) in `dtype`: matrices transposed to [in, out], heads split out,
    layers stacked along a leading axis, each parameter cast as soon as it is built (a lazy
    `tensors` then holds one parameter's tensors in f32 at a time). The parameters in `skip`
    (a dense model's linear weights, embedding and LM head: those held elsewhere, as GGUF
    blocks) are left out, their tensors not read."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    get = _getter(tensors)

    def layers(names: str | tuple[str, ...], fn: Callable[[np.ndarray], np.ndarray] = lambda w: w
               ) -> np.ndarray:
        """[L, ...]: fn of each layer's tensor `names` (several: stacked on axis 1 of each
        layer's), in `dtype`, filled a layer at a time (no stack of f32 copies)."""
        def layer(i: int) -> np.ndarray:
            if isinstance(names, str):
                return fn(get(f"layers.{i}.{names}"))
            return np.stack([fn(get(f"layers.{i}.{n}")) for n in names], axis=1)

        first = layer(0)
        out = np.empty((cfg.num_layers, *first.shape), dtype)
        out[0] = first
        for i in range(1, cfg.num_layers):
            out[i] = layer(i)
        return out

    build = {
        "embed": lambda: get("embed").astype(dtype, copy=False),
        "final_norm": lambda: get("final_norm").astype(dtype, copy=False),
        "attn_norm": lambda: layers("attn_norm"),
        "mlp_norm": lambda: layers("mlp_norm"),
        "wq": lambda: layers("q", lambda w: w.T.reshape(E, H, D)),
        "wkv": lambda: layers(("k", "v"), lambda w: w.T.reshape(E, K, D)),  # [L, E, 2, Hkv, D]
        "wo": lambda: layers("o", lambda w: w.T.reshape(H, D, E)),
    }
    if cfg.intermediate_size and not cfg.dense_layers:  # the dense MLP (Qwen2-MoE: shared)
        build["w_gate_up"] = lambda: layers(("gate", "up"), lambda w: w.T)  # [L, E, 2, F]
        build["w_down"] = lambda: layers("down", lambda w: w.T)
    if not cfg.tie_embeddings:
        build["lm_head"] = lambda: get("lm_head").T.astype(dtype, copy=False)
    if skip - set(build):
        raise ValueError(f"stack can leave out {sorted(build)} of this architecture, not "
                         f"{sorted(skip - set(build))}")
    values = {name: make() for name, make in build.items() if name not in skip}
    if cfg.dense_layers:  # a mixed dense/MoE model's, zero-padded
        values |= _mixed_mlp(cfg, get)
    if cfg.is_moe:
        values |= _experts(cfg, get)
    values |= _optional(cfg, layers)
    return {name: value.astype(dtype, copy=False) for name, value in values.items()}


def _optional(cfg: ModelConfig, layers) -> dict[str, np.ndarray]:
    """The switches' own parameters: q/k/v biases, q/k norms, Gemma's sandwich norms."""
    K, D = cfg.num_kv_heads, cfg.head_dim
    values = {}
    if cfg.qkv_bias:
        values["bq"] = layers("q_bias", lambda b: b.reshape(cfg.num_heads, D))
        values["bkv"] = np.stack([layers(f"{n}_bias", lambda b: b.reshape(K, D)) for n in "kv"],
                                 axis=1)  # [L, 2, Hkv, D]
    if cfg.qk_norm:
        values["q_norm"], values["k_norm"] = layers("q_norm"), layers("k_norm")
    if cfg.sandwich_norms:
        values["post_attn_norm"] = layers("post_attn_norm")
        values["post_mlp_norm"] = layers("post_mlp_norm")
    return values


def _getter(tensors: Mapping[str, np.ndarray]) -> Callable[[str], np.ndarray]:
    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the checkpoint has no tensor for jaxpipe's {name!r}, which its "
                             "architecture needs")
        return tensors[name]

    return get


def _experts(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """The router [L, E, X], the experts' gate/up [L, X, E, 2, F'] and down [L, X, F', E],
    and the shared expert's gate [L, E] (see `decoder.moe_decls`); zeros in
    `cfg.dense_layers`, which have none."""
    experts = range(cfg.num_experts)

    def expert(i: int, x: int, n: str) -> np.ndarray:
        return get(f"layers.{i}.experts.{x}.{n}").T

    def layers(fn) -> np.ndarray:  # [L, ...]: fn(i) in the MoE layers, zeros in the others
        got = {i: np.asarray(fn(i)) for i in range(cfg.num_layers) if i not in cfg.dense_layers}
        zero = np.zeros_like(next(iter(got.values())))
        return np.stack([got.get(i, zero) for i in range(cfg.num_layers)])

    values = {
        "router": layers(lambda i: get(f"layers.{i}.router").T),
        "w_experts_gate_up": layers(lambda i: [np.stack([expert(i, x, "gate"),
                                                         expert(i, x, "up")], axis=1)
                                               for x in experts]),
        "w_experts_down": layers(lambda i: [expert(i, x, "down") for x in experts]),
    }
    if cfg.intermediate_size:
        values["shared_gate"] = layers(lambda i: get(f"layers.{i}.shared_gate").reshape(-1))
    return values


def _mixed_mlp(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """A mixed dense/MoE model's dense MLP, gate/up [L, E, 2, F] and down [L, F, E] with
    F = `cfg.mlp_width`: each layer's (a dense layer's MLP, an MoE layer's shared expert)
    zero-padded to F, and zeros in an MoE layer without a shared expert (Qwen3-MoE)."""
    E, F = cfg.hidden_size, cfg.mlp_width
    gate_up, down = None, None
    for i in range(cfg.num_layers):
        if not (cfg.intermediate_size or i in cfg.dense_layers):
            continue
        gate, up, w_down = (get(f"layers.{i}.{n}").T for n in ("gate", "up", "down"))
        if gate_up is None:
            gate_up = np.zeros((cfg.num_layers, E, 2, F), gate.dtype)
            down = np.zeros((cfg.num_layers, F, E), gate.dtype)
        gate_up[i, :, 0, :gate.shape[1]], gate_up[i, :, 1, :up.shape[1]] = gate, up
        down[i, :w_down.shape[0]] = w_down
    return {"w_gate_up": gate_up, "w_down": down}
