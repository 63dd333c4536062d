"""GGUF files (llama.cpp's format): metadata and dequantized tensors -> (`ModelConfig`, the
decoder's parameters). The family (`model/families/`, found by `general.architecture` and
whether the file has experts) says what its keys and tensor names mean; this module reads
the format."""

from __future__ import annotations

import os
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from gguf import GGUFReader, quants

from jaxpipe.config.model import ModelConfig
from jaxpipe.model import families, tensors
from jaxpipe.model.family import Family, rename


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """The GGUF file at `path`, parsed (its metadata, and its tensors mapped, not read). An
    engine reads a file's header for four things (architecture, blocks, weights, tokenizer)
    and a header takes seconds to parse (SmolLM2's: 2.0-2.4 s; its tokenizer arrays): one
    parse serves them all while the file (its inode: another file moved there, as `cp -p`
    or `rsync` leave it, is another), its size and its modification time stay the same."""
    path = Path(path).absolute()
    stat = path.stat()  # FileNotFoundError names the path
    return _parsed(path, stat.st_ino, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)  # an engine's file or two; not every file a process ever opened
def _parsed(path: Path, inode: int, mtime_ns: int, size: int) -> GGUFReader:
    del inode, mtime_ns, size  # the cache's key: a file written again is parsed again
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueErrors without the path
        raise ValueError(f"could not read {str(path)!r} as a GGUF file: {exc}") from exc


class GGUFMetadata:
    """A GGUF file's metadata as the family modules read it: `key("block_count")` is the
    architecture's `{arch}.block_count`, `field` a top-level key, and the tensors' names
    and shapes (no data read)."""

    def __init__(self, reader):
        self.reader = reader
        self.arch = self.field("general.architecture")

    def field(self, key: str, default=None):
        """The value of metadata `key` (e.g. "tokenizer.ggml.eos_token_id"), or `default`."""
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    def key(self, name: str, default=None):
        """The value of the architecture's key `{arch}.{name}`, or `default`."""
        return self.field(f"{self.arch}.{name}", default)

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        """Every tensor's name."""
        return frozenset(t.name for t in self.reader.tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in NumPy order ([out, in] for a matrix; GGUF stores it reversed)."""
        t = next(t for t in self.reader.tensors if t.name == name)
        return tuple(int(n) for n in reversed(t.shape))

    def tensor_values(self, name: str) -> np.ndarray:
        """A float32 tensor's values, flat (the small ones read into the config)."""
        t = next(t for t in self.reader.tensors if t.name == name)
        return np.asarray(t.data, np.float32).reshape(-1)

    @property
    def layers(self) -> int:
        return int(self.key("block_count"))

    @property
    def hidden(self) -> int:
        return int(self.key("embedding_length"))

    @property
    def heads(self) -> int:
        return int(self.key("attention.head_count"))

    @property
    def head_dim(self) -> int:
        return int(self.key("attention.key_length", self.hidden // self.heads))


def gguf_family(reader) -> Family:
    """The family of a GGUF file: its `general.architecture`, with or without experts."""
    meta = GGUFMetadata(reader)
    return families.by_gguf_architecture(meta.arch, int(meta.key("expert_count", 0) or 0))


def gguf_config(reader) -> ModelConfig:
    """Architecture from GGUF metadata (`{arch}.*` keys as llama.cpp writes them): the
    fields every family has, then the family's switches and its own fields (llama.cpp's rules
    where the file has no key)."""
    family, meta = gguf_family(reader), GGUFMetadata(reader)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if (
        "tokenizer.ggml.tokens" in reader.fields) else int(meta.key("vocab_size"))
    eos, rotary, width = (meta.field("tokenizer.ggml.eos_token_id"),
                          meta.key("rope.dimension_count"), meta.key("feed_forward_length"))
    names = meta.tensor_names
    fields = dict(
        vocab_size=vocab, hidden_size=meta.hidden, num_layers=meta.layers, num_heads=meta.heads,
        num_kv_heads=int(meta.key("attention.head_count_kv", meta.heads)),
        head_dim=meta.head_dim,
        rotary_dim=int(rotary) if rotary is not None and int(rotary) != meta.head_dim else None,
        intermediate_size=None if width is None else int(width),
        rms_norm_eps=float(meta.key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.key("context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=meta.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        # llama.cpp's optional tensors: a file's q/k/v biases and q/k norms turn them on.
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names)
    return ModelConfig(**fields | dict(family.features) | family.gguf_fields(meta))


def load_gguf(path: Path, skip: frozenset[str] = frozenset(), dtype=np.float32
              ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read and dequantize a GGUF file into parameters of `dtype`, one tensor at a time as
    `tensors.stack` asks for it; the parameters in `skip` (those kept in their blocks,
    `gguf_weights.py`) are not read."""
    reader = open_gguf(path)
    family, cfg = gguf_family(reader), gguf_config(reader)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: GGUF with rope_freqs (Llama-3.1 scaling) is not supported yet")
    by_name = {}
    for t in reader.tensors:
        if t.name in family.gguf_config_tensors:
            continue
        ours = rename(family.gguf_names, t.name)
        if ours is None:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} is not supported (a part of "
                             f"the {cfg.num_layers}-layer {family.name} model jaxpipe does "
                             "not run)")
        by_name[ours] = t

    def read(name: str) -> np.ndarray:
        t = by_name[name]
        value = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        return family.gguf_value(cfg, name, value.reshape([int(n) for n in reversed(t.shape)]))

    lazy = tensors.Lazy(by_name, read)
    return cfg, tensors.stack(cfg, tensors.split_fused(cfg, lazy), skip, dtype)
