"""The model families jaxpipe runs: one module each, named by the family's one name in jaxpipe
(`llama`, `mistral`, `qwen2`, `qwen3`, `gemma2`, `gemma3`, `phi3`, `qwen2_moe`, `qwen3_moe`,
`mixtral`), each defining `FAMILY`, a `model.family.Family` that says everything the family is.
This package finds them by name, by HF architecture or by GGUF architecture.

Adding a family: one new module here (its `FAMILY`, usually built from the family it varies,
as `mistral` from `llama`) and its tests; the registry finds every module of this package.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from jaxpipe.model.family import Family


@cache
def all_families() -> tuple[Family, ...]:
    """Every family, in module-name order (each module's `FAMILY`, named as its module)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if not isinstance(family, Family) or family.name != info.name:
            raise TypeError(f"jaxpipe/model/families/{info.name}.py must define FAMILY, a "
                            f"Family named {info.name!r}")
        found.append(family)
    return tuple(found)


def by_name(name: str) -> Family:
    """The family jaxpipe calls `name` (e.g. "qwen2_moe")."""
    found = {f.name: f for f in all_families()}
    if name not in found:
        raise ValueError(f"model family {name!r} is not supported; supported: {sorted(found)}")
    return found[name]


def hf_architectures() -> list[str]:
    """Every HF architecture a family reads, sorted."""
    return sorted(a for f in all_families() for a in f.hf_architectures)


def by_hf_architecture(architecture: str) -> Family:
    """The family of an HF `architectures` entry (e.g. "Qwen2MoeForCausalLM")."""
    for family in all_families():
        if architecture in family.hf_architectures:
            return family
    raise ValueError(f"HF architecture {architecture!r} is not supported; supported: "
                     f"{hf_architectures()}")


def for_hf_config(config_json: dict) -> Family:
    """The family of an HF config.json: its first `architectures` entry a family reads, or
    without `architectures`, its `model_type`."""
    archs = config_json.get("architectures") or []
    for arch in archs:
        if arch in hf_architectures():
            return by_hf_architecture(arch)
    model_type = config_json.get("model_type")
    for family in all_families():
        if not archs and model_type in family.hf_model_types:
            return family
    raise ValueError(f"config.json architectures={archs} (model_type={model_type!r}) is not "
                     f"supported; supported: {hf_architectures()}")


def by_gguf_architecture(architecture: str, experts: int = 0) -> Family:
    """The family of a GGUF file's `general.architecture`, with `experts` its
    `{arch}.expert_count` (0: none); llama.cpp writes Mixtral as `llama` with experts."""
    named = [f for f in all_families() if architecture in f.gguf_architectures]
    if not named:
        supported = sorted({a for f in all_families() for a in f.gguf_architectures})
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported)}")
    for family in named:
        if family.has_experts == (experts > 0):
            return family
    if experts:
        moe = sorted({a for f in all_families() if f.has_experts for a in f.gguf_architectures})
        raise ValueError(f"GGUF {architecture} with {architecture}.expert_count={experts} is "
                         f"not supported; experts are supported in: {', '.join(moe)}")
    raise ValueError(f"GGUF {architecture} has no {architecture}.expert_count (or 0); a "
                     f"{architecture} file needs its expert count")
