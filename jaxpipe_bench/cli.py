"""Command lines of the cpu-8 model benchmarks: --model, --out and one flag per field of a bench
config dataclass (jaxpipe.config_flags; fields holding tuples of tuples, e.g. layout pairs, keep
their defaults).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from jaxpipe.config_flags import add_flags, config_from_args


def parser(doc: str, config_cls, default_out: str) -> argparse.ArgumentParser:
    """--model, --out and one flag per field of `config_cls`."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=default_out)
    add_flags(p, config_cls, group="benchmark")
    return p


def run_model_bench(doc: str, config_cls, run: Callable, format_record: Callable,
                    default_out: str) -> None:
    """Parse flags, start 8 virtual CPU devices, load the model, `run(cfg, values, config)`,
    print `format_record(record)` and write the record as JSON to --out."""
    p = parser(doc, config_cls, default_out)
    args = p.parse_args()
    config = config_from_args(config_cls, args, p)
    from jaxpipe import sharding

    sharding.ensure_cpu_devices(8)  # before anything starts JAX's backend
    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    cfg, values = loading.load_weights(resolve_model(args.model))
    record = run(cfg, values, config)
    print(format_record(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")

