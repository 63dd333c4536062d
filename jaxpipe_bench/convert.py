"""A GGUF file, an HF directory or a preset converted into an orbax checkpoint, the fast path
to load (scripts/convert.py): the weights in float32 (lossless) or bfloat16, and the tokenizer
beside them where the source has one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxpipe.config.checks import check_choices
from jaxpipe.config.model import Dtype


@dataclass(frozen=True)
class ConvertConfig:
    """What `scripts/convert.py` converts (its arguments, jaxpipe.config.flags).

    model: preset name, .gguf file or HF directory
    output: directory to write the orbax checkpoint into
    dtype: dtype of the stored weights (float32: lossless)
    """

    model: str = field(metadata={"positional": True})
    output: str = field(metadata={"positional": True})
    dtype: Dtype = "float32"

    def __post_init__(self):
        check_choices(self)


def convert(config: ConvertConfig, log: Callable[[str], None] = print) -> None:
    """Write `config.model`'s weights (in `config.dtype`) and tokenizer to `config.output`."""
    import numpy as np

    from jaxpipe.model import loading, orbax_dir
    from jaxpipe.model.presets import resolve_model

    start = time.perf_counter()
    source = resolve_model(config.model)
    cfg, values = loading.load_weights(source)
    if config.dtype == "bfloat16":
        import ml_dtypes

        values = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in values.items()}
    orbax_dir.save_orbax(config.output, cfg, values, config.dtype)
    tokenizer = loading.load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save(config.output)
    log(f"wrote {config.output} ({config.dtype}, {cfg.num_params() / 1e6:.0f}M params) in "
        f"{time.perf_counter() - start:.1f} s")
