"""orbax checkpoints (scripts/convert.py's, the fast path): the decoder's parameters as saved,
and the architecture as JSON beside them. No family rules: a checkpoint holds jaxpipe's own
parameters and `ModelConfig`."""

from __future__ import annotations

import json
from pathlib import Path

from jaxpipe.config.model import ModelConfig
from jaxpipe.model.presets import ORBAX_MARKER


def save_orbax(path: Path, cfg: ModelConfig, values: dict, dtype: str) -> None:
    """Write converted weights as an orbax checkpoint plus the architecture as JSON."""
    # lazy: orbax (tensorstore) loads only when a checkpoint is written or read
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", values, force=True)
    meta = {"config": cfg.to_dict(), "dtype": dtype}
    (path / ORBAX_MARKER).write_text(json.dumps(meta, indent=2))


def orbax_config(path: Path) -> ModelConfig:
    """The architecture saved beside an orbax checkpoint (no weights read)."""
    meta = json.loads((Path(path) / ORBAX_MARKER).read_text())
    return ModelConfig.from_dict(meta["config"])


def load_orbax(path: Path, target: dict | None = None) -> tuple[ModelConfig, dict]:
    """Restore an orbax checkpoint. `target` (name -> ShapeDtypeStruct with sharding) restores
    straight into those shardings; without it, arrays are placed on the default device."""
    # lazy: orbax (tensorstore) loads only when a checkpoint is written or read
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    cfg = orbax_config(path)
    with ocp.StandardCheckpointer() as ckptr:
        values = ckptr.restore(path / "params", target)
    return cfg, dict(values)
