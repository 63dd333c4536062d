#!/usr/bin/env python
"""The flowing pipeline two ways on virtual CPU devices (issue 48): the engine's design (b),
one SPMD tick program over the whole mesh, against design (a), MPMD: one program per stage on
its own devices, dispatched asynchronously, activations moved by `device_put`. Decode
micro-batches of 16 and 64 tokens, and 16/128 alternating (spmd pads every slot to 128);
ms per tick and useful tok/s of each, on SmolLM2-135M's decoder layers with random weights,
f32 (logic and flags: `MpmdBenchConfig` in jaxpipe_bench.mpmd).

  python scripts/bench_mpmd.py --layout pp=8 --ticks 4 --json out/mpmd_pp8.json
  python scripts/bench_mpmd.py --layout pp=4,tp=2 --cases 16/128 --ticks 3 --repeats 2
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, mpmd  # noqa: E402


def main() -> None:
    config = cli.parse(__doc__, mpmd.MpmdBenchConfig)
    from jaxpipe.config.layout import Layout
    from jaxpipe.runtime import sharding

    sharding.ensure_cpu_devices(Layout.parse(config.layout).num_devices)
    from jaxpipe.model import decoder, loading
    from jaxpipe.model.presets import resolve_model
    from jaxpipe_bench.report import machine_info

    machine = machine_info()
    print(f"{machine['cpu_model']} ({', '.join(machine['isa'])}), {machine['cpu_count']} "
          f"cores, load {machine['loadavg_at_start'][0]:.2f}; xla attention, "
          f"context {config.context}, median of {config.repeats} x {config.ticks} ticks")
    cfg = loading.source_config(resolve_model(config.model))
    values = decoder.numpy_random_values(cfg, seed=0)
    print(mpmd.format_table([]))
    points = mpmd.run(cfg, values, config, partial(print, flush=True))
    if config.json_path:
        out = Path(config.json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine, "config": asdict(config),
                                   "points": points}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
