"""Command lines of the cpu-8 model benchmarks: flags built from a bench config dataclass.

Each field of the config becomes a flag (`decode_batch` -> `--decode-batch`) with the field's
default; tuple fields take several values. Fields holding tuples of tuples (e.g. layout pairs)
stay at their defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

DTYPES = ("bfloat16", "float32")


def parser(doc: str, config_cls, default_out: str) -> argparse.ArgumentParser:
    """--model, --out and one flag per field of `config_cls`."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    for field in _flag_fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, tuple):
            p.add_argument(flag, nargs="+", type=type(default[0]), default=list(default))
        elif field.name == "dtype":
            p.add_argument(flag, default=default, choices=DTYPES)
        else:
            p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--out", default=default_out)
    return p


def config_from(args: argparse.Namespace, config_cls):
    """The config the parsed flags describe."""
    values = {}
    for field in _flag_fields(config_cls):
        value = getattr(args, field.name)
        values[field.name] = tuple(value) if isinstance(field.default, tuple) else value
    return config_cls(**values)


def run_model_bench(doc: str, config_cls, run: Callable, format_record: Callable,
                    default_out: str) -> None:
    """Parse flags, start 8 virtual CPU devices, load the model, `run(cfg, values, config)`,
    print `format_record(record)` and write the record as JSON to --out."""
    args = parser(doc, config_cls, default_out).parse_args()
    from jaxpipe import sharding

    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend
    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    cfg, values = loading.load_weights(resolve_model(args.model))
    record = run(cfg, values, config_from(args, config_cls))
    print(format_record(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


def _flag_fields(config_cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_cls)
            if not (isinstance(f.default, tuple) and f.default
                    and isinstance(f.default[0], tuple))]
