"""A Llama, Qwen2 or Qwen3-MoE checkpoint of seeded random weights in HF's format (config.json, bf16
safetensors, tokenizer files), for benchmarks on a model larger than the default one that every
engine loads from the same files (`scripts/make_checkpoint.py`).

The architecture is a dict of `models/*.toml`'s [architecture] fields; the tokenizer is
SmolLM2's (its vocabulary sets the checkpoint's), written by transformers from the bundled
GGUF. Weights are N(0, 0.02) (norms 1), drawn layer by layer from `seed` with NumPy and written
as bf16 bits straight into the safetensors file (no torch, no whole-model copy in memory).
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from jaxpipe.config.checks import check_choices

# TinyLlama-1.1B's layer shape (22 layers of 2048 wide, 4 KV heads), SmolLM2's vocabulary.
LLAMA_1B = {
    "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 22, "num_heads": 32,
    "num_kv_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_embeddings": False,
}
# Qwen2.5-0.5B's layer shape (Qwen/Qwen2.5-0.5B config.json: q/k/v biases, tied embeddings).
QWEN2_05B = {
    "family": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_layers": 24,
    "num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_embeddings": True,
}
# A ~1.0B-parameter Qwen3-MoE (q/k norms, 8 experts of 1408, 2 per token: ~0.32B active per
# token), Qwen3-30B-A3B's layout scaled down; SmolLM2's vocabulary.
QWEN3_MOE_1B = {
    "family": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 0, "num_layers": 24,
    "num_heads": 16, "num_kv_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_embeddings": False,
    "qk_norm": True, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 1408, "norm_topk_prob": True,
}
# make_checkpoint.py --family
FAMILIES = {"llama": LLAMA_1B, "qwen2": QWEN2_05B, "qwen3_moe": QWEN3_MOE_1B}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}
Family = Literal[tuple(sorted(FAMILIES))]


@dataclass(frozen=True)
class CheckpointConfig:
    """The checkpoint `scripts/make_checkpoint.py` writes (its arguments, jaxpipe.config.flags).

    out: directory to write
    seed: seeds the weights
    family: the architecture's family and shape (FAMILIES)
    tokenizer: a GGUF file or a directory of HF tokenizer files to take the tokenizer from
        (None: the default model's GGUF; a GPU machine without it gets the files from
        scripts/gpu_first_run.sh --prepare)
    num_layers: layers, when not the family's (a smaller checkpoint for a smoke run)
    """

    out: str = field(metadata={"positional": True})
    seed: int = 0
    family: Family = "llama"
    tokenizer: str | None = None
    num_layers: int | None = None

    def __post_init__(self):
        check_choices(self)
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"CheckpointConfig.num_layers must be >= 1, got {self.num_layers}")


def make_checkpoint(config: CheckpointConfig, log: Callable[[str], None] = print) -> Path:
    """`write_checkpoint` of `config`'s family (and layer count) with its tokenizer; logs the
    parameter count and the time taken."""
    from jaxpipe_bench.workload import default_gguf_path

    start = time.perf_counter()
    arch = FAMILIES[config.family]
    if config.num_layers is not None:
        arch = {**arch, "num_layers": config.num_layers}
    tokenizer = Path(config.tokenizer) if config.tokenizer else default_gguf_path()
    out = write_checkpoint(Path(config.out), arch, config.seed, tokenizer)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    params = sum(math.prod(shape) for shape in tensor_shapes(arch, vocab).values())
    log(f"wrote {out}: {params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f}s")
    return out


def hf_config(arch: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """config.json of `arch`'s family (default llama) with its dimensions."""
    family = arch.get("family", "llama")
    extra = {"use_sliding_window": False} if family in ("qwen2", "qwen3_moe") else {}
    if family == "qwen3_moe":  # every layer MoE
        extra |= {k: arch[k] for k in ("num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "norm_topk_prob")}
        extra |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
    return extra | {
        "architectures": [_HF_CLASSES[family]], "model_type": family, "hidden_act": "silu",
        "hidden_size": arch["hidden_size"], "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_layers"], "num_attention_heads": arch["num_heads"],
        "num_key_value_heads": arch["num_kv_heads"], "head_dim": arch["head_dim"],
        "rms_norm_eps": arch["rms_norm_eps"], "rope_theta": arch["rope_theta"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "tie_word_embeddings": arch["tie_embeddings"], "vocab_size": vocab_size,
        "attention_bias": family == "qwen2", "mlp_bias": False, "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(arch: dict, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape ([out, in] for linear layers) of every weight, in file order."""
    e, d = arch["hidden_size"], arch["head_dim"]
    q, kv = arch["num_heads"] * d, arch["num_kv_heads"] * d
    family = arch.get("family")
    shapes = {"model.embed_tokens.weight": (vocab_size, e)}
    for i in range(arch["num_layers"]):
        pre = f"model.layers.{i}."
        shapes |= {pre + "input_layernorm.weight": (e,),
                   pre + "self_attn.q_proj.weight": (q, e),
                   **({pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,),
                       pre + "self_attn.v_proj.bias": (kv,)} if family == "qwen2" else {}),
                   pre + "self_attn.k_proj.weight": (kv, e),
                   pre + "self_attn.v_proj.weight": (kv, e),
                   pre + "self_attn.o_proj.weight": (e, q),
                   **({pre + "self_attn.q_norm.weight": (d,), pre + "self_attn.k_norm.weight": (d,)}
                      if arch.get("qk_norm") else {}),
                   pre + "post_attention_layernorm.weight": (e,),
                   **_mlp_shapes(arch, pre + "mlp.")}
    shapes["model.norm.weight"] = (e,)
    if not arch["tie_embeddings"]:
        shapes["lm_head.weight"] = (vocab_size, e)
    return shapes


def _mlp_shapes(arch: dict, pre: str) -> dict[str, tuple[int, ...]]:
    """One layer's MLP: the dense one, or the router [X, E] and each expert's gate/up/down
    under the per-expert names transformers' save_pretrained writes."""
    e = arch["hidden_size"]
    if not arch.get("num_experts"):
        f = arch["intermediate_size"]
        return {pre + "gate_proj.weight": (f, e), pre + "up_proj.weight": (f, e),
                pre + "down_proj.weight": (e, f)}
    f = arch["moe_intermediate_size"]
    shapes = {pre + "gate.weight": (arch["num_experts"], e)}
    for x in range(arch["num_experts"]):
        shapes |= {f"{pre}experts.{x}.gate_proj.weight": (f, e),
                   f"{pre}experts.{x}.up_proj.weight": (f, e),
                   f"{pre}experts.{x}.down_proj.weight": (e, f)}
    return shapes


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """The weights of `shapes` as bf16: norms 1, the rest N(0, 0.02) from `seed`, one tensor
    at a time."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset,
                                                                                offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            norm = name.endswith("norm.weight")
            values = np.ones(shape, np.float32) if norm else (
                0.02 * rng.standard_normal(shape, dtype=np.float32))
            out.write(bf16_bits(values).tobytes())


def write_checkpoint(out: Path, arch: dict, seed: int, tokenizer_from: Path) -> Path:
    """config.json, model.safetensors and the tokenizer (from `tokenizer_from`, a GGUF file or
    a directory of HF tokenizer files, through transformers) in `out`; returns `out`."""
    from transformers import AutoTokenizer

    tokenizer = (AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from.is_dir()
                 else AutoTokenizer.from_pretrained(str(tokenizer_from.parent),
                                                    gguf_file=tokenizer_from.name))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    vocab = len(tokenizer)
    config = hf_config(arch, vocab, tokenizer.bos_token_id, tokenizer.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(out / "model.safetensors", tensor_shapes(arch, vocab), seed)
    return out
