#!/usr/bin/env python
"""Where jaxpipe's time goes on a benchmark workload, per op family: the step's matmuls,
attention and other ops, the LM head, sampling, KV swaps, and the host's work (the logic and
what each family holds: `jaxpipe_bench.profile`).

  python scripts/profile_step.py                                  # the default workload
  python scripts/profile_step.py --input-len 1024 --output-len 128
Takes bench_throughput.py's workload and engine flags (`BenchConfig`), `--engine-field`
included (one profile per configuration, e.g. `--engine-field quantization=none,int8`); prints
a table each and writes JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import profile  # noqa: E402  (imports no JAX)

DUMP = tempfile.TemporaryDirectory(prefix="jaxpipe-hlo-")
profile.enable_dump(DUMP.name)  # before JAX's backend starts


def main() -> None:
    from jaxpipe_bench import BenchConfig, cli, field_choices, label
    from jaxpipe_bench.report import machine_info

    cfg = cli.parse(__doc__, BenchConfig, group="benchmark",
                    defaults={"json_path": profile.JSON_PATH})
    results = []
    for fields in field_choices(cfg.engine_fields):
        results.append(profile.profile_workload(cfg, Path(DUMP.name), fields=fields))
        print(f"\n{label(fields) or 'the engine as configured'}")
        print(profile.format_table(results[-1]))
    out = Path(cfg.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "config": vars(cfg),
                               "profiles": results}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
