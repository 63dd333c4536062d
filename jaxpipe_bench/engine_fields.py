"""`--engine-field KEY=VALUE[,VALUE...]`: EngineConfig fields a benchmark passes through as
given, each value one configuration (crossed with the other fields' values), so that a knob
the engine gains (`quantization`, `kv_cache_dtype`) is measured by the scripts without their
flags changing. Shared by scripts/perplexity.py and scripts/bench_throughput.py."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from jaxpipe.config.engine import EngineConfig


def parse_value(text: str) -> Any:
    """An --engine-field value: an int, a float, true/false, none (None), else the text."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_engine_field(text: str) -> tuple[str, list[Any]]:
    """'KEY=V1,V2' -> (KEY, [V1, V2]); KEY must be an EngineConfig field."""
    key, eq, values = text.partition("=")
    key = key.strip().replace("-", "_")
    known = [f.name for f in dataclasses.fields(EngineConfig)]
    if not eq or not key or not values.strip():
        raise ValueError(f"--engine-field takes KEY=VALUE[,VALUE...], got {text!r}")
    if key not in known:
        raise ValueError(f"--engine-field {key}: EngineConfig has no field {key!r}; its "
                         f"fields: {', '.join(known)}")
    return key, [parse_value(v) for v in values.split(",")]


def field_choices(fields: Sequence[str], first: Sequence[tuple[str, Any]] = ()
                  ) -> list[dict[str, Any]]:
    """Every configuration `fields` describe: each field's values crossed with the others', in
    the order given (the first: every first value), after the axis `first` ((key, value)
    pairs: e.g. the dtypes); [{}] when there is nothing to cross."""
    axes = [list(first)] if first else []
    axes += [[(k, v) for v in vs] for k, vs in (parse_engine_field(f) for f in fields)]
    return [dict(choice) for choice in itertools.product(*axes)]


def label(fields: dict[str, Any]) -> str:
    """A configuration in one cell: "key=value key=value" ("" for none)."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
