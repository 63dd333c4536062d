#!/usr/bin/env python
"""Print the installed distributions whose versions differ from a lock file's pins
(`make test-latest-deps`: what moved since `make lock`; logic and argument: `LockDriftConfig` in
jaxpipe_bench.lock_drift).

    python scripts/lock_drift.py requirements/test.lock
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import cli, lock_drift  # noqa: E402

if __name__ == "__main__":
    lock_drift.report(cli.parse(__doc__, lock_drift.LockDriftConfig))
