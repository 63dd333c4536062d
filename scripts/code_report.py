#!/usr/bin/env python
"""What a newcomer meets in the package, read statically: the longest functions, the classes
with the most methods, imports inside functions, packages importing each other both ways, the
root's modules, engine.py's length (logic in `jaxpipe_bench.code_report`).

  python scripts/code_report.py
  python scripts/code_report.py --root /tmp/old/jaxpipe --json out/code_before.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe.config_flags import add_flags, config_from_args  # noqa: E402
from jaxpipe_bench import code_report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, code_report.ReportConfig, group="report")
    cfg = config_from_args(code_report.ReportConfig, p.parse_args(), p)
    r = code_report.report(cfg)
    print(code_report.format_report(r))
    if cfg.json_path:
        code_report.write(r, cfg.json_path)


if __name__ == "__main__":
    main()
