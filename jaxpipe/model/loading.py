"""A resolved `ModelSource` -> its architecture, weights and tokenizer, whichever format it is
in: GGUF (`gguf_file.py`), an HF safetensors directory (`hf_dir.py`) or an orbax checkpoint
(`orbax_dir.py`). Every loader produces `(ModelConfig, {param name: array})` in the layout
`decoder.param_decls` declares."""

from __future__ import annotations

import json
from functools import partial

import numpy as np

from jaxpipe.config.model import ModelConfig
from jaxpipe.model import gguf_file, hf_dir, orbax_dir
from jaxpipe.model.tokenizer import Tokenizer


def load_weights(source, skip: frozenset[str] = frozenset(), dtype=np.float32
                 ) -> tuple[ModelConfig, dict]:
    """Route on a resolved `ModelSource`; GGUF and HF weights come in `dtype` (an orbax
    checkpoint's in its own), a GGUF file's parameters in `skip` (those kept in their
    blocks) not read."""
    loaders = {"gguf": partial(gguf_file.load_gguf, skip=skip, dtype=dtype),
               "hf": partial(hf_dir.load_hf_dir, dtype=dtype), "orbax": orbax_dir.load_orbax}
    if source.kind not in loaders:
        raise ValueError(f"model {source.name!r} has no weights (architecture-only preset); "
                         "use EngineConfig(random_weights=True) for benchmarks")
    if skip and source.kind != "gguf":
        raise ValueError(f"only a GGUF file's weights are read in part; {source.name!r} is "
                         f"{source.kind}")
    return loaders[source.kind](source.path)


def source_config(source) -> ModelConfig:
    """A resolved `ModelSource`'s architecture from its metadata alone (the preset's table,
    the GGUF header, config.json, or the orbax checkpoint's description): no weights read."""
    if source.config is not None:
        return source.config
    if source.kind == "gguf":
        return gguf_file.gguf_config(gguf_file.open_gguf(source.path))
    if source.kind == "hf":
        return hf_dir.hf_config(json.loads((source.path / "config.json").read_text()))
    if source.kind == "orbax":
        return orbax_dir.orbax_config(source.path)
    raise ValueError(f"model {source.name!r} ({source.kind}) has no architecture to read")


def load_tokenizer(source):
    """The tokenizer that goes with a resolved `ModelSource`, or None (architecture-only)."""
    if source.kind == "gguf":
        return Tokenizer.from_gguf_reader(gguf_file.open_gguf(source.path))
    if source.kind in ("hf", "orbax") and (source.path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(source.path)
    return None
