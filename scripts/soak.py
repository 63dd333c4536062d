#!/usr/bin/env python
"""Soak a jaxpipe server: many concurrent clients over gRPC (streamed, batch, cancelled and
malformed requests) or the OpenAI-compatible HTTP API (streamed, plain, cancelled and malformed)
for as long as asked and at most --max-requests calls, with the engine process killed part-way
through; prints the counts and every breach of "each accepted request ends with exactly one
result or one error", then the RSS series.

  python scripts/soak.py --minutes 30                  # starts its own server (default model)
  python scripts/soak.py --minutes 3 --clients 64 --kill-at 0.3 --json out/soak.json
  python scripts/soak.py --transport http --minutes 3 --clients 32 --json out/http_soak.json
  python scripts/soak.py --minutes 10 --no-kill       # a leak within one engine
Exit code 1 when anything was breached. The logic lives in `jaxpipe_bench.soak`, the flags in
its `SoakConfig` and `jaxpipe_bench.soak_server`'s `SoakCommand`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpipe_bench import soak_server  # noqa: E402

if __name__ == "__main__":
    result = soak_server.run(*soak_server.parse(__doc__))
    sys.exit(1 if result.violations else 0)
