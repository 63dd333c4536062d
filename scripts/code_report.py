#!/usr/bin/env python
"""What a newcomer meets in the package, read statically: the longest functions, the classes
with the most methods, imports inside functions, packages importing each other both ways, the
root's modules, engine.py's length (logic in `jaxpipe_bench.code_report`).

  python scripts/code_report.py
  python scripts/code_report.py --root /tmp/old/jaxpipe --json out/code_before.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, code_report  # noqa: E402

if __name__ == "__main__":
    code_report.run(cli.parse(__doc__, code_report.ReportConfig))
