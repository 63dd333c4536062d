"""Command lines of the scripts: one flag (or positional argument) per field of a config
dataclass (jaxpipe.config.flags), the cpu-8 model benchmarks' runner, and the checks the
scripts' configs share beyond jaxpipe.config.checks' (tuples of sizes, of names, shapes
written 'KxN').
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxpipe.config.flags import add_flags, config_from_args


def parser(doc: str) -> argparse.ArgumentParser:
    """An empty parser whose help starts with the script's docstring `doc`, as written."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse(doc: str, config_cls, argv: list[str] | None = None, *, group: str | None = None,
          skip: Iterable[str] = (), defaults: Mapping[str, Any] | None = None):
    """The `config_cls` the command line `argv` (default: sys.argv) describes: one flag per
    field of it (less `skip`; `defaults` as in `add_flags`); a value the class refuses is a
    usage error."""
    p = parser(doc)
    add_flags(p, config_cls, group=group, skip=skip, defaults=defaults)
    return config_from_args(config_cls, p.parse_args(argv), p)


def check_sizes(config, *names: str) -> None:
    """Each field of `names` is a non-empty tuple of integers >= 1."""
    for name in names:
        value = getattr(config, name)
        if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                            for v in value):
            raise ValueError(f"{type(config).__name__}.{name} must be one or more integers "
                             f">= 1, got {value!r}")


def check_names(config, name: str, known: Iterable[str]) -> None:
    """The field `name` is a non-empty tuple of names from `known`."""
    value, known = getattr(config, name), list(known)
    if not value or any(v not in known for v in value):
        raise ValueError(f"{type(config).__name__}.{name} must be one or more of {known}, "
                         f"got {list(value)!r}")


def dims(text: str, count: int, what: str) -> tuple[int, ...]:
    """'576x3072' -> (576, 3072): `count` positive integers joined by 'x', else a ValueError
    naming `what` (the config field)."""
    parts = text.split("x")
    if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
        form = "x".join("N" * count)
        raise ValueError(f"{what}: {text!r} is not {count} positive integers {form}")
    return tuple(map(int, parts))


def run_model_bench(doc: str, config_cls, run: Callable, format_record: Callable) -> None:
    """Parse `config_cls`'s flags (it has `model` and `out_path` fields), start 8 virtual CPU
    devices, load the model, `run(cfg, values, config)`, print `format_record(record)` and
    write the record as JSON to `config.out_path`."""
    config = parse(doc, config_cls, group="benchmark")
    from jaxpipe.runtime import sharding

    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend
    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    cfg, values = loading.load_weights(resolve_model(config.model))
    record = run(cfg, values, config)
    print(format_record(record))
    out = Path(config.out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")
